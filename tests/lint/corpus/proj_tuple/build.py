# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""The project's builder: returns the model, the optimizer and a GradScaler together."""
import torch


def build_training(cfg):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    return model, optimizer, scaler
