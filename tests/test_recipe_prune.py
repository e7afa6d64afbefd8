"""ag.recipe_search's meter prune: a layer flagged for its own input's values (its forward cast
loses the features beside a massive one; no other layer's format changes that) moves up in the
same reading as the earliest flagged layer, so two such layers cost one meter reading, not two."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.fp8 import losing_inputs
from ampguard.fp8._fidelity import failing, gradient_fidelity

pytest.importorskip("torchao")  # the plan's fp8 verdict (the risk order) is torchao's recipe


class Massive(nn.Module):
    """A fixed feature 100x the others on the next layer's input (planted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spike = torch.zeros(x.shape[-1], dtype=x.dtype)
        spike[5] = 100.0
        return x + spike


def two_massive() -> nn.Sequential:
    torch.manual_seed(torch.initial_seed())
    return nn.Sequential(
        OrderedDict(
            a=nn.Linear(64, 128), t=nn.GELU(), m=Massive(), b=nn.Linear(128, 128),
            t2=nn.GELU(), m2=Massive(), c=nn.Linear(128, 16),
        )
    )  # fmt: skip


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(64, 16, generator=gen) / 8
    out = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def test_losing_inputs_names_the_layers_whose_forward_loses_their_own_input():
    torch.manual_seed(0)
    meter = gradient_fidelity(
        two_massive(), loss_fn, _batches(2), {"a": "nvfp4", "b": "nvfp4", "c": "nvfp4"}
    )
    assert losing_inputs(meter) == ["b", "c"]
    assert set(losing_inputs(meter)) <= set(failing(meter))
    assert losing_inputs({}) == []
    up = gradient_fidelity(
        two_massive(), loss_fn, _batches(2), {"a": "nvfp4", "b": "bf16", "c": "mxfp8"}
    )
    assert losing_inputs(up) == []  # bf16 is never named; MXFP8's 8 bits keep the block


def test_two_layers_losing_their_inputs_move_up_in_one_meter_reading(monkeypatch):
    from ampguard.experiments import _recipe_search as search

    readings = []
    real = search.gradient_fidelity

    def counted(model, loss_fn, batches, recipe, *args, **kwargs):
        readings.append(dict(recipe))
        return real(model, loss_fn, batches, recipe, *args, **kwargs)

    monkeypatch.setattr(search, "gradient_fidelity", counted)
    cert = ag.recipe_search(two_massive, loss_fn, _batches(40), budget=1.0, tolerance=1.0)
    first = [h for h in cert.branches if h["kind"] == "meter"]
    assert {n for h in first for n in h["promoted"]} >= {"b", "c"}
    # b and c went up together: the second reading already has both out of NVFP4
    assert readings[0] == {"a": "nvfp4", "b": "nvfp4", "c": "nvfp4"}
    assert readings[1]["b"] != "nvfp4" and readings[1]["c"] != "nvfp4"
    assert cert.recipe["b"] != "nvfp4" and cert.recipe["c"] != "nvfp4"
