# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 fires: checkpoints with model and optimizer state but no scaler state."""
import os

import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def save(out_dir, iter_num):
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iter_num": iter_num,
    }
    torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))  # expect: AG205


def save_inline(path, epoch):
    torch.save(dict(net=model.state_dict(), optim=optimizer.state_dict(), epoch=epoch), path)  # expect: AG205
