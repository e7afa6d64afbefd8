# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 look-alikes: scheduler gated on the step having run, per-epoch scheduler, no scaler."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler()
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)


def gated(loader):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scale_before <= scaler.get_scale():
            scheduler.step()


def per_epoch(loader, epochs):
    for _ in range(epochs):
        for x in loader:
            scaler.scale(model(x).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()


def plateau(loader, val_loss):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    scheduler.step(val_loss)
