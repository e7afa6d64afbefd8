# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 look-alikes: the dict that reaches the save holds the scaler (added in a branch), a
helper that adds the scaler before saving, saved twice (best / last)."""
import os

import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def save_on_master(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(*args, **kwargs)


def save_with_amp(state, path):
    state["scaler"] = scaler.state_dict()
    torch.save(state, path)


def main(loader, epochs, out, resume):
    if resume:
        checkpoint = torch.load(resume, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        scaler.load_state_dict(checkpoint["scaler"])
    for epoch in range(epochs):
        for x in loader:
            scaler.scale(model(x).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
        }
        if scaler.is_enabled():
            checkpoint["scaler"] = scaler.state_dict()
        save_on_master(checkpoint, os.path.join(out, f"model_{epoch}.pth"))
        save_on_master(checkpoint, os.path.join(out, "checkpoint.pth"))
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        save_with_amp(state, os.path.join(out, "amp.pth"))
