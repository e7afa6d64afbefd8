# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 fires under conditions that do not ask whether the optimizer stepped: a scheduler that may
be None, a per-iteration switch in the config, an accumulation boundary (LLM pre-training and
segmentation loops in the style of public training scripts)."""
import torch


def pretrain(cfg, model, optimizer, loader, sched=None):
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.dtype == "float16")
    for it, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y) / cfg.grad_accum
        scaler.scale(loss).backward()
        if (it + 1) % cfg.grad_accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            if sched is not None:
                sched.step()  # expect: AG207
            optimizer.zero_grad(set_to_none=True)


class SegTrainer:
    def __init__(self, cfg, model, optimizer, lr_scheduler):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = torch.amp.GradScaler("cuda")

    def train_epoch(self, loader):
        for images, masks in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.model(images, masks)
            self.optimizer.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.cfg.per_iter_sched:
                self.lr_scheduler.step()  # expect: AG207
        if not self.cfg.per_iter_sched:
            self.lr_scheduler.step()
