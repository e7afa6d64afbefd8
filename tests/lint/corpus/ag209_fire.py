# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG209 fires: log of softmax, as functions, methods and through a name."""
import torch
import torch.nn.functional as F


def losses(logits, target):
    a = -torch.log(torch.softmax(logits, dim=-1))[range(len(target)), target].mean()  # expect: AG209
    b = F.softmax(logits, -1).log()  # expect: AG209
    probs = logits.softmax(dim=-1)
    c = torch.log(probs)  # expect: AG209
    d = torch.log(torch.nn.Softmax(dim=-1)(logits))  # expect: AG209
    return a + b.sum() + c.sum() + d.sum()
