# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG213 on per-step syncs only logged, in shapes from public training code: a config ``if``/
``else`` (each branch runs every step), a meter known by use (``.update(loss.item(), n)``), a
tracker's attribute, ``update_stats``, a name reassigned from its own ``.item()``."""
import torch

scaler = torch.amp.GradScaler("cuda")


def train(model, opt, loader, cfg, train_meter):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if cfg.DETECTION.ENABLE:
            train_meter.update_stats(None, loss.item())  # expect: AG213
        else:
            l2 = loss.item()  # expect: AG213
            train_meter.update_stats(None, l2)


def train_update_stats(model, opt, loader, train_meter):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        loss = loss.item()  # expect: AG213
        train_meter.update_stats(None, None, None, loss, 0.1)


class T:
    def train_epoch(self, loader, loss_mts):
        for batch in loader:
            self._run_step(batch, loss_mts)

    def _run_step(self, batch, loss_mts):
        loss = self.model(batch)
        scaler.scale(loss).backward()
        scaler.step(self.opt)
        scaler.update()
        loss_mts["x"].update(loss.item(), 4)  # expect: AG213
        self.losses.update(loss.item())  # expect: AG213


def update_policy(train_metrics, policy, batch, optimizer):
    loss = policy(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    train_metrics.loss = loss.item()  # expect: AG213
    return train_metrics


def train_policy(train_tracker, policy, loader, optimizer, log_freq):
    for step, batch in enumerate(loader):
        train_tracker = update_policy(train_tracker, policy, batch, optimizer)
        if step % log_freq == 0:
            print(train_tracker)


class AMPTrainer:
    """detectron2 style: the base class's loop calls ``run_step``; a flag set once in
    ``__init__`` is configuration; the event storage's ``put_scalar`` logs."""

    def __init__(self, model, optimizer, log_grad_scaler=False):
        self.model, self.optimizer = model, optimizer
        self.grad_scaler = torch.amp.GradScaler("cuda")
        self.log_grad_scaler = log_grad_scaler

    def run_step(self, data, storage):
        losses = self.model(data)
        self.grad_scaler.scale(losses).backward()
        if self.log_grad_scaler:
            storage.put_scalar("grad_scaler", self.grad_scaler.get_scale())  # expect: AG213
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
