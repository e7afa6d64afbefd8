# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 stays quiet on the gate its own fix recommends, assigned in a step helper (no loop):
``stepped = scale_prev <= scaler.get_scale()`` (the style of public segmentation codebases), and
on a subscripted collection that holds no scheduler."""
import torch

scaler = torch.amp.GradScaler("cuda")


def optimize(loss, optimizer, scheduler):
    update_lr_scheduler = True
    scaler.scale(loss).backward()
    scale_prev = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    update_lr_scheduler = scale_prev <= scaler.get_scale()
    if scheduler is not None and update_lr_scheduler:
        scheduler.step()


def optimize_annotated(loss, optimizer, lr_sched):
    scaler.scale(loss).backward()
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    took: bool = before <= scaler.get_scale()
    if took:
        lr_sched.step()


def optimize_many(loss, parts):
    scaler.scale(loss).backward()
    scaler.step(parts["optimizer"])
    scaler.update()
    parts["ema"]["module"].step()
