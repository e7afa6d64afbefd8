# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG214 fires: the backward pass runs inside the autocast region."""
import argparse

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--accum", type=int, default=4)
args = parser.parse_args()

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def train(loader):
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) / args.accum
            scaler.scale(loss).backward()  # expect: AG214
        if (step + 1) % args.accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def train_bf16(loader, device):
    ctx = torch.autocast(device_type=device, dtype=torch.bfloat16)
    for x, y in loader:
        with ctx:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()  # expect: AG214
        optimizer.step()
        optimizer.zero_grad()


def train_grads(loader, params):
    for x, y in loader:
        with torch.autocast("cuda"):
            loss = F.mse_loss(model(x), y)
            grads = torch.autograd.grad(scaler.scale(loss), params)  # expect: AG214
        for p, g in zip(params, grads):
            p.grad = g
        scaler.step(optimizer)
        scaler.update()
