# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG210 look-alikes: the logits versions, BCE outside autocast or in a disabled/CPU region."""
import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 1)
criterion = nn.BCELoss()
logits_loss = nn.BCEWithLogitsLoss()


def train(x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
        a = F.binary_cross_entropy_with_logits(logits, y)
        b = logits_loss(logits, y)
        with torch.autocast("cuda", enabled=False):
            c = F.binary_cross_entropy(torch.sigmoid(logits.float()), y)
    d = criterion(torch.sigmoid(logits.float()), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = F.binary_cross_entropy(torch.sigmoid(model(x)), y)
    return a + b + c + d + e
