"""The meter's predicted loss effect (``lost_progress``): a layer whose own gradient reads
healthy (cosine above the limit) but that holds most of the gradient error for few FLOPs is
kept high by ag.recipe_search; a reading against cached bf16 gradients is the same reading at
half the passes."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.fp8._fidelity import (
    MIN_COSINE,
    failing,
    gradient_fidelity,
    lost_progress,
    reference_gradients,
)

pytest.importorskip("torchao")  # the plan's fp8 verdict (the risk order) is torchao's recipe

VOCAB = 64


def lm() -> nn.Sequential:
    """A tiny language model whose head holds most of the weight-gradient energy (its weights
    small at init: the layers before it see little gradient), as a GPT's head does."""
    torch.manual_seed(torch.initial_seed())
    model = nn.Sequential(
        OrderedDict(
            emb=nn.Embedding(VOCAB, 64), a=nn.Linear(64, 256), t=nn.GELU(),
            b=nn.Linear(256, 64), n=nn.LayerNorm(64), head=nn.Linear(64, VOCAB),
        )
    )  # fmt: skip
    with torch.no_grad():
        model.head.weight.mul_(0.05)
    return model


def _batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (16, 1), generator=gen) + torch.arange(17)) % VOCAB
        for _ in range(n)
    ]


def next_token(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


ALL = {"a": "nvfp4", "b": "nvfp4", "head": "nvfp4"}


def test_the_head_reads_healthy_layer_by_layer_but_holds_most_of_the_lost_progress():
    torch.manual_seed(0)
    meter = gradient_fidelity(lm(), next_token, _batches(2, 9), ALL)
    assert all(m["cosine"] > MIN_COSINE for m in meter.values()) and not failing(meter)
    err = sum(m["error_sq"] for m in meter.values())
    assert meter["head"]["error_sq"] / err > 0.9  # for 11% of the matmul FLOPs
    ref = sum(m["grad_sq"] for m in meter.values())
    assert lost_progress(meter) == pytest.approx(err / ref)
    # MXFP8 loses an order of magnitude less of a step's progress; bf16 loses none
    mx = gradient_fidelity(lm(), next_token, _batches(2, 9), dict.fromkeys(ALL, "mxfp8"))
    assert lost_progress(mx) < lost_progress(meter) / 5
    assert lost_progress(gradient_fidelity(lm(), next_token, _batches(2, 9), {})) == 0.0


def test_the_search_keeps_a_healthy_reading_head_that_costs_the_loss_high():
    # before: the meter's per-layer limits flagged nothing and the head stayed in NVFP4
    cert = ag.recipe_search(lm, next_token, _batches(24), budget=0.5, tolerance=1.0)
    assert cert.recipe["head"] != "nvfp4"
    assert cert.recipe["a"] == cert.recipe["b"] == "nvfp4"  # the cheap-to-keep layers stay low
    first = next(h for h in cert.branches if h["kind"] == "meter")
    assert first["promoted"] == ["head"]


def test_a_reading_against_cached_bf16_gradients_is_the_same_reading():
    torch.manual_seed(0)
    model, shadow = lm(), _batches(2, 9)
    ref = reference_gradients(model, next_token, shadow)
    assert all(p.grad is None for p in model.parameters())
    cached = gradient_fidelity(model, next_token, shadow, ALL, reference=ref)
    plain = gradient_fidelity(model, next_token, shadow, ALL)
    assert cached.keys() == plain.keys()
    for name, m in plain.items():
        for key in ("cosine", "rel_error", "error_sq", "grad_sq", "noise_sq"):
            assert cached[name][key] == pytest.approx(m[key], rel=1e-5), (name, key)


def test_the_meters_passes_count_against_the_budget(monkeypatch):
    from ampguard.experiments import _recipe_search as search

    passes = [0]
    for name in ("gradient_fidelity", "reference_gradients"):
        real = getattr(search, name)

        def counted(model, loss_fn, batches, *args, _real=real, **kwargs):
            passes[0] += len(batches)  # one forward+backward pass per shadow micro-batch
            return _real(model, loss_fn, batches, *args, **kwargs)

        monkeypatch.setattr(search, name, counted)
    cert = ag.recipe_search(lm, next_token, _batches(40), budget=0.75, tolerance=1.0)
    branches = sum(1 for h in cert.branches if h["kind"] != "meter") + 2  # bf16's two
    assert passes[0] > 0 and cert.steps >= 2
    assert branches * cert.steps + passes[0] + 1 <= 0.75 * 40  # + the plan's traced batch
