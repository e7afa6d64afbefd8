# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 fires on real paths: the fp16 branch clips scaled gradients; a helper scales the loss when
a scaler is given and the caller clips in its own scaler branch without unscale_."""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--clip", type=float, default=1.0)
args = parser.parse_args()

model = DDP(torch.nn.Linear(4, 4))
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda") if args.fp16 else None


def backward(loss, scaler):
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def train(loader):
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", enabled=args.fp16):
            loss = torch.nn.functional.mse_loss(model(x), y) / args.accum
        if args.fp16:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % args.accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AG201
            if args.fp16:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()


def train_helper(loader):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss, scaler)
        if scaler is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AG201
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
