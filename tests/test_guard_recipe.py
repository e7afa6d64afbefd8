"""Guard(precision={layer: format}): each Linear layer trains in its own format (emulated), the
rest in bf16; checkpoints resume the per-layer formats; bad recipes are refused before anything
is converted."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.fp8._emulate import EmulatedLinear
from ampguard.fp8._operand import Operand
from ampguard.fp8._quant import CASTS

RECIPE = {"a": "nvfp4", "b": "fp8_blockwise", "c": "bf16"}


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            a=nn.Linear(64, 128), t1=nn.Tanh(), b=nn.Linear(128, 128), t2=nn.Tanh(),
            c=nn.Linear(128, 16),
        )
    )  # fmt: skip


def _guard(model: nn.Module, precision=None) -> ag.Guard:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return ag.Guard(model, opt, precision=RECIPE if precision is None else precision)


def _steps(guard: ag.Guard, model: nn.Module, n: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 16, generator=gen) * 0.3
    out = []
    for _ in range(n):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        guard.step()
        out.append(loss.item())
    return out


def test_each_layer_trains_in_its_own_format():
    model = _model()
    plain = copy.deepcopy(model)
    guard = _guard(model)
    assert guard.precision == "recipe" and guard.fp8.emulated
    assert guard.fp8.formats() == {"a": "nvfp4", "b": "fp8_blockwise"}
    assert type(model.c) is nn.Linear and guard.fp8.kept == ["c"]
    assert (model.a.lowp_format, model.b.lowp_format) == ("nvfp4", "fp8_blockwise")
    x = torch.randn(8, 64)
    with guard.autocast(), torch.no_grad():
        y = model.a(x)
    w, b = plain.a.weight.detach(), plain.a.bias.detach()
    want = CASTS["nvfp4"](Operand(x), "input").q.clone() @ CASTS["nvfp4"](Operand(w), "weight").q.T
    torch.testing.assert_close(y, (want + b).to(torch.bfloat16), rtol=0, atol=0)
    losses = _steps(guard, model, 15)
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_checkpoint_resumes_the_per_layer_formats_and_the_losses(tmp_path):
    model = _model()
    guard = _guard(model)
    _steps(guard, model, 3)
    path = ag.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=guard.optimizers[0],
                              guard=guard)  # fmt: skip
    assert guard.state_dict()["fp8"] == {
        "format": "recipe",
        "version": 2,
        "recipe": {"a": "nvfp4", "b": "fp8_blockwise"},
        "strikes": {},
        "moves": [],
    }
    after = _steps(guard, model, 3)
    model2 = _model(seed=5)
    guard2 = _guard(model2, {"a": "mxfp8", "b": "mxfp8"})  # another recipe: the saved one wins
    with pytest.warns(RuntimeWarning, match="resuming with the saved formats"):
        ag.load_checkpoint(path, model=model2, optimizer=guard2.optimizers[0], guard=guard2)
    assert guard2.fp8.formats() == {"a": "nvfp4", "b": "fp8_blockwise"}
    assert _steps(guard2, model2, 3) == after


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"a": "nvfp4", "zz": "mxfp8"}, r"names 'zz', which is not a Linear layer"),
        ({"a": "fp4"}, r"layer 'a' has unknown format 'fp4'; allowed"),
        ({"a": "nvfp4", "c": "fp8_blockwise"}, r"layer 'c' \(128x16\) cannot train in 'fp8_bl"),
        ({}, "names no layer"),
        ({"a": 3}, "dict of strings"),
    ],
)
def test_a_bad_recipe_is_one_error_and_nothing_is_converted(recipe, message):
    model = _model()
    with pytest.raises((ValueError, TypeError), match=message):
        _guard(model, recipe)
    assert all(type(m) is not EmulatedLinear for m in model.modules())


def test_a_recipe_with_a_plan_or_the_bare_name_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="precision='recipe' needs the recipe itself"):
        _guard(model, "recipe")
    with pytest.raises(ValueError, match="fp8_plan is not used with a per-layer precision"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=RECIPE,
                 fp8_plan=object())  # fmt: skip


def test_a_recipe_of_bf16_only_trains_in_bf16_with_a_warning():
    model = _model()
    with pytest.warns(RuntimeWarning, match="no Linear layer is converted"):
        guard = _guard(model, {"a": "bf16"})
    assert guard.precision == "bf16"


class RowSpike(nn.Module):
    """Every 16th sample 300x the others: the neighbouring layers' weight gradients span a range
    that NVFP4's blocks along the batch flush (planted drift)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.ones(x.shape[0], 1, dtype=x.dtype)
        s[::16] = 300.0
        return x * s


def test_recheck_moves_a_drifting_layer_up_one_format_and_the_guard_lists_it():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(a=nn.Linear(64, 128), t=nn.GELU(), s=RowSpike(), b=nn.Linear(128, 128),
                    t2=nn.Tanh(), c=nn.Linear(128, 16))
    )  # fmt: skip
    guard = _guard(model, {"a": "nvfp4", "b": "nvfp4", "c": "nvfp4"})
    gen = torch.Generator().manual_seed(2)
    shadow = [(torch.randn(32, 64, generator=gen), torch.randn(32, 16, generator=gen))]

    def loss(m, b):
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    moves = {m["module"]: m for m in guard.fp8.recheck(loss, shadow, step=10)}
    assert (moves["a"]["from"], moves["a"]["to"], moves["a"]["step"]) == ("nvfp4", "mxfp8", 10)
    assert (moves["b"]["from"], moves["b"]["to"]) == ("nvfp4", "mxfp8")
    # "c" (128x16) takes no block-scaled 8-bit format: when it moves, to tensorwise
    assert moves.get("c", {"to": "tensorwise"})["to"] == "tensorwise"
    assert guard.fp8.formats()["a"] == guard.fp8.formats()["b"] == "mxfp8"
    assert guard.fp8.rescue.changes == list(moves.values())
    assert guard.diagnostics()["fallbacks"] == list(moves.values())  # the Guard lists them
    again = {m["module"]: m["to"] for m in guard.fp8.recheck(loss, shadow, step=20)}
    assert again["a"] == again["b"] == "bf16"  # MXFP8 still ruins them: up to bf16
    assert "a" not in guard.fp8.formats() and type(model.a) is nn.Linear
    assert all(p.grad is None for p in model.parameters())
