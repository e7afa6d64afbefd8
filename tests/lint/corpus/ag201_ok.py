# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 look-alikes that must not fire."""
import torch
from torch.nn.utils import clip_grad_norm_

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")


def unscale_then_clip(loader):
    for x, _ in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def unscale_and_clip(s, opt, net):
    s.unscale_(opt)
    clip_grad_norm_(net.parameters(), 1.0)


def unscale_in_helper(loader):
    for x, _ in loader:
        scaler.scale(model(x).sum()).backward()
        unscale_and_clip(scaler, optimizer, model)
        scaler.step(optimizer)
        scaler.update()


def correlated_branches(loader, use_amp):
    for x, _ in loader:
        loss = model(x).sum()
        if use_amp:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if use_amp:
            scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 1.0)
        if use_amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()


def plain_fp32(loader):
    for x, _ in loader:
        model(x).sum().backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def clip_before_backward_next_step(loader):
    for x, _ in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        clip_grad_norm_(model.parameters(), 1.0)  # grads of a finished step, not scaled ones


def accumulate(loader, accum):
    for i, (x, _) in enumerate(loader):
        scaler.scale(model(x).sum() / accum).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def disabled_scaler(loader):
    off = torch.amp.GradScaler("cuda", enabled=False)
    for x, _ in loader:
        off.scale(model(x).sum()).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        off.step(optimizer)
        off.update()
