# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 look-alikes under a condition: the test asks whether the step ran (a flag computed from
the scale, a skip counter from the loop, a call), or the scheduler steps once per epoch."""
import torch


def pretrain(cfg, model, optimizer, loader, sched=None):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
        if not skipped and sched is not None:
            sched.step()
        optimizer.zero_grad(set_to_none=True)


def finetune(model, optimizer, loader, lr_scheduler, guard):
    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        scaler.scale(model(**batch).loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if guard.last_step_applied():
            lr_scheduler.step()
        optimizer.zero_grad()


def train(cfg, model, optimizer, loader, scheduler):
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(cfg.epochs):
        for x in loader:
            scaler.scale(model(x).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        if cfg.per_epoch_sched:
            scheduler.step()
