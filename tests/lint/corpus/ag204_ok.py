# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG204 look-alikes: correct accumulation, update in a helper, correlated branches."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()


def finish(s):
    s.update()


def accumulate(loader, accum):
    for i, x in enumerate(loader):
        scaler.scale(model(x).sum() / accum).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


def helper_update(loader):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        finish(scaler)


def correlated(loader, amp):
    for x in loader:
        loss = model(x).sum()
        if amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        else:
            loss.backward()
            optimizer.step()
        if amp:
            scaler.update()


def multiple_optimizers(loader, opts):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()


def stepped_elsewhere(loader, trainer):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        trainer.optimizer_step(scaler)
