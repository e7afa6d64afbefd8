# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 where the checkpoint holds an entry the rule cannot classify, but whose object is seen
and is not a scaler (``instantiate_from_config``), and through a checkpointer object built
without the scaler (fvcore/detectron2 style)."""
import torch
from somewhere import instantiate_from_config
from detectron2.checkpoint import DetectionCheckpointer


class Solver:
    def __init__(self, model, opt, cfg):
        self.model, self.opt = model, opt
        self.scaler = torch.amp.GradScaler("cuda")
        self.clip_grad_norm = instantiate_from_config(cfg)

    def save(self, path):
        state_dict = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        state_dict["clip_grad_norm"] = self.clip_grad_norm.state_dict()
        torch.save(state_dict, path)  # expect: AG205


def build(model, optimizer, scheduler, cfg):
    scaler = torch.amp.GradScaler("cuda")
    checkpointer = DetectionCheckpointer(  # expect: AG205
        model, cfg.OUTPUT_DIR, optimizer=optimizer, scheduler=scheduler
    )
    return checkpointer, scaler
