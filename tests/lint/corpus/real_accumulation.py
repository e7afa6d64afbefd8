# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Correct gradient accumulation with a scaler, a helper for unscale+clip, and resume: zero findings."""
import os

import torch
import torch.nn as nn


def unscale_and_clip(scaler, optimizer, model, max_norm):
    scaler.unscale_(optimizer)
    return nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def save_checkpoint(path, model, optimizer, scaler, scheduler, step):
    torch.save({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }, path)


def load_checkpoint(path, model, optimizer, scaler, scheduler):
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    scheduler.load_state_dict(ckpt["scheduler"])
    return ckpt["step"]


def train(model, loader, steps, accum=4, max_norm=1.0, out="ckpt", log_every=50):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=False)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler(device)
    start = 0
    if os.path.exists(out):
        start = load_checkpoint(out, model, optimizer, scaler, scheduler)
    model.train()
    running = torch.zeros((), device=device)
    step = start
    for micro, (x, y) in enumerate(loader):
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y) / accum
        scaler.scale(loss).backward()
        running += loss.detach()
        if (micro + 1) % accum:
            continue
        grad_norm = unscale_and_clip(scaler, optimizer, model, max_norm)
        old_scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= old_scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % log_every == 0:
            print(f"step {step} loss {running.item() / log_every:.4f} norm {grad_norm.item():.2f}")
            running.zero_()
            save_checkpoint(out, model, optimizer, scaler, scheduler, step)
        if step >= steps:
            break
    return step
