# ruff: noqa  (a fixture written in the style of third-party training scripts)
import torch

import a
from b import bounce as again


def bounce(x):
    return a.loop_forever(x) if x else again(x)


def save_state(state):
    torch.save(state, "state.pt")
