# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG204 fires: no update() after step() in a loop; update() on every micro-batch."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()


def no_update(loader):
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)  # expect: AG204
        optimizer.zero_grad()


def update_per_epoch(loader, epochs):
    for _ in range(epochs):
        for x in loader:
            scaler.scale(model(x).sum()).backward()
            scaler.step(optimizer)  # expect: AG204
            optimizer.zero_grad()
        scaler.update()


def update_every_micro_batch(loader, accum):
    for i, x in enumerate(loader):
        scaler.scale(model(x).sum() / accum).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            optimizer.zero_grad()
        scaler.update()  # expect: AG204


def update_in_inner_loop(batches, accum):
    for micro_batches in batches:
        for x in micro_batches:
            scaler.scale(model(x).sum() / accum).backward()
            scaler.update()  # expect: AG204
        scaler.step(optimizer)
        optimizer.zero_grad()
