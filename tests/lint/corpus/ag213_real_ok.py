# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 look-alikes as users write them: syncs under a throttle (a period from the config, or 10
steps and more, also on the main rank only), tensors provably on the CPU, helpers called once per
epoch, and values the step needs anyway."""
import logging
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def train_detector(model, optimizer, scaler, loader, device, args):
    mloss = torch.zeros(3, device=device)
    for i, (imgs, targets) in enumerate(loader):
        t0 = time.time()
        with torch.autocast("cuda", dtype=torch.float16):
            loss, loss_items = model(imgs.to(device), targets.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        mloss = (mloss * i + loss_items) / (i + 1)
        elapsed = torch.tensor([time.time() - t0, imgs.shape[0]])  # a CPU tensor
        logger.info("%.3fs for %d images", *elapsed.tolist())
        if dist.get_rank() == 0 and i % args.log_interval == 0:
            logger.info(("%10.4g" * 3) % tuple(mloss))
        if i % 50 == 0:
            print(f"iter {i}: loss {loss.item():.4f}")


class Trainer:
    def __init__(self, model, optimizer, writer):
        self.model = model
        self.optimizer = optimizer
        self.writer = writer
        self.scaler = torch.amp.GradScaler("cuda")

    def _log_epoch(self, loss, epoch):
        self.writer.add_scalar("train/last_loss", loss.item(), epoch)

    def fit(self, loader, epochs):
        for epoch in range(epochs):
            for batch in loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = self.model(batch)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad()
            self._log_epoch(loss, epoch)


def train_with_check(model, optimizer, loader):
    for batch in loader:
        loss = model(batch)
        loss_value = float(loss)  # read to stop on a non-finite loss: the sync is needed
        if loss_value != loss_value:
            raise RuntimeError("loss is NaN")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        logger.info("loss %.4f", loss_value)


def train_one_epoch(model, optimizer, scaler, loader, epoch):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    logger.info(f"epoch {epoch}: last loss {loss.item():.4f}")  # once per epoch


def main(model, optimizer, loader, epochs):
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        train_one_epoch(model, optimizer, scaler, loader, epoch)
