# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A gradient-clipping hook object (mmengine-style): calling it clips."""
import torch


class GradClipper:
    def __init__(self, max_norm=35.0, norm_type=2):
        self.max_norm = max_norm
        self.norm_type = norm_type

    def __call__(self, params):
        params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
        if len(params) > 0:
            return torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type)
        return None
