# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""Helpers in a sibling file: savers that hand the dict they get to torch.save."""
import os
import shutil

import torch


def is_main_process():
    return int(os.environ.get("RANK", "0")) == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    save_on_master(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def save_model(args, epoch, model, optimizer, loss_scaler):
    to_save = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "scaler": loss_scaler.state_dict(),
        "args": args,
    }
    save_on_master(to_save, os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
