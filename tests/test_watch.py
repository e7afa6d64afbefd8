"""ag.watch: attach mode on a plain GradScaler loop (real fp16 autocast on CPU, no mocks)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from _runfolders import step_records as _records

import ampguard as ag
from ampguard.telemetry import Telemetry
from ampguard.testing import SyncCounter

STEPS = 20
OVERFLOW_AT = (3, 4, 11)  # 0-based iterations whose gradients get an inf


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, foreach=True)


def _run(
    kind="plain",
    *,
    run_dir=None,
    steps=STEPS,
    overflow_at=OVERFLOW_AT,
    clip=False,
    scaler_kw=None,
    watch_kw=None,
    telemetry_kw=None,
    before_step=None,
):
    """The loop a user writes; with ``run_dir`` the same loop under ag.watch."""
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer(kind, model.parameters())
    scaler = torch.amp.GradScaler(
        "cpu", **(scaler_kw or {"init_scale": 2.0**8, "growth_interval": 3})
    )
    handle = None
    if run_dir is not None:
        tel = Telemetry(
            run_dir, **(telemetry_kw or {"flush_every": 7, "layer_every": 1, "range_every": 5})
        )
        handle = ag.watch(scaler, model, opt, telemetry=tel, **(watch_kw or {}))
    for i in range(steps):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in overflow_at:
            model[0].weight.grad.view(-1)[0] = float("inf")
        if before_step is not None:
            before_step(i, model, scaler, loss)
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, opt, scaler, handle


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _bitwise_equal(a, b) -> bool:
    ta, tb = list(_tensors(a)), list(_tensors(b))
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


# ---------------------------------------------------------------------- numerics unchanged
@pytest.mark.parametrize("kind", ["plain", "fused", "sgd"])
@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
def test_parameters_optimizer_state_and_scale_bitwise_identical(tmp_path, kind, clip):
    bare_model, bare_opt, bare_scaler, _ = _run(kind, clip=clip)
    model, opt, scaler, handle = _run(kind, clip=clip, run_dir=tmp_path)
    handle.close()
    assert _bitwise_equal(list(bare_model.parameters()), list(model.parameters()))
    assert _bitwise_equal(bare_opt.state_dict()["state"], opt.state_dict()["state"])
    assert torch.equal(bare_scaler._scale, scaler._scale)
    assert torch.equal(bare_scaler._growth_tracker, scaler._growth_tracker)


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_skipped_steps_recorded_from_found_inf(tmp_path, kind):
    _, _, _, handle = _run(kind, run_dir=tmp_path)
    handle.close()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    skipped = [r["step"] for r in recs if not r["applied"]]
    assert skipped == [i + 1 for i in OVERFLOW_AT]
    assert all(r["overflow"] == (not r["applied"]) for r in recs)


def test_fused_skip_is_read_from_found_inf_not_from_step_calls(tmp_path):
    # GradScaler calls a fused optimizer's step() on every iteration, skipped or not.
    torch.manual_seed(0)
    model = _model()
    opt = _optimizer("fused", model.parameters())
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    scaler = torch.amp.GradScaler("cpu")
    with ag.watch(scaler, model, opt, telemetry=tmp_path):
        for i in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if i in (1, 4):
                model[2].weight.grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert len(calls) == 6
    assert [r["applied"] for r in _records(tmp_path)] == [True, False, True, True, False, True]


def test_scale_record_follows_the_scaler(tmp_path):
    seen = []
    _, _, scaler, handle = _run(
        "plain", run_dir=tmp_path, before_step=lambda i, m, s, loss: seen.append(s.get_scale())
    )
    handle.close()
    recs = _records(tmp_path)
    assert [r["scale_before"] for r in recs] == seen
    assert recs[-1]["scale"] == scaler.get_scale()
    assert all(r["scale"] == s for r, s in zip(recs, seen[1:] + [scaler.get_scale()], strict=True))


def test_unscaled_grad_norm_and_loss_recorded(tmp_path):
    expected_norm, expected_loss = {}, {}

    def reference(i, model, scaler, loss):
        grads = [p.grad.double() for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        expected_norm[i + 1] = float(norm) / scaler.get_scale()
        expected_loss[i + 1] = float(loss.detach())

    _, _, _, handle = _run("plain", run_dir=tmp_path, overflow_at=(), before_step=reference)
    handle.close()
    for rec in _records(tmp_path):
        assert rec["grad_norm"] == pytest.approx(expected_norm[rec["step"]], rel=1e-5)
        assert rec["loss"] == pytest.approx(expected_loss[rec["step"]], rel=1e-6)


def test_per_layer_stats_recorded(tmp_path):
    _, _, _, handle = _run("plain", run_dir=tmp_path, overflow_at=())
    handle.close()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["layers"]["names"] == ["0", "2"]
    assert meta["scaler"]["mode"] == "attach"
    assert meta["scaler"]["growth_interval"] == 3
    rec = _records(tmp_path)[0]
    norms = rec["layers"]["grad_norm"]
    assert math.hypot(*norms) == pytest.approx(rec["grad_norm"], rel=1e-5)


def test_two_optimizers_only_the_overflowing_one_is_named(tmp_path):
    torch.manual_seed(0)
    model = _model()
    opts = [
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    ]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    handle = ag.watch(scaler, model, opts, telemetry=tmp_path)
    for i in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i == 1:
            model[2].bias.grad[0] = float("nan")
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
    handle.close()
    recs = _records(tmp_path)
    assert [r["applied"] for r in recs] == [True, False, True]
    assert recs[1]["overflowed"] == [1]


# ---------------------------------------------------------------------- no extra host syncs
@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_no_host_sync_added_between_flushes(tmp_path, kind):
    counts = {}
    for watched in (False, True):
        torch.manual_seed(0)
        model = _model()
        opt = _optimizer(kind, model.parameters())
        scaler = torch.amp.GradScaler("cpu")
        if watched:
            handle = ag.watch(
                scaler,
                model,
                opt,
                telemetry=Telemetry(tmp_path, flush_every=100, layer_every=1, range_every=2),
            )
        with SyncCounter() as counter:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        counts[watched] = counter.count
        if watched:
            handle.close()
    assert counts[True] == counts[False]


# ---------------------------------------------------------------------- handle lifecycle
def test_close_restores_the_scaler_methods(tmp_path):
    scaler = torch.amp.GradScaler("cpu")
    model = _model()
    handle = ag.watch(
        scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), telemetry=tmp_path
    )
    assert "update" in vars(scaler)
    handle.close()
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))


def test_context_manager_writes_findings_and_meta(tmp_path):
    with _run("plain", run_dir=tmp_path)[3] as handle:
        pass
    assert handle.steps == STEPS
    found = json.loads((tmp_path / "findings.json").read_text())
    # 3 injected overflows in a 20-step run: too short for AG103's verdict, so its info summary
    assert [(f["code"], f["severity"]) for f in found] == [("AG103", "info")]
    assert (tmp_path / "meta.json").exists()


def test_a_scaler_can_be_watched_once(tmp_path):
    scaler = torch.amp.GradScaler("cpu")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ag.watch(scaler, model, opt, telemetry=tmp_path / "a")
    with pytest.raises(ValueError, match="already watched"):
        ag.watch(scaler, model, opt, telemetry=tmp_path / "b")


def test_a_second_run_in_the_same_folder_starts_a_new_log(tmp_path):
    _run("plain", run_dir=tmp_path, steps=4)[3].close()
    _run("plain", run_dir=tmp_path, steps=3)[3].close()
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


def test_report_written(tmp_path):
    _, _, _, handle = _run("plain", run_dir=tmp_path, steps=6)
    path = handle.report()
    handle.close()
    assert path == tmp_path / "report.html"
    assert path.stat().st_size > 0


# ---------------------------------------------------------------------- bad input
def _basic(tmp_path):
    model = _model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"min_scale": 8.0, "max_scale": 2.0}, "max_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
        ({"on_collapse": "fallback"}, "on_collapse"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "bf16"}, "precision"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(tmp_path, kwargs, match):
    model, opt, run_dir = _basic(tmp_path)
    with pytest.raises(ValueError, match=match):
        ag.watch(torch.amp.GradScaler("cpu"), model, opt, telemetry=run_dir, **kwargs)


def test_wrong_types_raise_type_error(tmp_path):
    model, opt, run_dir = _basic(tmp_path)
    with pytest.raises(TypeError, match="scaler"):
        ag.watch(object(), model, opt, telemetry=run_dir)
    with pytest.raises(TypeError, match="optimizer"):
        ag.watch(torch.amp.GradScaler("cpu"), model, "sgd", telemetry=run_dir)
    with pytest.raises(TypeError, match="telemetry"):
        ag.watch(torch.amp.GradScaler("cpu"), model, opt, telemetry=3)


def test_no_scaler_needs_a_precision(tmp_path):
    model, opt, run_dir = _basic(tmp_path)
    with pytest.raises(ValueError, match="precision"):
        ag.watch(None, model, opt, telemetry=run_dir)


def test_guard_features_need_a_scaler(tmp_path):
    model, opt, run_dir = _basic(tmp_path)
    with pytest.raises(ValueError, match="min_scale"):
        ag.watch(None, model, opt, telemetry=run_dir, precision="bf16", min_scale=1.0)


# ---------------------------------------------------------------------- scaler-free loops
def test_bf16_loop_without_scaler_records_every_step(tmp_path):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with ag.watch(
        None, model, opt, telemetry=Telemetry(tmp_path, layer_every=1), precision="bf16"
    ) as handle:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            handle.record_loss(loss)
            losses.append(float(loss.detach()))
            opt.step()
            opt.zero_grad()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(r["applied"] and r["scale"] == 1.0 and r["precision"] == "bf16" for r in recs)
    assert [r["loss"] for r in recs] == pytest.approx(losses, rel=1e-6)
    assert all(r["grad_norm"] > 0 for r in recs)


# ---------------------------------------------------------------------- attach-mode guard
def _always_overflow(i, model, scaler, loss):
    model[0].weight.grad.view(-1)[0] = float("inf")


def test_floor_stops_the_backoff_where_torch_goes_below_one(tmp_path):
    kw = {"init_scale": 8.0, "growth_interval": 100}
    _, _, bare, _ = _run(scaler_kw=kw, steps=8, before_step=_always_overflow)
    with pytest.warns(RuntimeWarning, match="collapsed"):
        _, _, scaler, handle = _run(
            scaler_kw=kw,
            steps=8,
            before_step=_always_overflow,
            run_dir=tmp_path,
            watch_kw={"min_scale": 1.0},
            telemetry_kw={"flush_every": 4},
        )
    assert bare.get_scale() == 8.0 * 0.5**8
    assert scaler.get_scale() == 1.0
    found = {f.code: f for f in handle.findings()}
    assert found["AG121"].evidence["floored"] >= 1
    handle.close()


def test_collapse_raise_policy_raises_at_the_flush(tmp_path):
    with pytest.raises(ag.ScaleCollapseError, match="min_scale=4"):
        _run(
            scaler_kw={"init_scale": 8.0},
            steps=8,
            before_step=_always_overflow,
            run_dir=tmp_path,
            watch_kw={"min_scale": 4.0, "on_collapse": "raise"},
            telemetry_kw={"flush_every": 2},
        )


def test_cap_holds_growth(tmp_path):
    kw = {"init_scale": 2.0**8, "growth_interval": 1}
    _, _, bare, _ = _run(scaler_kw=kw, steps=6, overflow_at=())
    _, _, scaler, handle = _run(
        scaler_kw=kw, steps=6, overflow_at=(), run_dir=tmp_path, watch_kw={"max_scale": 2.0**10}
    )
    handle.close()
    assert bare.get_scale() == 2.0**14
    assert scaler.get_scale() == 2.0**10
    assert [r["scale"] for r in _records(tmp_path)] == [
        2.0**9,
        2.0**10,
        2.0**10,
        2.0**10,
        2.0**10,
        2.0**10,
    ]


@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_matches_ampguard_loss_scaler(tmp_path, consecutive):
    cfg = ag.ScalerConfig(
        init_scale=2.0**8,
        growth_interval=3,
        hysteresis=2,
        consecutive_hysteresis=consecutive,
        min_scale=1.0,
        max_scale=2.0**24,
    )
    pattern = (2, 4, 5, 6, 12, 13, 14)
    ref = ag.LossScaler(cfg, torch.device("cpu"))
    expected = []
    for i in range(16):
        ref.update(torch.tensor(float(i in pattern)))
        expected.append(ref.scale())
    _, _, _, handle = _run(
        scaler_kw={"init_scale": 2.0**8, "growth_interval": 3},
        steps=16,
        overflow_at=pattern,
        run_dir=tmp_path,
        watch_kw={
            "hysteresis": 2,
            "consecutive_hysteresis": consecutive,
            "min_scale": 1.0,
            "max_scale": 2.0**24,
        },
    )
    handle.close()
    recs = _records(tmp_path)
    assert [r["scale"] for r in recs] == expected
    assert [r["step"] for r in recs if not r["applied"]] == [i + 1 for i in pattern]


def test_guard_features_that_never_bind_change_nothing(tmp_path):
    bare_model, bare_opt, bare, _ = _run("plain")
    model, opt, scaler, handle = _run(
        "plain", run_dir=tmp_path, watch_kw={"min_scale": 1.0, "max_scale": 2.0**20}
    )
    assert _bitwise_equal(list(bare_model.parameters()), list(model.parameters()))
    assert _bitwise_equal(bare_opt.state_dict()["state"], opt.state_dict()["state"])
    assert torch.equal(bare._scale, scaler._scale)
    assert "AG121" not in {f.code for f in handle.findings()}
    handle.close()


def test_warn_policy_warns_once_per_episode(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, _, handle = _run(
            scaler_kw={"init_scale": 2.0},
            steps=12,
            before_step=_always_overflow,
            run_dir=tmp_path,
            watch_kw={"min_scale": 1.0},
            telemetry_kw={"flush_every": 3},
        )
    handle.close()
    assert sum("collapsed" in str(w.message) for w in caught) == 1
