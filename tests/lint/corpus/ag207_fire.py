# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 fires: the LR scheduler steps right after scaler.step(), skipped or not."""
import torch
from transformers import get_linear_schedule_with_warmup

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler()
lr_scheduler = get_linear_schedule_with_warmup(optimizer, 10, 100)
warmup = torch.optim.lr_scheduler.LinearLR(optimizer)

for step, x in enumerate([torch.randn(2, 4)]):
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    lr_scheduler.step()  # expect: AG207
    optimizer.zero_grad()


def accumulate(loader, accum):
    for i, x in enumerate(loader):
        scaler.scale(model(x).sum()).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            warmup.step()  # expect: AG207
            optimizer.zero_grad()
