# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 look-alike through a clipping object: unscale_ runs before the callable that clips
(clip_grad_norm_ in its ``__call__``); a callable that only measures the norm is no clip."""
import torch


class ClipGradNorm:
    def __init__(self, max_norm):
        self.max_norm = max_norm

    def __call__(self, params):
        return torch.nn.utils.clip_grad_norm_(params, self.max_norm)


class GradNormMeter:
    def __call__(self, params):
        return torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))


class Trainer:
    def __init__(self, model, optimizer, cfg):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")
        self.clip_grad_norm = ClipGradNorm(cfg.max_norm)
        self.grad_norm = GradNormMeter()

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self.clip_grad_norm(self.model.parameters())
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_step_measured(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        norm = self.grad_norm(self.model.parameters())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return norm
