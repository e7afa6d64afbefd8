# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 as users write it: .cpu()/.tolist()/.numpy()/float() of a device tensor, f-strings and
%-formats of any tensor expression, syncs under ``if rank == 0:`` or a short ``step % k`` period,
in helper methods called per step, and in progress-bar descriptions (detection, diffusion and LLM
loops in the style of public training scripts)."""
import logging

import torch
import torch.distributed as dist
import wandb
from tqdm import tqdm

logger = logging.getLogger(__name__)
RANK = int(__import__("os").environ.get("RANK", -1))


def train_detector(model, optimizer, scaler, loader, device, epoch, epochs):
    mloss = torch.zeros(3, device=device)
    pbar = tqdm(enumerate(loader), total=len(loader))
    for i, (imgs, targets) in pbar:
        with torch.autocast("cuda", dtype=torch.float16):
            loss, loss_items = model(imgs.to(device), targets.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        mloss = (mloss * i + loss_items) / (i + 1)
        if RANK in {-1, 0}:
            pbar.set_description(("%10s" + "%10.4g" * 3) % (f"{epoch}/{epochs - 1}", *mloss))  # expect: AG213


def train_diffusion(unet, optimizer, scaler, loader, noise_scheduler, writer, global_step=0):
    for step, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            noise_pred = unet(batch["noisy"], batch["t"])
            loss = torch.nn.functional.mse_loss(noise_pred.float(), batch["noise"].float())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        logs = {"loss": loss.detach().cpu(), "step": global_step}  # expect: AG213
        writer.log(logs)
        if step % 2 == 0:
            logger.info(f"step {step}: loss {loss.detach():.4f}")  # expect: AG213
        global_step += 1


def train_lm(model, optimizer, scaler, loader):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            wandb.log({"train/loss": float(outputs.loss)})  # expect: AG213
        print("ppl %.2f" % torch.exp(outputs.loss))  # expect: AG213
        logger.debug("token accuracy %s", outputs.logits.argmax(-1).eq(batch["labels"]).float().mean().tolist())  # expect: AG213


class Trainer:
    def __init__(self, model, optimizer, writer):
        self.model = model
        self.optimizer = optimizer
        self.writer = writer
        self.scaler = torch.amp.GradScaler("cuda")
        self.global_step = 0

    def _log_step(self, loss, grad_norm):
        self.writer.add_scalar("train/loss", loss.item(), self.global_step)  # expect: AG213
        self.writer.add_scalar("train/grad_norm", grad_norm.cpu().numpy(), self.global_step)  # expect: AG213

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return loss, grad_norm

    def fit(self, loader):
        for batch in loader:
            loss, grad_norm = self.train_step(batch)
            self._log_step(loss, grad_norm)
            self.global_step += 1


class DetTrainer:
    def __init__(self, model, optimizer, meters, cfg):
        self.model = model
        self.optimizer = optimizer
        self.meters = meters
        self.cfg = cfg
        self.scaler = torch.amp.GradScaler("cuda")

    def _update_meters(self, loss_dict):
        for name, value in loss_dict.items():
            self.meters[name].update(value.item())  # expect: AG213

    def run_iter(self, images, targets, pbar):
        with torch.autocast("cuda", dtype=torch.float16):
            loss_dict = self.model(images, targets)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.scaler.scale(losses).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._update_meters(loss_dict)
        pbar.desc = f"loss {losses.item():.3f}"  # expect: AG213

    def train(self, loader):
        pbar = tqdm(loader)
        for images, targets in pbar:
            self.run_iter(images, targets, pbar)


def train_gpt(model, optimizer, scaler, loader, log_interval, grad_accum):
    for iter_num, (X, Y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            logits, loss = model(X, Y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * grad_accum  # expect: AG213
        if iter_num % log_interval == 0:
            print(f"iter {iter_num}: loss {lossf:.4f}")
