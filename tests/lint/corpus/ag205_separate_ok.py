# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 look-alike: the scaler's state is saved, in a file of its own (HF Trainer style)."""
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")


def save(out_dir):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               f"{out_dir}/train_state.pt")
    torch.save(scaler.state_dict(), f"{out_dir}/scaler.pt")
