# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 stays quiet where the value is used beyond logging, where ``.update()`` takes a dict,
and under a throttle that is not the configuration."""
import torch

scaler = torch.amp.GradScaler("cuda")


def train(model, opt, loader, cfg, stats, log_now):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        stats.update({"seen": 1})
        value = loss.item()
        if value > cfg.max_loss:
            break
        if log_now(x):
            print(loss.item())
