# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Clipping in a file with no GradScaler at all: nothing to report."""
import torch

model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
for x in [torch.randn(2, 4)]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
