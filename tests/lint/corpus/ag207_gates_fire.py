# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""AG207 under tests that look at the scheduler, not at the step: an ``isinstance``/``hasattr``
type test, and schedulers reached by subscript (``op_sc['scheduler']['module']``,
``self.schedulers[0]``) in the style of public video and detection trainers."""
import torch

scaler = torch.amp.GradScaler("cuda")


def train(model, opt, sched, loader):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(loss)
        else:
            sched.step()  # expect: AG207


def train_hasattr(model, opt, lr_scheduler, loader):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if hasattr(lr_scheduler, "step"):
            lr_scheduler.step()  # expect: AG207


def train_subscript(model, loader, op_sc):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(op_sc["optimizer"]["module"])
        scaler.update()
        op_sc["scheduler"]["module"].step()  # expect: AG207


class Trainer:
    def step(self, loss):
        scaler.scale(loss).backward()
        scaler.step(self.optimizers[0])
        scaler.update()
        self.schedulers[0].step()  # expect: AG207
