"""``fidelity_score``: the worst layer's direction error plus the lost inputs. On real NVFP4
gradients, a recipe whose error sits in one layer (a row outlier flushes its batch blocks:
cosine about 0.5, its step mostly noise after AdamW's normalisation) scores above a recipe
whose error is spread over a dozen healthy layers (cosine 0.9-1.0 each), the order of their
final gaps in ``benchmarks/bench_recipe.py`` (0.036 against 0.003 above bf16 on the outlier
MLP); the summed squared relative error puts them the other way round."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampguard.experiments._fidelity_score import direction_error, fidelity_score
from ampguard.fp8._fidelity import gradient_fidelity, reference_gradients

DEPTH, WIDTH, OUTLIER = 12, 64, 1  # layer 1 reads a batch with a 300x row every 16 rows


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            if i == OUTLIER:
                s = torch.ones(h.shape[0], 1, dtype=h.dtype)
                s[::16] = 300.0
                h = nn.functional.gelu(layer(h * s)) / s
            else:
                h = nn.functional.gelu(layer(h))
        return self.head(h)


def _summed(meter: dict) -> float:
    """The rank check's first score: the sum over layers of the squared relative error plus
    the lost inputs."""
    return sum(m["rel_error"] ** 2 + m["lost_inputs"] for m in meter.values())


def _readings() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = Deep()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, WIDTH, generator=gen), torch.randn(64, 16, generator=gen))
               for _ in range(2)]  # fmt: skip

    def loss_fn(m: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    ref = reference_gradients(model, loss_fn, batches)
    names = [f"layers.{i}" for i in range(DEPTH)]
    spread = {n: "nvfp4" for n in names if n != f"layers.{OUTLIER}"}
    concentrated = {f"layers.{OUTLIER}": "nvfp4"}
    read = lambda r: gradient_fidelity(model, loss_fn, batches, r, reference=ref)  # noqa: E731
    return read(spread), read(concentrated)


def test_concentrated_error_outranks_spread_error_where_the_summed_score_does_not():
    spread, concentrated = _readings()
    assert min(m["cosine"] for m in spread.values()) > 0.85  # no layer far off on its own
    assert concentrated[f"layers.{OUTLIER}"]["cosine"] < 0.8
    assert _summed(spread) > _summed(concentrated)  # the summed score: spread looks worse
    assert fidelity_score(concentrated) > 3 * fidelity_score(spread)  # the score: the other way


def test_direction_error_is_the_tangent_squared_and_the_score_adds_lost_inputs():
    assert direction_error(1.0) == 0.0
    assert direction_error(0.5) == pytest.approx(3.0)  # tan^2(60 degrees)
    assert direction_error(0.0) == math.inf and direction_error(-0.3) == math.inf
    assert math.isnan(direction_error(math.nan))
    meter = {"a": {"cosine": 0.5, "lost_inputs": 0.0}, "b": {"cosine": 0.8, "lost_inputs": 0.1}}
    assert fidelity_score(meter) == pytest.approx(3.0 + 0.1)  # the worst layer, not the sum
    assert fidelity_score({}) == 0.0
    assert math.isnan(fidelity_score({**meter, "c": {"cosine": math.nan, "lost_inputs": 0.0}}))
