# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG208 look-alikes: weights_only=True, other load functions, the default on torch >= 2.6."""
import json
import pickle

import numpy as np
import torch

state = torch.load("ckpt.pt", weights_only=True)
default = torch.load("ckpt.pt", map_location="cpu")
arr = np.load("x.npy")
cfg = json.load(open("cfg.json"))
obj = pickle.load(open("x.pkl", "rb"))
