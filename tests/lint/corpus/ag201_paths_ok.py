# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 look-alikes: the clip in the fp32 branch of a loop-invariant ``if use_fp16:`` (an
accumulation loop never switches branch), and in the ``else:`` of ``if scaler is not None:`` when
a helper guards the scaled backward with its own ``if scaler is not None:``."""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--precision", default="fp16")
parser.add_argument("--accum", type=int, default=4)
args = parser.parse_args()

model = DDP(torch.nn.Linear(4, 4))
optimizer = torch.optim.AdamW(model.parameters())
use_fp16 = args.precision == "fp16"
scaler = torch.amp.GradScaler("cuda", enabled=use_fp16) if use_fp16 else None


def train(loader, max_norm):
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
            loss = torch.nn.functional.mse_loss(model(x), y) / args.accum
        if use_fp16:
            scaler.scale(loss).backward()
            if (step + 1) % args.accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        else:
            loss.backward()
            if (step + 1) % args.accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                optimizer.zero_grad()


def backward_step(loss, scaler):
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def train_with_helper(loader, max_norm):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward_step(loss, scaler)
        if scaler is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
        optimizer.zero_grad()


def train_truthy(loader, max_norm, amp_scaler=None):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward_step(loss, amp_scaler)
        if not amp_scaler:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
        else:
            amp_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            amp_scaler.step(optimizer)
            amp_scaler.update()
        optimizer.zero_grad()
