# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 fires: per-step syncs into running totals, metric meters and formatted tensors."""
import argparse

import torch
import torch.nn.functional as F
from tqdm import tqdm

import utils
from utils import AverageMeter

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def train_one_epoch(loader, epoch):
    metric_logger = utils.MetricLogger(delimiter="  ")
    for images, target in metric_logger.log_every(loader, 10, f"Epoch: [{epoch}]"):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(images), target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])  # expect: AG213


def train_meters(loader):
    losses = AverageMeter("Loss", ":.4e")
    for images, target in loader:
        loss = F.cross_entropy(model(images), target)
        losses.update(loss.item(), images.size(0))  # expect: AG213
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses.avg


def train_unet(loader):
    model.train()
    epoch_loss = 0
    with tqdm(total=len(loader), desc="train") as pbar:
        for batch in loader:
            with torch.autocast("cuda"):
                pred = model(batch["image"])
                loss = F.mse_loss(pred, batch["mask"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            pbar.update(batch["image"].shape[0])
            epoch_loss += loss.item()  # expect: AG213
            pbar.set_postfix(**{"loss (batch)": epoch_loss})
    return epoch_loss / len(loader)


def train_formatting(loader, log):
    pbar = tqdm(loader)
    for x, y in pbar:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        pbar.set_description(f"loss {loss:.4f}")  # expect: AG213
        log.info("loss " + str(loss))  # expect: AG213
        print(loss)  # expect: AG213
