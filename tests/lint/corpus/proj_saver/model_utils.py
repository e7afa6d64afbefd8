# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Savers that build the checkpoint dict themselves from what they are passed (LLM fine-tuning
repositories do this): one without the scaler, one with it, one that exports weights only."""
import os

import torch


def save_checkpoint(model, optimizer, lr, it, path):
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr": lr,
            "iter": it,
        },
        path,
    )


def save_resumable(model, optimizer, scaler, it, out_dir):
    ckpt = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "iter": it,
    }
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))


def export_weights(model, path):
    torch.save({"model": model.state_dict(), "optimizer": None}, path)
