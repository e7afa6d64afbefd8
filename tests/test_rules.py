"""AG101-AG108 over run logs: planted fp16 training scenarios (real runs) and hand-written logs
for the thresholds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _telemetry_runs import DeadBranch, SaturatedGate, WideRange, codes, mlp, resumed, run, train

import ampguard as ag
from ampguard import rules, runlog


def findings(run_dir: Path, **thresholds) -> list[ag.Finding]:
    return rules.evaluate(runlog.load_run(run_dir), rules.RuleConfig(**thresholds))


# ---------------------------------------------------------------------- planted training runs
def test_a_healthy_model_raises_no_finding(tmp_path):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tel = ag.Telemetry(tmp_path, flush_every=16, layer_every=1, range_every=5)
    with ag.Guard(model, opt, precision="fp16", telemetry=tel) as guard:
        train(guard, model, 120)
        assert guard.findings() == []
    assert json.loads((tmp_path / "findings.json").read_text()) == []


def test_warm_up_overflows_from_a_high_initial_scale_are_not_findings(tmp_path):
    run(tmp_path, mlp(), 120, scaler=ag.ScalerConfig(init_scale=2.0**24), amp=100.0)
    loaded = runlog.load_run(tmp_path)
    assert (~loaded.applied).sum() >= 5  # the scale really probed its level
    assert findings(tmp_path) == []


def test_gradients_that_always_overflow_are_a_collapse(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the Guard's own collapse warning
        run(tmp_path, mlp(), 40, scaler=ag.ScalerConfig(on_collapse="warn"), amp=1e9)
    (f,) = [f for f in findings(tmp_path) if f.code == "AG101"]
    assert f.severity == "error" and f.step == 17  # 65536 -> 1 takes 16 back-offs
    assert f.evidence["min_scale"] == 1.0 and f.evidence["collapses"] == 24
    assert "bf16" in f.fix


def test_growth_interval_one_with_a_large_gradient_oscillates(tmp_path):
    run(tmp_path, mlp(), 80, scaler=ag.ScalerConfig(growth_interval=1, init_scale=2.0**8), amp=1e3)
    found = findings(tmp_path)
    (f,) = [f for f in found if f.code == "AG102"]
    assert f.evidence["cycles"] >= 30 and f.evidence["median_period"] == 2
    assert "growth_interval=4" in f.fix and f"max_scale={f.evidence['top_scale'] / 2:g}" in f.fix
    assert "AG103" in codes(found)  # every other step is skipped


def test_frequent_overflows_after_warm_up_are_a_high_skip_rate(tmp_path):
    run(
        tmp_path, mlp(), 120, inject=set(range(30, 121, 6)), scaler=ag.ScalerConfig(hysteresis=100)
    )  # hysteresis: the scale stays put
    (f,) = [f for f in findings(tmp_path) if f.code == "AG103"]
    assert f.evidence["rate"] > 0.05 and f.evidence["causes"] == {"overflow": 16}
    assert codes(findings(tmp_path)) == {"AG103"}


@pytest.mark.parametrize(
    "model,layer",
    [(DeadBranch, "branch_in"), (SaturatedGate, "gate")],
    ids=["zero-initialised-branch", "saturated-sigmoid-gate"],
)
def test_a_layer_that_never_gets_a_gradient_is_dead(tmp_path, model, layer):
    run(tmp_path, model(), 40)
    found = findings(tmp_path)
    assert codes(found) == {"AG104"}
    (f,) = found
    assert f.evidence["layer"] == layer and f.evidence["samples"] == 40
    assert layer in f.message


def test_gradients_near_fp16_max_are_saturation(tmp_path):
    run(tmp_path, WideRange(1.0, 100.0), 20, scaler=ag.ScalerConfig(init_scale=1.0, dynamic=False))
    (f,) = [f for f in findings(tmp_path) if f.code == "AG105"]
    assert f.evidence["layer"] == "huge" and f.evidence["amax"] >= 65504 / 16


def test_a_tiny_loss_at_a_fixed_low_scale_underflows(tmp_path):
    run(tmp_path, mlp(), 20, scaler=ag.ScalerConfig(init_scale=1.0, dynamic=False), amp=1e-4)
    found = [f for f in findings(tmp_path) if f.code == "AG106"]
    assert {f.evidence["layer"] for f in found} == {"0", "2", "4"}
    assert all(f.evidence["underflow"] > 0.5 and f.evidence["safe_lo"] > 1.0 for f in found)


def test_a_resume_that_resets_the_scale_is_a_resume_gap(tmp_path):
    with pytest.warns(RuntimeWarning, match="no loss-scaler state"):
        resumed(tmp_path, restore_guard=False)
    found = findings(tmp_path)
    (f,) = [f for f in found if f.code == "AG107"]
    assert f.step == 30 and f.evidence["scale_reset"] and f.evidence["scale"] == 65536.0
    assert f.evidence["gap_bits"] >= 4 and "ResumeWarmup" in f.fix
    assert "AG103" not in codes(found)  # the re-probing after the reset is a warm-up


def test_a_resume_that_restores_the_scale_is_clean(tmp_path):
    resumed(tmp_path, restore_guard=True)
    assert "AG107" not in codes(findings(tmp_path))


def test_a_dynamic_range_wider_than_fp16_recommends_bf16(tmp_path):
    run(tmp_path, WideRange(1e-9, 100.0), 20)
    (f,) = [f for f in findings(tmp_path) if f.code == "AG108"]
    assert f.evidence["safe_lo"] > f.evidence["safe_hi"] and "bf16" in f.fix


# ---------------------------------------------------------------------- hand-written logs
def write_run(
    path: Path,
    scales: list[float],
    applied: list[bool] | None = None,
    *,
    init: float = 65536.0,
    layers: list[list[float]] | None = None,  # grad norms
    events: tuple[tuple[int, dict], ...] = (),
) -> Path:
    """A run log with these scales after each step (``scale_before`` follows)."""
    applied = applied or [True] * len(scales)
    names = ["a", "b"]
    path.mkdir(parents=True, exist_ok=True)
    meta = {
        "layers": {"names": names, "numel": [10, 10]},
        "precision": "fp16",
        "scaler": ag.ScalerConfig(init_scale=init, growth_interval=100).to_dict(),
        "guard": {"accumulation_steps": 1},
    }
    (path / "meta.json").write_text(json.dumps(meta))
    lines, before = [], init
    inserts = dict(events)
    for i, (scale, ok) in enumerate(zip(scales, applied, strict=True)):
        rec = {
            "step": i + 1,
            "scale_before": before,
            "scale": scale,
            "applied": ok,
            "overflow": not ok,
            "collapse": False,
            "dropped": 0,
            "loss": 1.0,
            "precision": "fp16",
        }
        if layers is not None:
            rec["layers"] = {"grad_norm": layers[i]}
        lines.append(json.dumps(rec))
        if i + 1 in inserts:
            lines.append(json.dumps(inserts[i + 1]))
            before = inserts[i + 1].get("scale", scale)
        else:
            before = scale
    (path / "events.jsonl").write_text("\n".join(lines) + "\n")
    return path


def cycles(n: int, every: int, top: float = 2.0**16) -> tuple[list[float], list[bool]]:
    """``n`` steps at top/2 that grow to ``top`` every ``every`` steps and overflow there."""
    scales, applied, scale = [], [], top / 2
    for i in range(n):
        if scale == top:  # overflow at the top, back off
            scale, ok = top / 2, False
        elif (i + 1) % every == 0:
            scale, ok = top, True
        else:
            ok = True
        scales.append(scale)
        applied.append(ok)
    return scales, applied


@pytest.mark.parametrize("every,fires", [(2000, False), (120, False), (20, True)])
def test_oscillation_needs_frequent_cycles(tmp_path, every, fires):
    scales, applied = cycles(6000 if every == 2000 else 1200, every)
    write_run(tmp_path, scales, applied, init=2.0**15)
    assert ("AG102" in codes(findings(tmp_path))) is fires


@pytest.mark.parametrize("skips,fires", [(5, False), (6, True)])
def test_skip_rate_threshold_is_exclusive(tmp_path, skips, fires):
    skipped = {30, 45, 60, 75, 90, 105}  # all within one 100-step window
    applied = [i + 1 not in sorted(skipped)[:skips] for i in range(150)]
    write_run(tmp_path, [65536.0] * 150, applied)
    assert ("AG103" in codes(findings(tmp_path, skip_rate=0.05))) is fires


def test_a_short_run_is_not_judged_for_skip_rate_but_gets_an_info_summary(tmp_path):
    write_run(tmp_path, [65536.0] * 15, [True] * 10 + [False] * 5)
    (f,) = [f for f in findings(tmp_path) if f.code == "AG103"]
    assert f.severity == "info" and f.step == 11  # a summary, not a verdict on the rate
    assert f.evidence["skipped"] == 5 and f.evidence["steps"] == 15
    assert f.evidence["causes"] == {"overflow": 5} and "5 of 15 steps" in f.message


@pytest.mark.parametrize("skips", [0, 1])
def test_a_short_run_with_few_skips_gets_no_skip_summary(tmp_path, skips):
    write_run(tmp_path, [65536.0] * 20, [True] * (20 - skips) + [False] * skips)
    assert "AG103" not in codes(findings(tmp_path))  # 1 of 20 is within skip_rate=5%


@pytest.mark.parametrize("warm,fires", [(4, False), (11, True)])
def test_a_short_runs_warm_up_probing_is_summarised_only_past_half_the_run(tmp_path, warm, fires):
    scales = [2.0**15 / 2**i for i in range(warm)] + [2.0**15 / 2**warm] * (20 - warm)
    write_run(tmp_path, scales, [False] * warm + [True] * (20 - warm), init=2.0**16)
    assert rules.skip_causes(runlog.load_run(tmp_path))["warm-up overflow"] == list(
        range(1, warm + 1)
    )
    assert ("AG103" in codes(findings(tmp_path))) is fires


def test_a_forensics_confirmed_overflow_is_never_a_warm_up_overflow(tmp_path):
    diag = ag.Finding(
        "AG301", "error", "fp16 overflow", "fc1 overflowed", step=3, evidence={"steps": [3, 5]}
    )
    event = {"kind": "finding", "step": 3, "finding": diag.to_dict()}
    scales = [32768.0, 16384.0, 8192.0, 8192.0, 4096.0] + [4096.0] * 15
    write_run(
        tmp_path, scales, [False, False, False, True, False] + [True] * 15, events=((3, event),)
    )
    run_log = runlog.load_run(tmp_path)
    assert rules.warmup_mask(run_log, rules.RuleConfig())[:5].all()  # all five in the warm-up
    causes = rules.skip_causes(run_log)
    assert causes["warm-up overflow"] == [1, 2] and causes["overflow"] == [3, 5]
    from ampguard.reporting import summary

    text = summary(tmp_path)
    assert "warm-up overflow 2, overflow 2" in text


def test_all_layers_zero_is_not_a_dead_layer(tmp_path):
    write_run(tmp_path, [65536.0] * 30, layers=[[0.0, 0.0]] * 30)
    assert findings(tmp_path) == []


def test_dead_layer_needs_dead_steps_in_a_row(tmp_path):
    norms = [[0.0, 1.0]] * 19 + [[1e-9, 1.0]] + [[0.0, 1.0]] * 19
    write_run(tmp_path, [65536.0] * 39, layers=norms)
    assert findings(tmp_path) == []
    assert codes(findings(tmp_path, dead_steps=19)) == {"AG104"}


@pytest.mark.parametrize("previous,fires", [(2.0**13, False), (2.0**12, True)])
def test_resume_gap_threshold(tmp_path, previous, fires):
    mark = {
        "kind": "resume",
        "step": 10,
        "scale": 65536.0,
        "previous_scale": previous,
        "scale_reset": False,
    }
    write_run(tmp_path, [65536.0] * 20, events=((10, mark),))
    assert ("AG107" in codes(findings(tmp_path))) is fires


def test_warm_up_ends_at_the_first_growth_or_after_clean_steps(tmp_path):
    cfg = rules.RuleConfig(warmup_clean_steps=3, warmup_max_steps=8)
    grow = write_run(
        tmp_path / "grow",
        [32768.0, 32768.0, 65536.0, 65536.0],
        [False, True, True, True],
        init=65536.0,
    )
    assert rules.warmup_mask(runlog.load_run(grow), cfg).tolist() == [True, True, False, False]
    clean = write_run(tmp_path / "clean", [32768.0] * 6, [False, True, True, True, True, True])
    assert rules.warmup_mask(runlog.load_run(clean), cfg).tolist() == [
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    capped = write_run(tmp_path / "capped", [32768.0] * 10, [False, True] * 5)
    assert rules.warmup_mask(runlog.load_run(capped), cfg).tolist() == [True] * 8 + [False] * 2


def test_skip_causes_split_warm_up_from_later_overflows(tmp_path):
    applied = [False, False] + [True] * 12 + [False] + [True] * 5
    write_run(tmp_path, [65536.0] * 20, applied)
    causes = rules.skip_causes(runlog.load_run(tmp_path))
    assert causes["warm-up overflow"] == [1, 2] and causes["overflow"] == [15]


def test_findings_carry_evidence_and_a_fix_as_plain_json(tmp_path):
    run(tmp_path, mlp(), 40, scaler=ag.ScalerConfig(init_scale=1.0, dynamic=False), amp=1e-4)
    found = findings(tmp_path)
    assert found
    for f in found:
        assert f.fix and f.evidence and f.step is not None
        assert ag.Finding.from_dict(json.loads(json.dumps(f.to_dict(), allow_nan=False))) == f


@pytest.mark.parametrize(
    "field,value",
    [("skip_rate", 1.5), ("dead_steps", 0), ("saturation_factor", 0.5), ("skip_window", 2.5)],
)
def test_bad_thresholds_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        rules.RuleConfig(**{field: value})


def test_evaluate_rejects_a_config_of_the_wrong_type(tmp_path):
    write_run(tmp_path, [65536.0] * 3)
    with pytest.raises(TypeError, match="RuleConfig"):
        rules.evaluate(runlog.load_run(tmp_path), {"skip_rate": 0.1})
