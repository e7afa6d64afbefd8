# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A detector's optimizer hook through the package's clipping object (core/hooks.py): calling it
before unscale_ clips scaled gradients (project mode); after unscale_ it is fine."""
import torch

from core import GradClipper


class AmpOptimizerHook:
    def __init__(self, model, optimizer, grad_clip=None):
        self.model = model
        self.optimizer = optimizer
        self.loss_scaler = torch.amp.GradScaler("cuda")
        self.grad_limiter = GradClipper(**(grad_clip or {}))

    def after_train_iter(self, loss):
        self.optimizer.zero_grad()
        self.loss_scaler.scale(loss).backward()
        self.grad_limiter(self.model.parameters())  # expect: AG201
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update()

    def after_train_iter_unscaled(self, loss):
        self.optimizer.zero_grad()
        self.loss_scaler.scale(loss).backward()
        self.loss_scaler.unscale_(self.optimizer)
        self.grad_limiter(self.model.parameters())
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update()
