"""ampguard.integrations.deepspeed against a real DeepSpeed (0.19.8) on CPU.

DeepSpeed refuses fp16 on CPU ("Type fp16 is not supported on your device"), so: a real bf16
engine end to end (deepspeed.initialize, one process, gloo), and the fp16 path by driving
DeepSpeed's own DynamicLossScaler in a real fp16-autocast loop. Both run in one child process
(``python tests/test_deepspeed.py OUT``): initializing DeepSpeed's process group would leak into
the other tests of this process. The checks on DeepSpeed's objects that need no process group
run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
BF16_STEPS, BF16_NAN_AT = 5, 2  # 0-based iteration whose loss is NaN
FP16_STEPS, FP16_OVERFLOW_AT = 4, 1
INIT = 2.0**16


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


# ---------------------------------------------------------------------- the child process
def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "step") == "step"]


def _bf16_engine(root: Path) -> dict:
    import deepspeed

    import ampguard.integrations.deepspeed as agds

    torch.manual_seed(0)
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    norms, losses = {}, {}
    with agds.watch(engine, telemetry=root / "bf16") as handle:
        for i in range(BF16_STEPS):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            if i == BF16_NAN_AT:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            losses[i + 1] = float(loss.detach())
            if engine.was_step_applied():
                norms[i + 1] = float(engine.get_global_grad_norm())
        wrapped = sorted(n for n in ("backward", "step") if n in engine.__dict__)
        skipped = handle.skipped_steps
        codes = sorted({f.code for f in handle.findings()})
        report = handle.report()
    return {
        "records": _records(root / "bf16"),
        "meta": json.loads((root / "bf16" / "meta.json").read_text()),
        "engine_norms": norms,
        "losses": losses,
        "engine_skipped": engine.skipped_steps,
        "watch_skipped": skipped,
        "codes": codes,
        "report": report.is_file(),
        "wrapped_while_open": wrapped,
        "wrapped_after_close": sorted(n for n in ("backward", "step") if n in engine.__dict__),
    }


def _zero3_engine(root: Path) -> dict:
    import deepspeed

    import ampguard as ag
    import ampguard.integrations.deepspeed as agds

    torch.manual_seed(0)
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    refused = []
    for args in ((engine, engine.module, opt), (None, engine, opt)):
        try:
            ag.watch(*args, telemetry=root / "refused", precision="bf16")
        except TypeError as err:
            refused.append(str(err))
    norms, applied = {}, []
    tel = ag.Telemetry(root / "zero3", layer_stats=False)
    with agds.watch(engine, telemetry=tel) as handle:
        for i in range(BF16_STEPS):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            if i == BF16_NAN_AT:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            applied.append(bool(engine.was_step_applied()))
            if applied[-1]:
                norms[i + 1] = float(engine.get_global_grad_norm())
        skipped = handle.skipped_steps
    return {
        "records": _records(root / "zero3"),
        "engine_norms": norms,
        "engine_applied": applied,
        "watch_skipped": skipped,
        "refused": refused,
    }


def _fp16_loss_scaler(root: Path) -> dict:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.utils import has_inf_or_nan

    import ampguard as ag

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(
        init_scale=INIT,
        scale_window=1000,
        min_scale=1.0,
        delayed_shift=1,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=False,
        dtype=torch.float16,
    )
    seen, norms = [], {}
    with ag.watch(scaler, model, opt, telemetry=root / "fp16") as handle:
        for i in range(FP16_STEPS):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if i == FP16_OVERFLOW_AT:
                loss = loss * 1e30  # the scaled fp16 gradients overflow
            scaler.backward(loss)
            # DeepSpeed's own check (its has_overflow_serial passes self to a plain function)
            overflow = any(has_inf_or_nan(p.grad) for p in model.parameters())
            seen.append(scaler.cur_scale)
            grads = [p.grad for p in model.parameters()]
            if not overflow:
                total = sum(float(g.double().norm()) ** 2 for g in grads) ** 0.5
                norms[i + 1] = total / scaler.cur_scale
            scaler.update_scale(overflow)
            if not overflow:
                for g in grads:
                    g.div_(seen[-1])
                opt.step()
            opt.zero_grad()
        assert handle.precision == "fp16"
        skipped = handle.skipped_steps
    return {
        "records": _records(root / "fp16"),
        "meta": json.loads((root / "fp16" / "meta.json").read_text()),
        "scale_before": seen,
        "scale_after": scaler.cur_scale,
        "norms": norms,
        "watch_skipped": skipped,
        "wrapped_after_close": sorted(
            n for n in ("scale_loss", "update_scale") if n in scaler.__dict__
        ),
    }


def _child(out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # (the attribute is torch itself)
    # DeepSpeed JIT-compiles a shared-memory allreduce op on CPU (minutes on 2 cores); one
    # process never uses it
    ds_comm.build_shm_op = lambda: None
    root = out.parent
    result = {
        "bf16": _bf16_engine(root),
        "fp16": _fp16_loss_scaler(root),
        "zero3": _zero3_engine(root),
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
    sys.exit(0)


# ---------------------------------------------------------------------- the tests
deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (pip install 'ampguard[deepspeed]')"
)
agds = pytest.importorskip("ampguard.integrations.deepspeed")


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("deepspeed") / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(HERE), str(out)],
        capture_output=True,
        text=True,
        timeout=280,  # under pytest's own limit: a hang fails with the child's output
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bf16_engine_records_every_step_and_the_skip_deepspeed_made(child):
    run = child["bf16"]
    recs = run["records"]
    assert [r["step"] for r in recs] == list(range(1, BF16_STEPS + 1))
    applied = [r["applied"] for r in recs]
    assert applied == [i != BF16_NAN_AT for i in range(BF16_STEPS)]
    assert run["engine_skipped"] == 1 == run["watch_skipped"]
    assert {r["precision"] for r in recs} == {"bf16"} and {r["scale"] for r in recs} == {1.0}
    assert run["meta"]["scaler"] == {"mode": "attach", "framework": "deepspeed"}
    assert run["meta"]["guard"]["clip_grad_norm"] == 1.0  # the engine's gradient_clipping


@pytest.mark.slow
def test_bf16_engine_grad_norm_is_the_engines_and_the_loss_is_recorded(child):
    run = child["bf16"]
    for rec in run["records"]:
        if rec["applied"]:
            # the record's norm is exactly the engine's own get_global_grad_norm()
            assert rec["grad_norm"] == pytest.approx(run["engine_norms"][str(rec["step"])], 1e-6)
            assert rec["loss"] == pytest.approx(run["losses"][str(rec["step"])], rel=1e-6)


@pytest.mark.slow
def test_bf16_engine_per_layer_stats_findings_and_report(child):
    run = child["bf16"]
    assert run["meta"]["layers"]["names"] == ["0", "2"]  # the model's layers, not flat buffers
    first = run["records"][0]
    assert len(first["layers"]["grad_norm"]) == 2
    assert all(n > 0 for n in first["layers"]["grad_norm"])
    assert run["report"]
    assert "AG109" in run["codes"]  # the non-finite bf16 step DeepSpeed skipped


@pytest.mark.slow
def test_engine_wrappers_are_removed_on_close(child):
    assert child["bf16"]["wrapped_while_open"] == ["backward", "step"]
    assert child["bf16"]["wrapped_after_close"] == []
    assert child["fp16"]["wrapped_after_close"] == []


@pytest.mark.slow
def test_fp16_dynamic_loss_scaler_overflow_halves_the_scale_and_is_a_skip(child):
    run = child["fp16"]
    recs = run["records"]
    assert [r["applied"] for r in recs] == [i != FP16_OVERFLOW_AT for i in range(FP16_STEPS)]
    assert run["watch_skipped"] == 1
    assert run["scale_before"] == [INIT, INIT, INIT / 2, INIT / 2]  # DeepSpeed halved it
    assert [r["scale_before"] for r in recs] == run["scale_before"]
    assert [r["scale"] for r in recs] == run["scale_before"][1:] + [run["scale_after"]]
    assert {r["precision"] for r in recs} == {"fp16"}
    for rec in recs:
        if rec["applied"]:  # unscaled by the scale the step used
            assert rec["grad_norm"] == pytest.approx(run["norms"][str(rec["step"])], rel=1e-4)


@pytest.mark.slow
def test_fp16_loss_scaler_settings_reach_the_run_log_in_ampguards_names(child):
    scaler = child["fp16"]["meta"]["scaler"]
    assert scaler["scaler_class"] == "deepspeed.DynamicLossScaler"
    assert scaler["init_scale"] == INIT and scaler["growth_interval"] == 1000
    assert scaler["backoff_factor"] == 0.5 and scaler["min_scale"] == 1.0
    assert scaler["hysteresis"] == 1


@pytest.mark.slow
def test_zero3_engine_records_scale_skips_and_the_engines_grad_norm(child):
    run = child["zero3"]
    recs = run["records"]
    assert [r["step"] for r in recs] == list(range(1, BF16_STEPS + 1))
    assert [r["applied"] for r in recs] == run["engine_applied"]
    assert run["watch_skipped"] == run["engine_applied"].count(False)
    assert {r["scale"] for r in recs} == {1.0} and "layers" not in recs[0]
    for rec in recs:
        if rec["applied"]:
            assert rec["grad_norm"] == pytest.approx(run["engine_norms"][str(rec["step"])], 1e-4)


@pytest.mark.slow
def test_ag_watch_given_an_engine_points_to_the_deepspeed_watch(child):
    refused = child["zero3"]["refused"]
    assert len(refused) == 2
    assert all("ampguard.integrations.deepspeed.watch(engine" in m for m in refused)


def test_the_cpu_jit_warning_names_the_build_folder_and_its_lock(tmp_path, monkeypatch):
    from ampguard.integrations import _deepspeed_jit as jit

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / jit.SHM_OP
    assert jit.shm_build_folder(torch) == str(folder)
    message = jit.shm_op_warning()
    assert message is not None and "JIT-compiles" in message and str(folder / "lock") in message
    folder.mkdir()
    (folder / "lock").write_text("")
    assert "left by a killed build" in jit.shm_op_warning()
    (folder / "lock").unlink()
    (folder / f"{jit.SHM_OP}.so").write_bytes(b"")
    assert jit.shm_op_warning() is None  # built already: nothing to say


# ---------------------------------------------------------------------- no process group needed
def _dynamic():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(INIT, 1000, 1.0, 2, False)


def test_the_seam_finds_deepspeeds_scalers():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from ampguard.integrations import _seam

    assert isinstance(_seam.adapt(_dynamic()), agds.LossScalerWatch)
    assert _seam.adapt(LossScaler(scale=1.0)) is None  # a fixed scale of 1: no loss scale
    assert isinstance(_seam.adapt(LossScaler(scale=128.0)), agds.LossScalerWatch)


def test_guard_features_are_refused_deepspeed_keeps_its_own(tmp_path):
    import ampguard as ag

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="hysteresis.*DynamicLossScaler keeps its own"):
        ag.watch(_dynamic(), model, opt, telemetry=tmp_path, hysteresis=2)


def test_watch_wants_an_engine(tmp_path):
    with pytest.raises(TypeError, match="engine must be a deepspeed.DeepSpeedEngine"):
        agds.watch(_model(), telemetry=tmp_path)
