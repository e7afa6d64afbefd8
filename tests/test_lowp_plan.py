"""The multi-format plan: every format in it (tensorwise, rowwise, MXFP8, NVFP4 with
torchao's own quantisers), the per-layer recipe and its findings, on layers with planted
outliers: an outlier feature channel, a heavy-tailed weight, a gradient spanning a huge range."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _models import OUTLIER_FACTORY
from torch import nn

import ampguard as ag
from ampguard.demo.fp8_model import MassiveActivation
from ampguard.fp8._formats import FORMATS, lookup
from ampguard.fp8._multi import nominal

pytest.importorskip("torchao")

ALL = ("tensorwise", "rowwise", "mxfp8", "nvfp4")


class Zoo(nn.Module):
    """first/last: plain ends; healthy: a Gaussian layer; outlier: its input carries one 1e4x
    feature channel; heavy: a weight with one column 3e4x the rest; gradient: its output
    gradient spans 1e10 across rows (one row of the batch dominates)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 128)
        self.healthy = nn.Linear(128, 128)
        self.massive = MassiveActivation(128, channel=7, value=1e4)
        self.outlier = nn.Linear(128, 128)
        self.heavy = nn.Linear(128, 128)
        with torch.no_grad():
            self.heavy.weight[:, 5] *= 3e4 / self.heavy.weight[:, 5].abs().max()
        self.gradient = nn.Linear(128, 128)
        self.last = nn.Linear(128, 64)
        rows = torch.full((128, 1), 1e-5)
        rows[0] = 1e5
        self.register_buffer("rows", rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        h = torch.relu(self.healthy(h))
        h = torch.relu(self.outlier(self.massive(h)))
        h = torch.tanh(self.heavy(h)) * 0.01
        g = self.gradient(h.detach())
        return self.last(h).float().pow(2).mean() + (g.float() * self.rows).sum()


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@pytest.fixture(scope="module")
def plan() -> ag.Fp8Plan:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ag.fp8_plan(Zoo(), _loss, torch.randn(128, 64), formats=ALL)


def _fig(plan: ag.Fp8Plan, layer: str, fmt: str) -> dict:
    return plan.layers[layer]["formats"][fmt]


def test_every_layer_is_measured_in_every_format_and_role(plan):
    assert plan.formats == ALL
    for name in plan.layers:
        for fmt in ALL:
            fig = _fig(plan, name, fmt)
            assert fig["eligible"] and isinstance(fig["ready"], bool) and fig["reason"]
            for role in ("input", "weight", "grad"):
                for key in ("sqnr_db", "saturated", "flushed", "scale_spread_bits"):
                    assert f"{role}_{key}" in fig
            assert math.isfinite(fig["sqnr_db"]) and math.isfinite(fig["sqnr_loss_db"])


def test_a_healthy_layer_is_ready_in_every_format(plan):
    for fmt in ALL:
        fig = _fig(plan, "healthy", fmt)
        assert fig["ready"], (fmt, fig["reason"])
        assert abs(fig["sqnr_loss_db"]) < 3.0


def test_nvfp4_costs_more_than_fp8_on_any_layer(plan):
    fp8, fp4 = _fig(plan, "healthy", "mxfp8"), _fig(plan, "healthy", "nvfp4")
    assert fp8["sqnr_db"] - fp4["sqnr_db"] > 6  # 3 fewer mantissa bits
    assert nominal("nvfp4")["input_flushed"] > 0.02 > nominal("mxfp8")["input_flushed"]


def test_an_outlier_feature_flushes_per_tensor_scales_but_not_block_scales(plan):
    tw, mx = _fig(plan, "outlier", "tensorwise"), _fig(plan, "outlier", "mxfp8")
    assert tw["input_flushed"] > 0.05 and not tw["ready"] and "input" in tw["reason"]
    assert mx["input_flushed"] < tw["input_flushed"] / 2  # the outlier spoils 1 block of 4
    assert mx["input_scale_spread_bits"] > 8  # its block's scale is far above the others
    assert tw["input_scale_spread_bits"] == 0


def test_a_heavy_weight_column_flushes_the_weight_in_every_8bit_format(plan):
    for fmt in ("tensorwise", "rowwise", "mxfp8"):
        fig = _fig(plan, "heavy", fmt)
        assert fig["weight_flushed"] > 0.02 and not fig["ready"], fmt
        assert "weight" in fig["reason"]
    assert (
        _fig(plan, "heavy", "mxfp8")["weight_flushed"]
        < _fig(plan, "heavy", "rowwise")["weight_flushed"]
    )


def test_a_gradient_spanning_rows_flushes_under_one_scale_not_under_row_scales(plan):
    tw, rw = _fig(plan, "gradient", "tensorwise"), _fig(plan, "gradient", "rowwise")
    assert tw["grad_flushed"] > 0.5 and not tw["ready"] and "gradient" in tw["reason"]
    assert rw["grad_flushed"] < 0.01
    assert rw["grad_scale_spread_bits"] > 20


def test_ready_follows_from_the_figures_and_the_limits(plan):
    th = plan.thresholds
    for name, info in plan.layers.items():
        for fmt, fig in info["formats"].items():
            excess = [
                fig[k] - fig[f"nominal_{k}"]
                for r in ("input", "weight", "grad")
                for k in (f"{r}_flushed", f"{r}_saturated")
                if fig[k] is not None
            ]
            within = max(excess) <= max(th.max_input_flushed, th.max_saturated) and (
                fig["sqnr_loss_db"] <= th.max_sqnr_loss_db
            )
            assert fig["ready"] == within, (name, fmt, fig["reason"])


def test_recipe_picks_the_lowest_precision_ready_format(plan):
    recipe = plan.recipe(keep_first_last=False, min_features=0)
    assert set(recipe) == set(plan.layers)
    for name, fmt in recipe.items():
        ready = [f for f in ALL if _fig(plan, name, f)["ready"]]
        if not ready:
            assert fmt == "bf16"
            continue
        lowest = min(FORMATS[f].bits for f in ready)
        assert FORMATS[fmt].bits == lowest and fmt in ready
        assert fmt == next(f for f in ALL if f in ready and FORMATS[f].bits == lowest)
    assert recipe["healthy"] == "nvfp4"


def test_recipe_tolerance_changes_the_choice(plan):
    strict = plan.recipe(0.0, keep_first_last=False, min_features=0)
    loose = plan.recipe(60.0, keep_first_last=False, min_features=0)
    bits = {"bf16": 16, **{f: FORMATS[f].bits for f in ALL}}
    assert all(bits[loose[n]] <= bits[strict[n]] for n in plan.layers)
    with pytest.raises(ValueError, match="max_sqnr_loss_db"):
        plan.recipe(-1.0)
    with pytest.raises(ValueError, match="min_features"):
        plan.recipe(min_features=-3)


def test_recipe_structural_rules_keep_first_last_and_small_layers(plan):
    recipe = plan.recipe()
    assert recipe["first"] == "bf16" and recipe["last"] == "bf16"
    small = plan.recipe(keep_first_last=False, min_features=256)
    assert set(small.values()) == {"bf16"}


def test_summary_prints_the_format_table_and_findings_explain_the_kept_layers(plan):
    text = plan.summary()
    for fmt in ALL:
        assert fmt in text
    assert "recipe (SQNR loss within 3 dB" in text
    found = plan.findings()
    codes = [f.code for f in found]
    assert "AG348" in codes
    kept = {f.evidence["layer"]: f for f in found if f.code == "AG347"}
    assert {"first", "last", "heavy"} <= set(kept)
    assert "first Linear" in kept["first"].message
    assert "weight" in kept["heavy"].message  # the figure that rules the lower formats out


def test_a_shape_the_block_does_not_divide_is_not_eligible():
    model = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 16))
    p = ag.fp8_plan(model, lambda m, x: m(x).pow(2).mean(), torch.randn(8, 48), formats=ALL)
    assert (
        not _fig(p, "0", "mxfp8")["eligible"]
        and "multiples of 32" in _fig(p, "0", "mxfp8")["reason"]
    )
    assert _fig(p, "0", "nvfp4")["eligible"]


@pytest.mark.parametrize("bad", [(), "fp4", ("mxfp8", "int3"), 7])
def test_formats_argument_is_checked(bad):
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises((TypeError, ValueError), match="format"):
        ag.fp8_plan(model, lambda m, x: m(x).sum(), torch.randn(4, 32), formats=bad)


def test_a_plan_without_formats_has_the_one_format_recipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    p = ag.fp8_plan(model, lambda m, x: m(x).pow(2).mean(), torch.randn(16, 32))
    assert p.formats == () and "formats" not in p.layers["0"]
    recipe = p.recipe(keep_first_last=False, min_features=0)
    assert recipe == {n: ("tensorwise" if i["ready"] else "bf16") for n, i in p.layers.items()}
    assert p.to_dict()["recipe"] == "tensorwise"


def test_lookup_names_the_allowed_formats():
    assert lookup("mxfp8").block == 32
    with pytest.raises(ValueError, match="nvfp4"):
        lookup("fp6")


def test_cli_inspect_fp8_prints_the_multi_format_table(tmp_path, capsys):
    from ampguard.cli import main

    src = tmp_path / "fac.py"
    src.write_text(OUTLIER_FACTORY)
    assert main(["inspect", "--fp8", f"{src}:experiment"]) == 0
    out = capsys.readouterr().out
    assert "tensorwise  rowwise" in out and "mxfp8" in out and "nvfp4" in out
    assert "recipe (SQNR loss within" in out and "AG348" in out
    assert main(["inspect", "--fp8", "--formats", "mxfp8,fp6", f"{src}:experiment"]) == 2
    err = capsys.readouterr().err
    assert "--formats" in err and "fp6" in err and "Traceback" not in err
    assert main(["inspect", "--fp8", "--formats", "none", f"{src}:experiment"]) == 0
    assert "nvfp4" not in capsys.readouterr().out


def test_sampled_figures_match_the_full_tensors(monkeypatch):
    """The plan measures at least 128 evenly spaced rows and 2**15 values of each tensor: on a
    1024-sample batch its figures stay within 0.5 dB and 0.5 percentage point of the figures
    over every row, and no verdict changes."""
    from ampguard.demo.fp8_model import OutlierNet, loss_fn

    def plan() -> ag.Fp8Plan:
        torch.manual_seed(0)
        batch = (torch.randn(1024, 32), torch.randn(1024, 16))
        torch.manual_seed(0)
        return ag.fp8_plan(OutlierNet(width=128, hidden=512), loss_fn, batch, formats=ALL)

    sampled = plan()
    monkeypatch.setattr("ampguard.fp8._operand.MIN_ROWS", 1 << 30)
    full = plan()
    assert sampled.recipe() == full.recipe()
    compared = 0
    for name, info in full.layers.items():
        assert info["ready"] == sampled.layers[name]["ready"]
        for fmt, fig in info["formats"].items():
            ours = sampled.layers[name]["formats"][fmt]
            assert ours["ready"] == fig["ready"], (name, fmt)
            for key, value in fig.items():
                if not isinstance(value, float) or not math.isfinite(value) or "nominal" in key:
                    continue
                limit = 0.5 if key.endswith("_db") else 0.005 if "_bits" not in key else 1.0
                assert abs(ours[key] - value) <= limit, (name, fmt, key, ours[key], value)
                compared += 1
    assert compared > 200


def test_recipe_arguments_of_the_wrong_type_are_refused_naming_them(plan):
    for bad in ("3", True, float("nan")):
        with pytest.raises(ValueError, match="max_sqnr_loss_db must be a number >= 0"):
            plan.recipe(bad)
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="keep_first_last must be True or False"):
            plan.recipe(keep_first_last=bad)
    with pytest.raises(ValueError, match="min_features"):
        plan.recipe(min_features=True)
    assert plan.recipe(3) == plan.recipe(3.0)  # an int is a number


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_identical_layers_get_the_same_verdict_in_every_format(seed: int) -> None:
    """Seven identical GELU layers (after the first, whose output gradient differs): one verdict
    per format whatever the seed; the flush rule's margin keeps a share that varies between
    layers of the same statistics (NVFP4: 3-11.5% against a nominal 6.8%) from flipping it."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(128, 128), nn.GELU())])
    plan = ag.fp8_plan(
        model, lambda m, b: m(b).float().pow(2).mean(), torch.randn(128, 128), formats=ALL
    )
    for fmt in ALL:
        verdicts = {plan.layers[str(2 * i)]["formats"][fmt]["ready"] for i in range(1, 8)}
        assert verdicts == {True}, (fmt, seed)


def test_nominal_margin_zero_is_the_bare_rule() -> None:
    assert ag.Fp8Thresholds(nominal_margin=0).nominal_margin == 0
    with pytest.raises(ValueError, match="nominal_margin"):
        ag.Fp8Thresholds(nominal_margin=-0.1)
