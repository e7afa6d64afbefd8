# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG208 fires: weights_only=False (any torch version)."""
import torch
from torch import load as torch_load

state = torch.load("ckpt.pt", map_location="cpu", weights_only=False)  # expect: AG208
other = torch_load("other.pt", weights_only=False)  # expect: AG208
