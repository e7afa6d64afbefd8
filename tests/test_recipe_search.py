"""ag.recipe_search: a per-layer recipe searched on the model (risk order from the plan, the
gradient-fidelity meter's pruning, short branches judged against bf16's noise), returned as an
ag.RecipeCertificate that saves, loads and trains in a Guard; bad input is one error."""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.fp8._fidelity import failing, gradient_fidelity

pytest.importorskip("torchao")  # the plan's fp8 verdict (the risk order) is torchao's recipe


class RowSpike(nn.Module):
    """Every 16th sample of the batch 300x the others: the weight gradients of the layers around
    it span a range that a block-scaled cast along the batch flushes (planted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        s[::16] = 300.0
        return x * s


def factory() -> nn.Sequential:
    torch.manual_seed(torch.initial_seed())  # the search's seed: the same model on every call
    return nn.Sequential(
        OrderedDict(
            a=nn.Linear(64, 128), t=nn.GELU(), spike=RowSpike(), b=nn.Linear(128, 128),
            t2=nn.Tanh(), c=nn.Linear(128, 16),
        )
    )  # fmt: skip


def healthy() -> nn.Sequential:
    torch.manual_seed(torch.initial_seed())
    return nn.Sequential(
        OrderedDict(a=nn.Linear(64, 64), t=nn.GELU(), b=nn.Linear(64, 64), c=nn.Linear(64, 16))
    )


def _batches(n: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(64, 16, generator=gen) / 8
    out = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def test_the_meter_flags_the_layers_whose_gradient_the_format_ruins():
    torch.manual_seed(0)
    model = factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    meter = gradient_fidelity(
        model, loss_fn, _batches(2), {"a": "nvfp4", "b": "nvfp4", "c": "nvfp4"}
    )
    assert failing(meter) == ["a", "b"]
    assert meter["c"]["cosine"] > 0.9 and meter["a"]["cosine"] < 0.5
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Tanh, RowSpike, nn.Sequential)
               for m in model.modules())  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_search_keeps_the_ruined_layers_high_and_certifies_the_recipe(tmp_path):
    cert = ag.recipe_search(factory, loss_fn, _batches(24), budget=1.0, tolerance=1.0)
    assert isinstance(cert, ag.RecipeCertificate)
    assert cert.recipe == {"a": "bf16", "b": "bf16", "c": "nvfp4"}
    assert cert.passed and cert.loss_delta <= cert.tolerance == 1.0
    assert [h["kind"] for h in cert.branches][:2] == ["meter", "meter"]  # nvfp4, then mxfp8
    # the meter's passes (bf16's reference, one per shadow micro-batch per reading) and the
    # plan's count as steps: a branch is a quarter of what they leave of 24, at least 2
    assert cert.steps == 2 and cert.seeds == (0, 1) and cert.noise >= 0
    assert cert.flop_share["nvfp4"] == pytest.approx(128 * 16 / (64 * 128 + 128 * 128 + 128 * 16))
    assert sum(cert.flop_share.values()) == pytest.approx(1.0)
    assert set(cert.meter) == {"a", "b", "c"} and not failing(cert.meter)
    cert.save(tmp_path / "cert.json")
    again = ag.RecipeCertificate.load(tmp_path / "cert.json")
    assert again.recipe == cert.recipe and again.passed and again.steps == cert.steps
    assert json.loads((tmp_path / "cert.json").read_text())["schema"].startswith("ampguard.")
    model = factory()
    guard = ag.Guard(model, torch.optim.AdamW(model.parameters()), precision=again)
    assert guard.fp8.formats() == {"c": "nvfp4"} and guard.fp8.kept == ["a", "b"]


def test_a_recipe_that_fails_its_branch_is_promoted_in_risk_order():
    cert = ag.recipe_search(
        healthy, loss_fn, _batches(24), budget=1.0, tolerance=0.0,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )  # fmt: skip
    kinds = [h["kind"] for h in cert.branches]
    assert kinds == ["branch", "promote"]  # all NVFP4 ends above bf16; two recipe branches
    first = cert.branches[0]
    assert first["recipe"] == {"a": "nvfp4", "b": "nvfp4", "c": "nvfp4"} and not first["passed"]
    # promoted one layer at a time, riskiest first; "c" (64x16) cannot take MXFP8: to bf16
    assert cert.branches[1]["recipe"] == {"a": "nvfp4", "b": "nvfp4", "c": "bf16"}
    assert (len(kinds) + 2) * cert.steps <= 24  # the budget: every branch, bf16's two included
    assert cert.passed is cert.branches[-1]["passed"]


def test_bad_input_is_one_error_before_any_step():
    b = _batches(24)
    with pytest.raises(ValueError, match=r"formats: unknown format 'fp4'"):
        ag.recipe_search(healthy, loss_fn, b, formats=("nvfp4", "fp4"))
    with pytest.raises(ValueError, match="batches must be a non-empty list"):
        ag.recipe_search(healthy, loss_fn, [])
    with pytest.raises(ValueError, match="budget=0.1 of 24 batches is 2 training steps"):
        ag.recipe_search(healthy, loss_fn, b, budget=0.1)
    widths = itertools.count(64, 16)
    with pytest.raises(ValueError, match="returned different models on two calls"):
        ag.recipe_search(lambda: nn.Linear(next(widths), 64), loss_fn, b, budget=1.0)
    unseeded = iter([nn.Linear(64, 16), nn.Linear(64, 16)])
    with pytest.raises(ValueError, match=r"different models .*'weight' differs"):
        ag.recipe_search(lambda: next(unseeded), loss_fn, b, budget=1.0)
    one = nn.Linear(64, 16)
    with pytest.raises(ValueError, match="the same model object"):
        ag.recipe_search(lambda: one, loss_fn, b, budget=1.0)


def test_a_file_that_is_not_a_certificate_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"recipe": {}}')
    with pytest.raises(ValueError, match="not a recipe certificate"):
        ag.RecipeCertificate.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        ag.RecipeCertificate.load(path)


class Massive(nn.Module):
    """A fixed feature 100x the others on the next layer's input (planted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spike = torch.zeros(x.shape[-1], dtype=x.dtype)
        spike[5] = 100.0
        return x + spike


def test_the_meter_flags_a_layer_whose_forward_a_massive_feature_ruins():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(a=nn.Linear(64, 128), t=nn.GELU(), m=Massive(), b=nn.Linear(128, 16))
    )
    meter = gradient_fidelity(model, loss_fn, _batches(2), {"a": "nvfp4", "b": "nvfp4"})
    # b's weight gradient (blocks along the batch) looks healthy; its forward loses the 15
    # features beside the massive one in their NVFP4 block
    assert meter["b"]["cosine"] > 0.9 and meter["b"]["rel_error"] < 0.5
    assert meter["b"]["lost_inputs"] == pytest.approx(15 / 128)
    assert meter["a"]["lost_inputs"] == 0.0
    assert failing(meter) == ["b"]


class QKV(nn.Module):
    """q, k and v read the same normed input; a row outlier on it (planted)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = RowSpike()(x)
        return self.out(torch.tanh(self.q(h) * self.k(h) + self.v(h)) / 300.0)


def qkv() -> QKV:
    torch.manual_seed(torch.initial_seed())
    return QKV()


def test_layers_reading_the_same_tensor_are_one_group_promoted_together():
    from ampguard.experiments._recipe_groups import grouped_order, groups

    torch.manual_seed(0)
    group_of = groups(qkv(), loss_fn, _batches(1)[0])
    assert group_of["q"] == group_of["k"] == group_of["v"] == ("q", "k", "v")
    assert group_of["out"] == ("out",)
    assert grouped_order(["k", "out", "q", "v"], group_of) == [("q", "k", "v"), ("out",)]
    cert = ag.recipe_search(qkv, loss_fn, _batches(24), budget=1.0, tolerance=1.0)
    meters = [h for h in cert.branches if h["kind"] == "meter"]
    assert meters and all(set(h["promoted"]) in ({"q", "k", "v"}, {"out"}) for h in meters)
    assert cert.recipe["q"] == cert.recipe["k"] == cert.recipe["v"]


def _guarded(precision, steps: int, batches) -> ag.Guard:
    torch.manual_seed(0)
    model = factory()
    guard = ag.Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision=precision)
    for batch in batches[:steps]:
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
    return guard


def test_the_guard_rechecks_every_k_steps_moves_a_drifting_layer_up_and_resumes_it():
    cert = ag.RecipeCertificate(
        recipe={"a": "bf16", "b": "nvfp4", "c": "nvfp4"}, passed=True, loss_delta=0.0,
        noise=0.0, tolerance=0.0, flop_share={}, steps=1, seeds=(0, 1), recheck_every=2,
    )  # fmt: skip
    b = _batches(6)
    guard = _guarded(cert, 3, b)  # one re-check (step 2) flagged b: not yet moved
    assert guard.fp8.formats() == {"b": "nvfp4", "c": "nvfp4"}
    guard = _guarded(cert, 4, b)  # the second in a row (step 4) moves it
    assert guard.fp8.formats() == {"b": "mxfp8", "c": "nvfp4"}  # b's row outlier: one up
    (found,) = [f for f in guard.findings() if f.code == "AG114"]
    assert "b: moved from nvfp4 to mxfp8 at step 4" in found.message
    state = guard.state_dict()
    torch.manual_seed(0)
    model = factory()
    fresh = ag.Guard(model, torch.optim.AdamW(model.parameters()), precision=cert)
    with pytest.warns(RuntimeWarning, match="resuming with the saved formats"):
        fresh.load_state_dict(state)
    assert fresh.fp8.formats() == {"b": "mxfp8", "c": "nvfp4"}
    # a re-check leaves the RNG as it was (the meter's passes do not shift dropout's stream)
    rng = torch.get_rng_state()
    fresh.fp8.recheck_step(loss_fn, b[0], 6)
    assert torch.equal(rng, torch.get_rng_state())
    off = ag.RecipeCertificate.from_dict(dict(cert.to_dict(), recheck_every=None))
    assert _guarded(off, 4, b).fp8.formats() == {"b": "nvfp4", "c": "nvfp4"}  # never re-checks


def test_a_bad_recheck_every_is_one_error_naming_it():
    model = factory()
    bad = ag.RecipeCertificate(
        recipe={"b": "nvfp4"}, passed=True, loss_delta=0.0, noise=0.0, tolerance=0.0,
        flop_share={}, steps=1, seeds=(0, 1), recheck_every=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="recheck_every must be a positive int or None, got 0"):
        ag.Guard(model, torch.optim.AdamW(model.parameters()), precision=bad)
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_the_meter_compares_both_passes_under_the_same_dropout_masks():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(a=nn.Linear(64, 64), d=nn.Dropout(0.3), b=nn.Linear(64, 16))
    )  # train mode: dropout draws a mask per pass
    rng = torch.get_rng_state()
    meter = gradient_fidelity(model, loss_fn, _batches(2), {"a": "mxfp8", "b": "bf16"})
    assert meter["a"]["cosine"] > 0.99 and meter["b"]["rel_error"] < 0.05  # not two masks
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG stream is untouched


def test_bf16s_noise_is_another_runs_even_for_a_deterministic_model():
    # no dropout, no sampling: two runs of one start are bitwise equal; the spread the held-out
    # judge uses (over seeds) includes the init, and so does the search's
    cert = ag.recipe_search(healthy, loss_fn, _batches(24), budget=1.0)
    assert cert.noise > 0 and cert.tolerance >= 3 * cert.noise
