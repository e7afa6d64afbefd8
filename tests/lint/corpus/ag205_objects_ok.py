# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG205 stays quiet when an unclassified entry may be the scaler (an alias, an object that is
never assigned here), and when the checkpointer is handed the scaler or an object that may save
it (``trainer=self``)."""
import torch
from detectron2.checkpoint import DetectionCheckpointer


class Solver:
    def __init__(self, model, opt, amp_state):
        self.model, self.opt = model, opt
        self.scaler = torch.amp.GradScaler("cuda")
        self.amp_state = amp_state  # handed in: may be the scaler

    def save(self, path):
        state_dict = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        state_dict["extra"] = self.amp_state.state_dict()
        torch.save(state_dict, path)


def build(model, optimizer, cfg, trainer):
    scaler = torch.amp.GradScaler("cuda")
    a = DetectionCheckpointer(model, cfg.OUTPUT_DIR, optimizer=optimizer, grad_scaler=scaler)
    b = DetectionCheckpointer(model, cfg.OUTPUT_DIR, optimizer=optimizer, trainer=trainer)
    return a, b
