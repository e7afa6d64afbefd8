# ruff: noqa  (a fixture written in the style of third-party training scripts)
import torch


def write_checkpoint(path, payload):
    torch.save(payload, path)
