# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG203 through a factory of another file that returns a tuple holding the scaler."""
import torch

from build import build_training


def train(cfg, loader):
    model, optimizer, scaler = build_training(cfg)  # expect: AG203
    for x in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
