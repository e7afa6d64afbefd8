# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Correct code in the style of timm's train.py: a loss-scaler wrapper, partial autocast."""
import argparse
import time
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler=None,
                    amp_autocast=suppress, loss_scaler=None):
    losses_m = AverageMeter()
    model.train()
    num_updates = epoch * len(loader)
    accum_steps = args.grad_accum_steps
    last_batch_idx = len(loader) - 1
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)
        if accum_steps > 1:
            loss /= accum_steps
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad,
                        parameters=model.parameters(), need_update=need_update)
        else:
            loss.backward()
            if need_update:
                if args.clip_grad is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
        if not args.distributed:
            losses_m.update(loss.item() * accum_steps, input.size(0))  # expect: AG213 (a config test does not throttle)
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        if last_batch or batch_idx % args.log_interval == 0:
            lrl = [param_group["lr"] for param_group in optimizer.param_groups]
            print(f"Train: {epoch} [{batch_idx}] Loss: {losses_m.sum / max(losses_m.count, 1)} "
                  f"LR: {sum(lrl) / len(lrl):.3e} time {time.time()}")
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates)
    return losses_m


def validate(model, loader, loss_fn, amp_autocast=suppress):
    model.eval()
    meter = AverageMeter()
    with torch.no_grad():
        for input, target in loader:
            with amp_autocast():
                output = model(input)
            loss = loss_fn(output, target)
            meter.update(loss.item(), input.size(0))
    return meter


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-dtype", default="float16")
    args = parser.parse_args()
    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
        amp_autocast = partial(torch.autocast, device_type="cuda", dtype=amp_dtype)
        if amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
    if loss_scaler is not None:
        state[loss_scaler.state_dict_key] = loss_scaler.state_dict()
    torch.save(state, "checkpoint.pth.tar")
    return amp_autocast
