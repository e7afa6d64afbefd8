# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 fires: the saved dict's name is assigned more than once (resume, reset, rebuild), one
dict is saved twice (best / last), a same-file helper saves it."""
import argparse
import os
import shutil

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--resume", default="")
parser.add_argument("--out", default="runs")
args = parser.parse_args()

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def main(loader, epochs):
    start_epoch, best = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        ckpt = None  # free the memory before training
    for epoch in range(start_epoch, epochs):
        val_loss = train_epoch(loader)
        ckpt = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
        }
        torch.save(ckpt, os.path.join(args.out, "last.pt"))  # expect: AG205
        if val_loss < best:
            best = val_loss
            torch.save(ckpt, os.path.join(args.out, "best.pt"))  # the same dict: listed in the finding at line 41
        save_checkpoint({  # expect: AG205
            "epoch": epoch + 1,
            "state_dict": model.state_dict(),
            "optimizer": optimizer.state_dict(),
        }, val_loss <= best)


def train_epoch(loader):
    total = 0.0
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return total
