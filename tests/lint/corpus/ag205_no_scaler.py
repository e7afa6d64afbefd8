# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A model+optimizer checkpoint in a file with no GradScaler: fine."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "ckpt.pt")
