# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG209 look-alikes: log_softmax, clamped/epsilon probabilities, numpy."""
import numpy as np
import torch
import torch.nn.functional as F


def losses(logits, target, probs_np):
    a = F.nll_loss(F.log_softmax(logits, -1), target)
    probs = torch.softmax(logits, -1)
    entropy = -(probs * torch.log(probs + 1e-9)).sum()
    b = torch.log(torch.softmax(logits, -1).clamp(min=1e-8))
    c = np.log(probs_np)
    d = torch.log(logits.exp())
    e = torch.log(torch.sigmoid(logits))  # AG209 covers softmax only
    return a + entropy + b.sum() + float(c.sum()) + d.sum() + e.sum()
