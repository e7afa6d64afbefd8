# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Two files that import each other (a cycle) and a name that re-exports itself."""
import torch

import b
from a import loop_forever
from b import save_state


def loop_forever(x):
    return b.bounce(x)


def train(loader, model, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(model(x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        loop_forever(x)
    save_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()})  # expect: AG205
