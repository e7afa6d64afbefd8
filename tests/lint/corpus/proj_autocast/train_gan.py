# ruff: noqa  (a fixture written in the style of third-party training scripts)
"""A GAN step through the project's autocast helpers: backward under the helper's enabled region
fires (project mode), backward under ``enabled=False`` passed through the helper does not."""
import torch

from amp_utils import autocast, maybe_autocast, precision_ctx


def d_step(D, G, opt_d, scaler, real, z, r1_gamma):
    with autocast():
        fake = G(z).detach()
        loss_d = torch.nn.functional.softplus(D(fake)).mean() + torch.nn.functional.softplus(-D(real)).mean()
        scaler.scale(loss_d).backward()  # expect: AG214
    real.requires_grad_(True)
    with autocast(enabled=False):  # the R1 penalty in fp32
        real_pred = D(real.float())
        (r1_grads,) = torch.autograd.grad(real_pred.sum(), real)
        r1 = r1_grads.square().sum([1, 2, 3]).mean() * (r1_gamma / 2)
        r1.backward()
    with maybe_autocast(enabled=False):
        penalty = D(real).square().mean()
        penalty.backward()
    with precision_ctx(enabled=False):
        torch.autograd.backward(D(real).mean())
    scaler.step(opt_d)
    scaler.update()
    opt_d.zero_grad(set_to_none=True)


def g_step(D, G, opt_g, scaler, z):
    with maybe_autocast():
        loss_g = torch.nn.functional.softplus(-D(G(z))).mean()
        scaler.scale(loss_g).backward()  # expect: AG214
    with precision_ctx():
        G(z).mean().backward()  # expect: AG214
    scaler.step(opt_g)
    scaler.update()


class Runner:
    def __init__(self, accelerator, model, optimizer):
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer

    def step(self, batch):
        with self.accelerator.autocast(enabled=False):
            loss = self.model(batch).float().mean()
            self.accelerator.backward(loss)
        self.optimizer.step()
