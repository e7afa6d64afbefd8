# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Pre-training that saves through the saver that includes the scaler's state: silent."""
import torch

from model_utils import export_weights, save_resumable


def pretrain(model, optimizer, loader, out_dir):
    scaler = torch.amp.GradScaler("cuda")
    for it, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if it % 2000 == 0:
            save_resumable(model, optimizer, scaler, it, out_dir)
    export_weights(model, f"{out_dir}/final.pt")
