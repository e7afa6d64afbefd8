"""ag.triage's op bisection through views, transposes and copies (as in HF GPT-2's Conv1D and
attention): a persistent fault is named at the op whose output the injector corrupted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampguard as ag
from ampguard.testing import inject_fault


class _Conv1D(nn.Module):
    """GPT-2's Conv1D: ``addmm`` on a flattened view of the input, its output viewed back, so
    the backward's input gradient is an ``mm`` viewed to the input's shape."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = (*x.shape[:-1], self.weight.shape[1])
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


class _Scores(nn.Module):
    """A leaf like attention's core: heads split by a view and a transpose, keys transposed and
    copied (``contiguous``: a clone), scores by ``matmul`` (``bmm``), merged back by a
    transpose and a copying ``reshape``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k = x.view(b, t, 2, d // 2).transpose(1, 2).chunk(2, dim=-1)
        s = torch.matmul(q, k.transpose(-1, -2).contiguous())  # (b, 2, t, t)
        return s.transpose(1, 2).reshape(b, t, -1)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Conv1D(8, 16), _Conv1D(16, 16), _Scores(), _Conv1D(12, 4))


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _triage(**fault) -> ag.TriageEvent:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    inj = inject_fault(model, guard=guard, step=1, element=7, persistent=True, **fault)
    with inj:
        for i in range(2):
            g = torch.Generator().manual_seed(i)
            b = (torch.randn(3, 6, 8, generator=g), torch.randn(3, 6, 4, generator=g))
            with guard.autocast():
                loss = _loss(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=_loss)
        (event,) = ag.triage(guard, recorder=rec, step=1)
    assert inj.fired_at[0] == 1
    return event


@pytest.mark.parametrize(
    ("fault", "module", "op"),
    [
        # the module's input gradient: an mm, viewed to the input's shape, cloned by the injector
        ({"module": "1", "phase": "backward"}, "1", "aten.mm"),
        ({"module": "3", "phase": "backward"}, "3", "aten.mm"),
        # the first layer's input needs no gradient: its weight's (an mm, cast back to fp32)
        ({"module": "0", "phase": "backward"}, "0", "aten.mm"),
        # an op's output in the backward, through the transposes and the copy
        ({"module": "2", "op": "aten.bmm", "phase": "backward"}, "2", "aten.bmm"),
        ({"module": "1", "op": "aten.mm", "phase": "backward"}, "1", "aten.mm"),
        # the module's output: a bmm's, transposed and copied by reshape before it is returned
        ({"module": "2", "phase": "forward"}, "2", "aten.bmm"),
        ({"module": "1", "phase": "forward"}, "1", "aten.addmm"),
        ({"module": "2", "op": "aten.bmm", "phase": "forward"}, "2", "aten.bmm"),
    ],
)
@pytest.mark.parametrize("bit", ["exponent_top", "exponent_low"])
def test_persistent_fault_is_named_at_the_op_that_computed_it(fault, module, op, bit) -> None:
    event = _triage(bit=bit, **fault)
    assert (event.cause, event.module, event.phase, event.op) == (
        "persistent_fault",
        module,
        fault["phase"],
        op,
    )


def test_hf_gpt2_backward_fault_in_conv1d_is_named_mm() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0
    )
    config.attn_pdrop = config.embd_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor]) -> torch.Tensor:
        return m(input_ids=b[0], labels=b[0]).loss

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    name = "transformer.h.0.attn.c_proj"
    fault = inject_fault(model, module=name, phase="backward", step=1, persistent=True, guard=guard)
    with fault:
        for i in range(2):
            b = (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)),)
            with guard.autocast():
                loss = loss_fn(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=loss_fn)
        (event,) = ag.triage(guard, recorder=rec, step=1)
    assert (event.cause, event.module, event.phase, event.op) == (
        "persistent_fault",
        name,
        "backward",
        "aten.mm",
    )
