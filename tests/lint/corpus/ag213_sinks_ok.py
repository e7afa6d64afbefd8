# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 look-alikes: throttled meters, Python floats, totals read for control flow, formatting a
number instead of a tensor, totals kept on the device."""
import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

import utils

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def train_one_epoch(loader, print_freq):
    metric_logger = utils.MetricLogger(delimiter="  ")
    for step, (samples, _) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(samples).pow(2).mean()
        loss_value = loss.item()
        if not math.isfinite(loss_value):  # the step needs the value: the sync is not waste
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        metric_logger.update(loss=loss_value)
        if step % print_freq == 0:
            metric_logger.update(lr=optimizer.param_groups[0]["lr"], scale=scaler.get_scale())


def train_early_stop(loader, budget):
    total = 0.0
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += loss.item()
        if total > budget:  # the running total steers the loop
            break
    return total


def train_on_device(loader):
    running = torch.zeros(())
    pbar = tqdm(loader)
    for step, (x, y) in enumerate(pbar):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        running += loss.detach()
        lr = optimizer.param_groups[0]["lr"]
        pbar.set_description(f"lr {lr:.2e} step {step}")
        if step % 100 == 0:
            pbar.set_postfix(loss=f"{loss:.4f}")
    return running.item()


def train_then_report(loader):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        loss = loss.item()
        optimizer.zero_grad()
        if math.isnan(loss):
            raise FloatingPointError("nan loss")
        print(f"loss {loss}")


def stats_dict(loader):
    stats = {}
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        stats.update(loss=loss.item())
    return stats
