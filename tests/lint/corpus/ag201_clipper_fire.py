# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG201 through a clipping object: the trainer holds a callable whose ``__call__`` runs
clip_grad_norm_ (mmengine/detectron-style), or a functools.partial of it, and calls it before
unscale_."""
import functools

import torch


class ClipGradNorm:
    def __init__(self, max_norm, norm_type=2.0):
        self.max_norm = max_norm
        self.norm_type = norm_type

    def __call__(self, params):
        params = [p for p in params if p.grad is not None]
        if not params:
            return None
        return self._clip(params)

    def _clip(self, params):
        return torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type)


class Trainer:
    def __init__(self, model, optimizer, cfg):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")
        self.clip_grad_norm = ClipGradNorm(cfg.max_norm)
        self.clip_value = functools.partial(torch.nn.utils.clip_grad_value_, clip_value=cfg.clip)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.clip_grad_norm(self.model.parameters())  # expect: AG201
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_step_value(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.clip_value(self.model.parameters())  # expect: AG201
        self.scaler.step(self.optimizer)
        self.scaler.update()
