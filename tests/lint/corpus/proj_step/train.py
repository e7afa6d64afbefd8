# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 through the project's step helpers (engine.py): clipping in the caller's scaler branch
without unscale_ fires; clipping in its else branch, or after unscale_, stays silent."""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import engine
from engine import backward

parser = argparse.ArgumentParser()
parser.add_argument("--amp", action="store_true")
parser.add_argument("--clip-grad", type=float, default=None)
args = parser.parse_args()

model = DDP(torch.nn.Linear(4, 4))
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda") if args.amp else None


def train_one_epoch(loader):
    for x, y in loader:
        with torch.autocast("cuda", enabled=scaler is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        backward(loss, scaler)
        if scaler is not None:
            if args.clip_grad is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        elif args.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        engine.optimizer_step(optimizer, scaler)


def train_forgot_unscale(loader):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        engine.backward(loss, scaler=scaler)
        if scaler is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: AG201
        engine.optimizer_step(optimizer, scaler)
