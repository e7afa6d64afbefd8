"""Guard.diagnostics(): a cheap summary of scale, skips by cause, history and state."""

import torch
from _models import small_mlp, train_steps

import ampguard as ag


def _guard(**kwargs):
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, ag.Guard(model, opt, precision="fp16", **kwargs)


def test_counts_skips_changes_and_history():
    model, guard = _guard(scaler=ag.ScalerConfig(init_scale=1024.0, growth_interval=3))
    train_steps(model, guard, 9, bad={2, 3})
    d = guard.diagnostics(last=4)
    assert d["step"] == 9
    assert d["skipped_steps"] == 2
    assert d["skipped_by_cause"] == {
        "overflow": 2,
        "collapse": 0,
        "nonfinite": 0,
        "nonfinite_forward": 0,
    }
    assert d["applied_steps"] == 7
    # 1024 -> 512 -> 256 (two back-offs at steps 2, 3), growth at steps 6 and 9
    assert d["scale"] == 1024.0
    assert d["scale_changes"] == 4
    assert [e["step"] for e in d["last_scales"]] == [6, 7, 8, 9]
    assert [e["scale"] for e in d["last_scales"]] == [512.0, 512.0, 512.0, 1024.0]
    assert d["consecutive_skips"] == 0
    assert d["precision"] == "fp16"
    assert d["fallbacks"] == []


def test_consecutive_skips_now():
    model, guard = _guard(scaler=ag.ScalerConfig(init_scale=1024.0))
    train_steps(model, guard, 5, bad={4, 5})
    assert guard.diagnostics()["consecutive_skips"] == 2


def test_fallback_is_listed():
    model, guard = _guard(
        scaler=ag.ScalerConfig(init_scale=2.0, min_scale=1.0, on_collapse="fallback")
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_steps(model, guard, 3, bad={1, 2})
    d = guard.diagnostics()
    assert d["precision"] == "bf16"
    assert d["fallbacks"] == [{"step": 2, "from": "fp16", "to": "bf16"}]
    assert d["skipped_by_cause"] == {
        "overflow": 1,
        "collapse": 1,
        "nonfinite": 0,
        "nonfinite_forward": 0,
    }


def test_close_records_diagnostics_for_the_report_header(tmp_path):
    import json

    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ag.Guard(
        model, opt, precision="fp16", telemetry=tmp_path, scaler=ag.ScalerConfig(init_scale=1024.0)
    ) as guard:
        train_steps(model, guard, 6, bad={5, 6})
        expected = guard.diagnostics()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["diagnostics"]["consecutive_skips"] == expected["consecutive_skips"] == 2
    html = ag.report(tmp_path).read_text()
    assert "consecutive skips at end<b>2</b>" in html
