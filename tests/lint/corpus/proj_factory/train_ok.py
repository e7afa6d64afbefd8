# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Look-alikes through the sibling helpers: the factory's scaler is switched on only for fp16,
backward runs after the helper's autocast block, the checkpoint holds the scaler."""
import argparse

import torch

import amp

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16


def train(loader):
    grad_scaler = amp.create_grad_scaler(enabled=args.dtype == "float16")
    for x, y in loader:
        with amp.autocast_ctx(dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x), y)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": grad_scaler.state_dict()}, "ckpt.pt")


def train_off(loader):
    with amp.maybe_autocast(False):
        loss = model(loader).sum()
        loss.backward()


def train_after_warmup(loader):
    with amp.warmed_up(model):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
