"""Integrations: real short training runs with the HF Trainer, Lightning and Accelerate on CPU.

The frameworks refuse fp16 autocast with a GradScaler on CPU (Accelerate and the HF Trainer fall
back to fp32, Lightning's "16-mixed" switches to bf16). To run their fp16 code paths as they run
on a GPU, the fp16 tests give them the GradScaler they would build there: the Trainer's and
Accelerate's ``accelerator.scaler`` (+ ``native_amp`` for autocast), Lightning's
``MixedPrecision("16-mixed", "cpu", scaler=...)`` plugin. Everything else is the framework's own.
Overflows are planted with a gradient hook that returns inf on chosen backward passes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings

import pytest
import torch
from _runfolders import step_records as _records

import ampguard as ag
from ampguard.telemetry import Telemetry

BAD = (3, 6)  # 1-based optimizer steps whose gradients get an inf
STEPS = 8


def _skipped(run_dir) -> list[int]:
    return [r["step"] for r in _records(run_dir) if not r["applied"]]


def _codes(findings) -> set[str]:
    return {f.code for f in findings}


def _plant(param: torch.nn.Parameter, bad=BAD) -> None:
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] in bad else grad

    param.register_hook(hook)


def _telemetry(run_dir) -> Telemetry:
    return Telemetry(run_dir, flush_every=5, layer_every=1, range_every=4)


# ---------------------------------------------------------------------- HF Trainer
def _hf_run(
    tmp_path,
    *,
    precision="fp16",
    optim="adamw_torch",
    give_scaler=True,
    bad=BAD,
    default_folder=False,
    **extra_args,
):
    transformers = pytest.importorskip("transformers")
    from ampguard.integrations.transformers import AmpGuardCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    _plant(model.transformer.h[0].mlp.c_fc.weight, bad)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (STEPS * 4, 16)).unbind()
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=4,
        save_strategy="no",
        disable_tqdm=True,
        optim=optim,
        learning_rate=1e-3,
        **{"logging_steps": 100, **extra_args},
    )
    callback = (
        AmpGuardCallback() if default_folder else AmpGuardCallback(_telemetry(tmp_path / "run"))
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    if precision == "fp16" and give_scaler:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        trainer.accelerator.native_amp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer, callback


@pytest.mark.slow  # a real transformers Trainer run
def test_hf_trainer_fp16_records_skips_scale_and_report(tmp_path):
    trainer, callback = _hf_run(tmp_path)
    run = tmp_path / "run"
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert _skipped(run) == list(BAD)
    assert [r["scale"] for r in recs] == [1024.0] * 2 + [512.0] * 3 + [256.0] * 3
    assert all(r["precision"] == "fp16" and 0 < r["loss"] < 10 for r in recs)
    assert all(r["grad_norm"] is not None for r in recs if r["applied"])
    meta = json.loads((run / "meta.json").read_text())
    assert meta["scaler"]["framework"] == "transformers"
    assert (run / "report.html").exists()
    assert "AG120" not in _codes(callback.findings())
    assert trainer.lr_scheduler.last_epoch == STEPS - len(BAD)  # gated on the (right) skip flag


@pytest.mark.slow  # a real transformers Trainer run
def test_hf_trainer_fused_optimizer_skips_reported_as_ag120(tmp_path):
    trainer, callback = _hf_run(tmp_path, optim="adamw_torch_fused")
    assert _skipped(tmp_path / "run") == list(BAD)
    # the Trainer's own view: its scheduler advanced on the skipped steps too
    assert trainer.lr_scheduler.last_epoch == STEPS
    ag120 = [f for f in callback.findings() if f.code == "AG120"]
    assert len(ag120) == 1 and ag120[0].evidence["steps"] == list(BAD)
    assert "AG120" in (tmp_path / "run" / "report.html").read_text()


@pytest.mark.slow  # a real transformers Trainer run
def test_hf_trainer_bf16_records_every_step_without_scaler(tmp_path):
    _, callback = _hf_run(tmp_path, precision="bf16", bad=())
    recs = _records(tmp_path / "run")
    assert len(recs) == STEPS
    assert all(r["applied"] and r["scale"] == 1.0 and r["precision"] == "bf16" for r in recs)
    assert all(0 < r["loss"] < 10 and r["grad_norm"] > 0 for r in recs)
    assert (tmp_path / "run" / "report.html").exists()


@pytest.mark.slow  # a real transformers Trainer run
def test_hf_trainer_fp16_on_cpu_is_fp32_and_says_so(tmp_path):
    _, callback = _hf_run(tmp_path, give_scaler=False, bad=(), default_folder=True)
    run = tmp_path / "out" / "ampguard"  # the default: <output_dir>/ampguard
    assert callback.run_dir == run
    assert "AG122" in _codes(callback.findings())
    assert _records(run)[0]["precision"] == "fp32"
    meta = json.loads((run / "meta.json").read_text())
    assert meta["precision"] == "fp32" and meta["requested_precision"] == "fp16"
    saved = json.loads((run / "findings.json").read_text())
    assert "AG122" in {f["code"] for f in saved}


# ---------------------------------------------------------------------- Lightning
def _lightning_run(
    tmp_path,
    *,
    precision="16-mixed",
    fused=False,
    bad=BAD,
    callback=None,
    scaler=None,
    extra_callbacks=(),
    **trainer_kw,
):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ampguard.integrations.lightning import AmpGuardCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
            )
            _plant(self.net[0].weight, bad)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=8
    )
    callback = callback or AmpGuardCallback(_telemetry(tmp_path / "run"))
    if precision == "16-mixed" and scaler is not False:
        scaler = scaler or torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kw = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        kw = {"precision": precision}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, *extra_callbacks],
        default_root_dir=str(tmp_path),
        **kw,
        **trainer_kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), data)
    return trainer, callback


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_lightning_16_mixed_records_skips_and_report(tmp_path, fused):
    _, callback = _lightning_run(tmp_path, fused=fused)
    run = tmp_path / "run"
    recs = _records(run)
    assert len(recs) == STEPS
    assert _skipped(run) == list(BAD)
    assert recs[-1]["scale"] == 256.0
    assert all(0 < r["loss"] < 10 for r in recs)  # the unscaled loss, not loss * scale
    assert all(r["grad_norm"] is not None for r in recs if r["applied"])
    assert json.loads((run / "meta.json").read_text())["scaler"]["framework"] == "lightning"
    assert (run / "report.html").exists()
    assert not {"AG120", "AG122"} & _codes(callback.findings())


def test_lightning_bf16_samples_gradients_in_before_optimizer_step(tmp_path):
    _lightning_run(tmp_path, precision="bf16-mixed", bad=())
    recs = _records(tmp_path / "run")
    assert len(recs) == STEPS
    assert all(r["applied"] and r["precision"] == "bf16" for r in recs)
    # Lightning runs backward inside optimizer.step: a pre-step hook would see no gradients
    assert all(r["grad_norm"] > 0 and 0 < r["loss"] < 10 for r in recs)


def test_lightning_scaler_config_through_the_plugin(tmp_path):
    pytest.importorskip("lightning")
    from ampguard.integrations import grad_scaler, guard_options
    from ampguard.integrations.lightning import AmpGuardCallback

    cfg = ag.ScalerConfig(
        init_scale=2.0**10, growth_interval=1000, hysteresis=2, min_scale=1.0, on_collapse="warn"
    )
    callback = AmpGuardCallback(**guard_options(cfg))  # default folder: <root_dir>/ampguard
    _lightning_run(tmp_path, bad=(3,), callback=callback, scaler=grad_scaler(cfg, "cpu"))
    recs = _records(tmp_path / "ampguard")
    assert _skipped(tmp_path / "ampguard") == [3]
    assert {r["scale"] for r in recs} == {1024.0}  # one lone spike: absorbed by hysteresis
    found = {f.code: f for f in callback.findings()}
    assert found["AG121"].evidence["absorbed"] == 1


# ---------------------------------------------------------------------- Accelerate
def _reset_accelerate():
    # Accelerator state is a process-wide singleton; each test builds its own Accelerator.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _accelerate_run(
    tmp_path,
    *,
    mixed_precision="fp16",
    fused=False,
    give_scaler=True,
    bad=BAD,
    clip=None,
    native_amp=True,
):
    accelerate = pytest.importorskip("accelerate")
    from ampguard.integrations.accelerate import watch_accelerator

    _reset_accelerate()
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)
    if mixed_precision == "fp16" and give_scaler:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        accelerator.native_amp = native_amp
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    _plant(model[0].weight, bad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 4)),
        batch_size=4,
    )
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    flags = []
    with watch_accelerator(accelerator, model, opt, telemetry=_telemetry(tmp_path)) as handle:
        handle.norms = []
        for x, y in data:
            with accelerator.autocast():
                out = model(x)
            accelerator.backward(torch.nn.functional.mse_loss(out.float(), y))
            if clip is not None:  # Accelerate's clip_grad_norm_ returns the pre-clip norm
                handle.norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
            flags.append(accelerator.optimizer_step_was_skipped)
    return handle, flags


def test_accelerate_fp16_skips_match_optimizer_step_was_skipped(tmp_path):
    handle, flags = _accelerate_run(tmp_path)
    assert _skipped(tmp_path) == list(BAD)
    assert [i + 1 for i, f in enumerate(flags) if f] == list(BAD)
    assert "AG120" not in _codes(handle.findings())
    assert _records(tmp_path)[0]["loss"] > 0


def test_accelerate_fused_blind_spot_fixed_in_the_report(tmp_path):
    handle, flags = _accelerate_run(tmp_path, fused=True)
    assert not any(flags)  # Accelerate's own flag misses both skips
    assert _skipped(tmp_path) == list(BAD)  # ampguard's record has them
    found = [f for f in handle.findings() if f.code == "AG120"]
    assert found[0].evidence["steps"] == list(BAD)
    assert "AG120" in handle.report().read_text()


def test_accelerate_bf16_records_loss_and_every_step(tmp_path):
    handle, flags = _accelerate_run(tmp_path, mixed_precision="bf16", bad=())
    recs = _records(tmp_path)
    assert len(recs) == STEPS and all(r["applied"] and r["precision"] == "bf16" for r in recs)
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in recs)


def test_accelerate_fp16_on_cpu_without_scaler_reports_ag122(tmp_path):
    handle, _ = _accelerate_run(tmp_path, give_scaler=False, bad=())
    assert "AG122" in _codes(handle.findings())


def test_accelerate_user_scaler_without_native_amp_is_fp32_and_says_so(tmp_path):
    # accelerator.scaler set by the user, but native_amp stays False (Accelerate on CPU):
    # accelerator.autocast() is a no-op, so the loss is scaled and every op runs in fp32
    handle, flags = _accelerate_run(tmp_path, native_amp=False)
    recs = _records(tmp_path)
    assert len(recs) == STEPS and {r["precision"] for r in recs} == {"fp32"}
    assert _skipped(tmp_path) == list(BAD)  # the scaler still skips the planted overflows
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["precision"] == "fp32" and meta["requested_precision"] == "fp16"
    ag122 = [f for f in handle.findings() if f.code == "AG122"]
    assert len(ag122) == 1 and "native_amp is False" in ag122[0].message
    assert ag122[0].evidence["actual"] == "fp32"


def test_accelerate_records_what_was_requested(tmp_path):
    handle, _ = _accelerate_run(tmp_path, mixed_precision="bf16", bad=())
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["precision"] == meta["requested_precision"] == "bf16"
    assert "AG122" not in _codes(handle.findings())


def test_accelerate_wrappers_removed_on_close(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from ampguard.integrations.accelerate import watch_accelerator

    _reset_accelerate()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Linear(4, 4)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    watch_accelerator(accelerator, model, opt, telemetry=tmp_path).close()
    assert "backward" not in vars(accelerator) and "step" not in vars(opt)
    assert not {"scale", "step", "update"} & set(vars(accelerator.scaler))


# ---------------------------------------------------------------------- missing extras
@pytest.mark.parametrize(
    "module, package, extra",
    [
        ("ampguard.integrations.transformers", "transformers", "integrations"),
        ("ampguard.integrations.lightning", "lightning", "integrations"),
        ("ampguard.integrations.accelerate", "accelerate", "integrations"),
    ],
)
def test_missing_framework_names_the_extra(monkeypatch, module, package, extra):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf'pip install "ampguard\[{extra}\]"'):
        importlib.import_module(module)


@pytest.mark.parametrize("sink, package", [("WandbSink", "wandb"), ("MlflowSink", "mlflow")])
def test_missing_sink_package_names_the_extra(monkeypatch, sink, package):
    from ampguard.integrations import sinks

    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ImportError, match=rf'pip install "ampguard\[{package}\]"'):
        getattr(sinks, sink)()


# ---------------------------------------------------------------------- W&B / MLflow sinks
def _watched_loop(run_dir, sink, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    _plant(model[0].weight, bad=(2,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    tel = Telemetry(run_dir, flush_every=4, layer_every=1, sinks=[sink])
    with ag.watch(scaler, model, opt, telemetry=tel):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return _records(run_dir)


@pytest.mark.timeout(120)
def test_wandb_sink_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from ampguard.integrations.sinks import WandbSink

    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "c"),
        "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
    }.items():
        monkeypatch.setenv(var, value)
    run = wandb.init(project="ampguard-test", mode="offline", dir=str(tmp_path))
    try:
        recs = _watched_loop(tmp_path / "run", WandbSink(run))
        summary = dict(run.summary)
        assert summary["ampguard/step"] == recs[-1]["step"]
        assert summary["ampguard/scale"] == recs[-1]["scale"]
        assert summary["ampguard/skip_rate"] == pytest.approx(1 / len(recs))
        assert summary["_step"] == len(recs) - 1  # one W&B row per step record
    finally:
        run.finish()


def test_mlflow_sink_local_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from ampguard.integrations.sinks import MlflowSink

    # the sink opens its own file store (MLflow 3 refuses one without MLFLOW_ALLOW_FILE_STORE)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    sink = MlflowSink(experiment="ampguard-test", tracking_uri=uri)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set only while the store was made
    recs = _watched_loop(tmp_path / "run", sink)
    client = MlflowClient(tracking_uri=uri)
    run_id = client.search_runs([client.get_experiment_by_name("ampguard-test").experiment_id])[
        0
    ].info.run_id
    history = client.get_metric_history(run_id, "ampguard/scale")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (r["step"], r["scale"]) for r in recs
    ]
    applied = client.get_metric_history(run_id, "ampguard/applied")
    assert [m.step for m in applied if m.value == 0.0] == [2]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_sink_takes_a_path_and_leaves_a_users_setting_alone(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException

    from ampguard.integrations.sinks import MlflowSink, is_local_store

    assert is_local_store("/runs/mlruns") and is_local_store("file:///runs/mlruns")
    assert not is_local_store("http://localhost:5000") and not is_local_store(None)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    sink = MlflowSink(experiment="ampguard-path", tracking_uri=tmp_path / "mlruns")
    sink.start(tmp_path / "run", ["fc"])
    sink.close()
    assert (tmp_path / "mlruns").is_dir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # the user's own choice wins
    with pytest.raises(MlflowException, match="MLFLOW_ALLOW_FILE_STORE"):
        MlflowSink(tracking_uri=tmp_path / "other")


def _logged_steps(uri: str, experiment: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the test's own reader
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        [run] = client.search_runs([exp.experiment_id])
        return sorted(m.step for m in client.get_metric_history(run.info.run_id, "ampguard/scale"))


def test_mlflow_sink_with_no_tracking_uri_works_with_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from ampguard.integrations.sinks import MlflowSink

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    sink = MlflowSink(experiment="e")  # the form in the docs
    recs = _watched_loop(tmp_path / "run", sink)
    if sink.tracking_uri.startswith("sqlite:"):  # full mlflow (SQLAlchemy): MLflow's default
        return
    assert sink.tracking_uri == (tmp_path / "mlruns").as_uri()
    assert _logged_steps(sink.tracking_uri, "e") == [r["step"] for r in recs]
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ


def test_mlflow_sink_follows_a_file_tracking_uri_in_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from ampguard.integrations.sinks import MlflowSink

    uri = (tmp_path / "store").as_uri()
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    sink = MlflowSink(experiment="env")
    recs = _watched_loop(tmp_path / "run", sink)
    assert sink.tracking_uri == uri
    assert _logged_steps(uri, "env") == [r["step"] for r in recs]


# ---------------------------------------------------------------------- attach mode: grad norm
CLIP = 0.01  # well below every norm here: a post-clip record would sit at 0.01


def _recorded_norms(run_dir) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in _records(run_dir) if r["applied"]}


def _assert_pre_clip(recorded: dict[int, float], expected: list[float]) -> None:
    """The run log's norm on step i is clip_grad_norm_'s return value (the pre-clip norm)."""
    assert len(recorded) == len(expected) == STEPS
    assert min(expected) > 10 * CLIP  # clipping bound on every step: post-clip would differ
    for step, value in enumerate(expected, start=1):
        assert recorded[step] == pytest.approx(value, rel=1e-4)


@pytest.mark.slow  # real transformers Trainer runs
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_hf_trainer_grad_norm_is_the_pre_clip_norm(tmp_path, precision):
    trainer, _ = _hf_run(tmp_path, precision=precision, bad=(), max_grad_norm=CLIP, logging_steps=1)
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    _assert_pre_clip(_recorded_norms(tmp_path / "run"), logged)


class _NormProbe:
    """A Lightning callback after ampguard's: clip_grad_norm_'s return value with max_norm=inf
    (the gradients are multiplied by exactly 1) where Lightning is about to clip."""

    def __init__(self):
        import lightning as L

        probe = self

        class Probe(L.Callback):
            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                probe.norms.append(
                    float(torch.nn.utils.clip_grad_norm_(pl_module.parameters(), float("inf")))
                )

        self.norms: list[float] = []
        self.callback = Probe()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_grad_norm_is_the_pre_clip_norm(tmp_path, precision):
    pytest.importorskip("lightning")
    probe = _NormProbe()
    _lightning_run(
        tmp_path,
        precision=precision,
        bad=(),
        extra_callbacks=[probe.callback],
        gradient_clip_val=CLIP,
    )
    _assert_pre_clip(_recorded_norms(tmp_path / "run"), probe.norms)


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16"])
def test_accelerate_grad_norm_is_the_pre_clip_norm(tmp_path, mixed_precision):
    handle, _ = _accelerate_run(tmp_path, mixed_precision=mixed_precision, bad=(), clip=CLIP)
    _assert_pre_clip(_recorded_norms(tmp_path), handle.norms)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaler", "no-scaler"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_watch_grad_norm_is_the_pre_clip_norm(tmp_path, scaled, accumulation):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    dtype = torch.float16 if scaled else torch.bfloat16
    expected = []
    with ag.watch(scaler, model, opt, _telemetry(tmp_path), precision=None if scaled else "bf16"):
        for i in range(STEPS * accumulation):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / accumulation
            (scaler.scale(loss) if scaled else loss).backward()
            if (i + 1) % accumulation:
                continue
            if scaled:
                scaler.unscale_(opt)
            expected.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    _assert_pre_clip(_recorded_norms(tmp_path), expected)


def test_guard_grad_norm_and_record_are_the_pre_clip_norm(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected, returned = [], []
    with ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="bf16",
        clip_grad_norm=CLIP,
        telemetry=_telemetry(tmp_path),
    ) as guard:
        for _ in range(STEPS):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            with guard.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            guard.backward(loss)
            returned.append(guard.step().grad_norm)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.nn.functional.mse_loss(ref(x).float(), y).backward()
            expected.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            ref_opt.step()
            ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(returned, expected, strict=True))  # bitwise
    _assert_pre_clip(_recorded_norms(tmp_path), [float(n) for n in expected])


# ---------------------------------------------------------------------- attach mode: AG122, AG110
@pytest.mark.filterwarnings("ignore:You passed `Trainer:UserWarning")  # Lightning's own notice
def test_lightning_16_mixed_switched_to_bf16_on_cpu_reports_ag122(tmp_path):
    pytest.importorskip("lightning")
    from ampguard.integrations.lightning import AmpGuardCallback

    callback = AmpGuardCallback(_telemetry(tmp_path / "run"), precision="16-mixed")
    _lightning_run(tmp_path, precision="16-mixed", scaler=False, bad=(), callback=callback)
    ag122 = [f for f in callback.findings() if f.code == "AG122"]
    assert len(ag122) == 1 and "'bf16-mixed'" in ag122[0].message
    assert ag122[0].message.endswith("training is bf16.")
    assert _records(tmp_path / "run")[0]["precision"] == "bf16"


def test_lightning_bf16_as_asked_has_no_ag122(tmp_path):
    pytest.importorskip("lightning")
    from ampguard.integrations.lightning import AmpGuardCallback

    callback = AmpGuardCallback(_telemetry(tmp_path / "run"), precision="bf16-mixed")
    _lightning_run(tmp_path, precision="bf16-mixed", bad=(), callback=callback)
    assert "AG122" not in _codes(callback.findings())


def test_lightning_callback_precision_is_checked():
    pytest.importorskip("lightning")
    from ampguard.integrations.lightning import AmpGuardCallback

    with pytest.raises(ValueError, match="precision must be one of Lightning's"):
        AmpGuardCallback(precision="fp16")


def test_accelerate_bf16_applied_nonfinite_steps_are_recorded_as_ag110(tmp_path):
    handle, _ = _accelerate_run(tmp_path, mixed_precision="bf16", bad=(3,))
    recs = _records(tmp_path)
    # Accelerate applied the inf: the weights are NaN from then on, so is every gradient
    assert [r["step"] for r in recs if r["nonfinite"]] == list(range(3, STEPS + 1))
    assert all(r["applied"] for r in recs)  # ampguard only watches: nothing was skipped
    ag110 = [f for f in handle.findings() if f.code == "AG110"]
    assert len(ag110) == 1 and ag110[0].step == 3 and ag110[0].severity == "error"
    assert f"{STEPS - 2} optimizer steps applied" in ag110[0].message


def test_ag121_message_is_singular_for_one_overflow(tmp_path):
    pytest.importorskip("lightning")
    from ampguard.integrations import grad_scaler, guard_options
    from ampguard.integrations.lightning import AmpGuardCallback

    cfg = ag.ScalerConfig(
        init_scale=2.0**10, growth_interval=1000, hysteresis=2, min_scale=1.0, on_collapse="warn"
    )
    callback = AmpGuardCallback(**guard_options(cfg))
    _lightning_run(tmp_path, bad=(3,), callback=callback, scaler=grad_scaler(cfg, "cpu"))
    message = {f.code: f for f in callback.findings()}["AG121"].message
    assert "1 overflow absorbed by hysteresis=2" in message and "overflows" not in message
