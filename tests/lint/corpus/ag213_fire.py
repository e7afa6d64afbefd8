# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 fires: a per-step .item() / get_scale() used only for logging."""
import logging

import torch

log = logging.getLogger(__name__)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()


def train(loader, pbar, writer):
    for step, x in enumerate(loader):
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f}")  # expect: AG213
        writer.add_scalar("scale", scaler.get_scale(), step)  # expect: AG213
        lossf = loss.item()  # expect: AG213
        pbar.set_postfix(loss=lossf)
        log.info("loss %.3f", lossf)
