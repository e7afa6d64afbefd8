# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 through the project's own savers: `import utils`, `from utils import ...`, a package that
re-exports its saver. The dict is built here; the sibling file only saves it."""
import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import utils
from ckpt_pkg import write_checkpoint
from utils import save_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=90)
parser.add_argument("--output-dir", default="out")
args = parser.parse_args()

model = DDP(torch.nn.Linear(4, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")


def train_one_epoch(loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def main(loader):
    for epoch in range(args.epochs):
        train_one_epoch(loader)
        checkpoint = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "args": args,
        }
        utils.save_on_master(checkpoint, f"{args.output_dir}/model_{epoch}.pth")  # expect: AG205
        save_checkpoint({  # expect: AG205
            "epoch": epoch + 1,
            "state_dict": model.state_dict(),
            "optimizer": optimizer.state_dict(),
        }, is_best=False)
        write_checkpoint(f"{args.output_dir}/last.pth", {  # expect: AG205
            "model": model.state_dict(), "optimizer": optimizer.state_dict()})
