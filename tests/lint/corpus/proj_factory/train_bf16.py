# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG203 / AG214 / AG205 through the sibling helpers: the scaler is built by a factory in amp.py,
the autocast region comes from amp.py."""
import argparse

import torch

from amp import autocast_ctx, create_grad_scaler, maybe_autocast

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())


def train(loader):
    scaler = create_grad_scaler()  # expect: AG203
    for x, y in loader:
        with autocast_ctx(dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "ckpt.pt")  # expect: AG205


def train_backward_inside(loader):
    for x, y in loader:
        with maybe_autocast(True):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # expect: AG214
        optimizer.step()
        optimizer.zero_grad()
