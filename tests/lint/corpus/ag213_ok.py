# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 look-alikes: throttled logging, values used for control flow, eval loops."""
import math

import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()


def train(loader, log_every):
    running = 0.0
    for step, x in enumerate(loader):
        loss = model(x).sum()
        loss_value = loss.item()  # read for control flow: the sync is needed anyway
        if not math.isfinite(loss_value):
            raise RuntimeError("non-finite loss")
        scaler.scale(loss).backward()
        inv_scale = 1.0 / scaler.get_scale()
        grads = [p.grad * inv_scale for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        running += loss_value  # a Python float: no sync
        if step % log_every == 0:
            print(f"step {step} loss {loss.item():.4f} grads {len(grads)}")


def validate(loader):
    for x in loader:
        print(model(x).sum().item())


def epoch_summary(loader, epochs):
    for epoch in range(epochs):
        for x in loader:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} last loss {loss.item()}")
