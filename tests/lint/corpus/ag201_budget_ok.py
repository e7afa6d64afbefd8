# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 look-alike past the path budget: a detection-style epoch with unrelated config flags
(channels-last, multi-scale, EMA, gradient logging) around a loop-invariant ``if cfg.use_fp16:``
that clips after unscale_ in the fp16 branch and clips plain gradients in the ``else:``. Merging
the flags' assumption sets must not send the fp16 path into the else branch (it used to)."""
import random

import torch
import torch.nn.functional as F


def train_one_epoch(cfg, model, optimizer, scaler, loader, ema, writer):
    for i, (imgs, targets) in enumerate(loader):
        if cfg.channels_last:
            imgs = imgs.to(memory_format=torch.channels_last)
        if cfg.multi_scale:
            size = random.randrange(cfg.imgsz // 2, cfg.imgsz * 3 // 2) // 32 * 32
            imgs = F.interpolate(imgs, size=size, mode="bilinear")
        with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.use_fp16):
            loss = model(imgs, targets) / cfg.accumulate
        if cfg.use_fp16:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % cfg.accumulate == 0:
            if cfg.use_fp16:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
                optimizer.step()
            optimizer.zero_grad()
        if cfg.ema:
            ema.update(model)
        if cfg.log_grads:
            writer.add_histogram("grad", model.head.weight.grad, i)
