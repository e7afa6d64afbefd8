# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 stays quiet where the value is used beyond logging, where ``.update()`` takes a dict,
and under a throttle that is not the configuration."""
import torch

scaler = torch.amp.GradScaler("cuda")


def train(model, opt, loader, cfg, stats, log_now):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        stats.update({"seen": 1})
        value = loss.item()
        if value > cfg.max_loss:
            break
        if log_now(x):
            print(loss.item())


class Trainer:
    """A flag the step itself changes is a throttle, not configuration; a ``*_step`` helper that
    does not train is not a step."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.log_now = False

    def run_step(self, data, storage, i):
        losses = self.model(data)
        scaler.scale(losses).backward()
        self.log_now = i % 100 == 0
        if self.log_now:
            storage.put_scalar("scale", scaler.get_scale())
        scaler.step(self.optimizer)
        scaler.update()

    def log_step(self, losses, storage):
        storage.put_scalar("loss", losses.item())
