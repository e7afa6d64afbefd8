# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG202 look-alikes: exclusive branches, different optimizers, steps across iterations."""
import torch

g = torch.nn.Linear(4, 4)
d = torch.nn.Linear(4, 1)
opt_g = torch.optim.Adam(g.parameters())
opt_d = torch.optim.Adam(d.parameters())
optimizer = opt_g
scaler = torch.amp.GradScaler()


def exclusive(loss, use_amp):
    if use_amp:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def two_optimizers(loss_d, loss_g):
    scaler.scale(loss_d).backward()
    scaler.step(opt_d)
    opt_g.step()
    scaler.update()


def next_iteration(loader):
    for x in loader:
        optimizer.zero_grad()
        scaler.scale(g(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()


def correlated(loss, use_amp):
    if use_amp:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
    else:
        loss.backward()
    if not use_amp:
        optimizer.step()
    if use_amp:
        scaler.update()


def deferred_step(loader):
    for i, x in enumerate(loader):
        if i > 0:  # the previous batch's gradients, stepped once
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        scaler.scale(g(x).sum()).backward()
