"""The rescue's fp32 workspace: views kept between steps, memory only during one; memory that
something else still holds is never freed under it (an optimizer that keeps a gradient or a
weight in its state), and a torch or device without the means falls back to fresh tensors."""

import torch
import torch.nn.functional as F
from torch import nn

from ampguard.core import workspace as ws_module
from ampguard.core.rescue import Rescue
from ampguard.core.workspace import contiguous_geometry, workspace


def test_a_workspace_holds_no_memory_at_rest_and_keeps_its_views():
    ws = workspace(10, contiguous_geometry([(2, 3), (4,)]), "cpu")
    assert ws is not None and ws.storage.nbytes() == 0
    views = ws.acquire()
    assert ws.storage.nbytes() == 40 and [tuple(v.shape) for v in views] == [(2, 3), (4,)]
    views[0].fill_(1.0)
    views[1].fill_(2.0)
    assert ws.flat.tolist() == [1.0] * 6 + [2.0] * 4  # one flat buffer, in the layout's order
    del views
    assert ws.release() and ws.storage.nbytes() == 0 and not ws.retired
    assert ws.acquire()[0] is ws.views[0]  # the same tensors, memory again


def test_memory_someone_else_holds_is_not_freed():
    ws = workspace(8, contiguous_geometry([(8,)]), "cpu")
    assert ws is not None
    kept_view = ws.acquire()[0].view(2, 4)  # another tensor on the same storage
    kept_view.fill_(3.0)
    assert not ws.release() and ws.retired
    assert kept_view.sum().item() == 24.0  # its memory is still there
    ws2 = workspace(8, contiguous_geometry([(8,)]), "cpu")
    assert ws2 is not None
    kept_ref = ws2.acquire()[0]  # a reference to the view itself
    assert not ws2.release() and kept_ref.numel() == 8 and ws2.storage.nbytes() == 32


def test_without_the_storage_use_count_there_is_no_workspace(monkeypatch):
    monkeypatch.setattr(ws_module, "_use_count", None)
    assert workspace(4, contiguous_geometry([(4,)]), "cpu") is None
    model = nn.Linear(8, 8).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rescue = Rescue([opt], list(model.parameters()))
    rescue.cover([0, 1], "kahan")
    for _ in range(3):  # fresh fp32 tensors each step, as before workspaces
        x = torch.ones(4, 8, dtype=torch.bfloat16)
        F.mse_loss(model(x).float(), torch.zeros(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    plans = [plan for _, plans in rescue._plans.values() for plan in plans]
    assert all(plan.workspace.get() is None for plan in plans)


def _train(opt, model, steps):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
        F.mse_loss(model(x).float(), torch.zeros(4, 8)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_rescued_steps_free_the_fp32_copies_between_steps_and_reuse_their_tensors():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rescue = Rescue([opt], list(model.parameters()))
    rescue.cover([0, 1, 2, 3], "kahan")
    _train(opt, model, 3)
    (plan,) = rescue._plans_of(opt, rescue._opt[id(opt)])
    assert plan.states is not None
    spaces = (plan.workspace.get(), plan.states.workspace.get())  # (not their views: that
    assert None not in spaces  # would retire them)
    _train(opt, model, 3)
    now = (plan.workspace.get(), plan.states.workspace.get())
    assert now == spaces and not any(w.retired for w in spaces)
    assert all(w.storage.nbytes() == 0 for w in now)
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values() if v.dim())


class KeepsLastGrad(torch.optim.Optimizer):
    """Plain SGD that keeps the gradient it stepped with, and the weight, in its state (the
    tensors it was given, not copies)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                    self.state[p]["last_grad"] = p.grad
                    self.state[p]["weight"] = p


def test_an_optimizer_that_keeps_the_fp32_gradient_keeps_it_intact():
    model = nn.Linear(8, 8).to(torch.bfloat16)
    opt = KeepsLastGrad(model.parameters())
    rescue = Rescue([opt], list(model.parameters()), fp32_states=True)
    rescue.cover([0, 1], "kahan")
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
        F.mse_loss(model(x).float(), torch.zeros(4, 8)).backward()
        wanted = [p.grad.float().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        junk = torch.full((10_000,), 7.0)  # reuse freed memory, were it freed
        for p, grad in zip(model.parameters(), wanted, strict=True):
            kept = opt.state[p]["last_grad"]
            assert kept.dtype == torch.float32 and torch.equal(kept, grad)
        del junk
