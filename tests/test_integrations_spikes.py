"""Loss spikes under the framework integrations: real HF Trainer, Lightning and Accelerate runs
on CPU with a planted spike (one batch with outlier samples), past the detector's 50-window
warm-up. Each checks the spike is detected (AG180), skipped where the framework lets ampguard
skip it (the weights after the spiked step are those before it) and the run goes on, the dump is
in the run folder and ``ampguard postmortem`` reads it, and ``ag.triage`` on the attached run
(or its one clear error where the framework does not hand ampguard the batch).

fp16 runs get the GradScaler the frameworks build on a GPU (see ``tests/test_integrations.py``).
DeepSpeed is in ``tests/test_deepspeed_spikes.py`` (a child process).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from _runfolders import step_records

import ampguard as ag
from ampguard.telemetry import Telemetry

STEPS = 64
SPIKE = 60  # 1-based optimizer step whose batch is planted


def _codes_at(findings, code="AG180") -> list[int]:
    return [f.step for f in findings if f.code == code]


def _postmortem_names_the_spike(run, capsys) -> None:
    from ampguard.cli._main import main

    assert (run / "flight_recorder" / "rank0.json").is_file()
    capsys.readouterr()
    assert main(["postmortem", str(run)]) == 0
    assert f"step {SPIKE}: loss spike" in capsys.readouterr().out


class _Weights:
    """Clones one parameter after every optimizer step (the framework's own step end)."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param, self.after = param, {}

    def take(self, step: int) -> None:
        self.after[step] = self.param.detach().clone()

    def unchanged_at(self, step: int) -> bool:
        return torch.equal(self.after[step], self.after[step - 1])


# ---------------------------------------------------------------------- HF Trainer
def _hf_run(
    tmp_path, *, precision="fp16", spike=SPIKE, steps=STEPS, save=None, resume=False, run="run",
    outliers=4, **options,
):  # fmt: skip
    transformers = pytest.importorskip("transformers")
    from ampguard.integrations.transformers import AmpGuardCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    # no dropout and untied embeddings: triage's CPU reference of one module re-draws a dropout
    # mask and sees only lm_head's share of a tied weight's gradient (persistent_fault verdicts
    # that are not faults; a triage-side limit, reported)
    model = transformers.GPT2LMHeadModel(config)
    pattern = torch.arange(16) % 8  # one short sequence: the model learns it quickly
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(STEPS * 4):
        planted = i // 4 + 1 == spike and i % 4 < outliers  # `outliers` of its 4 sequences
        ids = torch.randint(0, 64, (16,), generator=g) if planted else pattern
        data.append({"input_ids": ids, "labels": ids})
    weights = _Weights(model.lm_head.weight)

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            weights.take(state.global_step)

        def on_train_begin(self, args, state, control, **kw):
            weights.take(0)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), fp16=precision == "fp16", bf16=precision == "bf16",
        use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=4,
        save_strategy="no" if save is None else "steps", save_steps=save or 500,
        disable_tqdm=True, learning_rate=5e-3, logging_steps=1000,
        lr_scheduler_type="linear", dataloader_drop_last=True,
        train_sampling_strategy="sequential",  # the planted batch is step `spike`'s
        optim="adamw_torch",  # not fused: Accelerate sees the skip (a fused one skips in its
    )  # fmt: skip            # kernel, which Accelerate cannot see: AG120, as for overflows
    callback = AmpGuardCallback(Telemetry(tmp_path / run, flush_every=16), **options)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[callback, Probe()]
    )
    if precision == "fp16":
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        trainer.accelerator.native_amp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume or None)
    return trainer, callback, weights


@pytest.mark.slow  # a real transformers Trainer run of 64 steps
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_hf_trainer_skips_a_spike_and_its_scheduler_step(tmp_path, capsys, precision) -> None:
    trainer, callback, weights = _hf_run(tmp_path, precision=precision, on_spike="skip")
    assert _codes_at(callback.findings()) == [SPIKE]
    assert weights.unchanged_at(SPIKE) and not weights.unchanged_at(SPIKE + 1)
    # Accelerate reported the step as skipped, so the Trainer did not step its LR scheduler
    sched = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    assert sched.last_epoch == STEPS - 1
    rec = {r["step"]: r for r in step_records(tmp_path / "run")}
    assert not rec[SPIKE]["applied"] and rec[SPIKE + 1]["applied"]
    _postmortem_names_the_spike(tmp_path / "run", capsys)


@pytest.mark.slow  # a real transformers Trainer run of 64 steps
@pytest.mark.timeout(240)
def test_hf_trainer_triage_replays_the_spiked_step_from_its_batch(tmp_path) -> None:
    # skipped: the model is as the spiked step found it, so no snapshot is needed
    trainer, callback, _ = _hf_run(
        tmp_path, precision="bf16", spike=STEPS, on_spike="skip", signatures=True
    )
    events = ag.triage(callback.watch)
    assert [e.step for e in events] == [STEPS - 1]  # numbered by the steps before its forward
    assert events[0].cause == "model_or_data"  # the batch itself: it spikes in fp32 too
    assert (tmp_path / "run" / "triage" / "rank0.json").is_file()


@pytest.mark.slow  # a real transformers Trainer run of 64 steps and the autopsy's replay
@pytest.mark.timeout(240)
def test_hf_trainer_autopsy_replays_the_trainer_step(tmp_path) -> None:
    # the Trainer clips at max_grad_norm=1.0 (its default): the replay clips as it did
    _, callback, _ = _hf_run(
        tmp_path, precision="bf16", snapshot_every=25, outliers=1, report=False
    )
    (d,) = ag.autopsy(callback.watch)
    assert d.step == SPIKE and d.evidence.get("reproduced") is True, d.evidence
    # one random sequence among the batch's four: the data is the suspect, and dropping it
    # removes the spike
    assert d.evidence["loss_before_update"] > d.evidence["bound"]
    assert d.verified and d.mechanism == "outlier_batch", d.evidence
    assert d.evidence["removed_by"] == "drop_outliers"


@pytest.mark.slow  # three real transformers Trainer runs (64, 40 and 24 steps)
@pytest.mark.timeout(300)
def test_hf_trainer_resume_flags_the_same_spike_at_the_same_step(tmp_path) -> None:
    _, whole, _ = _hf_run(tmp_path / "whole", precision="bf16", report=False)
    assert _codes_at(whole.findings()) == [SPIKE]
    _, first, _ = _hf_run(tmp_path, precision="bf16", steps=40, save=40, report=False)
    assert _codes_at(first.findings()) == []
    saved = tmp_path / "out" / "checkpoint-40" / "ampguard_state.json"
    assert json.loads(saved.read_text())["spikes"]["count"] == 40
    _, second, _ = _hf_run(tmp_path, precision="bf16", resume=True, run="run2", report=False)
    assert second.watch.steps == STEPS
    assert _codes_at(second.findings()) == [SPIKE]


# ---------------------------------------------------------------------- Lightning
def _lightning_run(tmp_path, *, precision="16-mixed", spike=SPIKE, **options):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ampguard.integrations.lightning import AmpGuardCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    x = torch.randn(STEPS * 8, 16)
    y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
    at = slice((spike - 1) * 8, (spike - 1) * 8 + 3)
    x[at] *= 50.0  # three confidently wrong outliers in one batch
    y[at] = (y[at] + 1) % 4
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Module()
    weights = _Weights(module.net[2].weight)
    weights.take(0)

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            weights.take(trainer.global_step)

    callback = AmpGuardCallback(Telemetry(tmp_path / "run", flush_every=16), **options)
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kw = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        kw = {"precision": precision}
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Probe()],
        default_root_dir=str(tmp_path), **kw,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    return trainer, callback, weights


@pytest.mark.slow  # a real Lightning fit of 64 steps
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_skips_a_spike(tmp_path, capsys, precision) -> None:
    _, callback, weights = _lightning_run(tmp_path, precision=precision, on_spike="skip")
    assert _codes_at(callback.findings()) == [SPIKE]
    assert weights.unchanged_at(SPIKE) and not weights.unchanged_at(SPIKE + 1)
    rec = {r["step"]: r for r in step_records(tmp_path / "run")}
    assert not rec[SPIKE]["applied"] and rec[SPIKE + 1]["applied"] and len(rec) == STEPS
    _postmortem_names_the_spike(tmp_path / "run", capsys)


@pytest.mark.slow  # a real Lightning fit of 64 steps
@pytest.mark.timeout(240)
def test_lightning_warn_applies_and_triage_replays_training_step(tmp_path) -> None:
    _, callback, weights = _lightning_run(
        tmp_path, precision="bf16-mixed", spike=STEPS, signatures=True, snapshot_every=1
    )
    assert _codes_at(callback.findings()) == [STEPS]
    assert callback.watch.flight_recorder.events[0].action == "warn"
    assert not weights.unchanged_at(STEPS)  # on_spike="warn" (the default): applied
    events = ag.triage(callback.watch)  # from the snapshot taken before the spiked step
    assert [e.step for e in events] == [STEPS - 1]
    assert events[0].cause == "model_or_data"


# ---------------------------------------------------------------------- Accelerate
def _accelerate_run(tmp_path, *, mixed_precision="fp16", spike=SPIKE, **options):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from ampguard.integrations.accelerate import watch_accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(mixed_precision=mixed_precision, cpu=True)
    if mixed_precision == "fp16":
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        accelerator.native_amp = True
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    weights = _Weights(model[2].weight)
    weights.take(0)
    skipped = []
    handle = watch_accelerator(
        accelerator, model, opt, Telemetry(tmp_path / "run", flush_every=16), **options
    )
    with handle:
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 16, generator=g)
            y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
            if step == spike:
                x[:3] *= 50.0
                y[:3] = (y[:3] + 1) % 4
            with accelerator.autocast():
                out = model(x)
            accelerator.backward(torch.nn.functional.cross_entropy(out.float(), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            skipped.append(accelerator.optimizer_step_was_skipped)
            weights.take(step)
    return handle, weights, skipped, sched


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16"])
def test_accelerate_skips_a_spike_and_reports_it_skipped(tmp_path, capsys, mixed_precision):
    handle, weights, skipped, sched = _accelerate_run(
        tmp_path, mixed_precision=mixed_precision, on_spike="skip"
    )
    assert _codes_at(handle.findings()) == [SPIKE]
    assert weights.unchanged_at(SPIKE) and not weights.unchanged_at(SPIKE + 1)
    assert [i + 1 for i, s in enumerate(skipped) if s] == [SPIKE]  # Accelerate's own flag
    assert sched.scheduler.last_epoch == STEPS - 1  # the prepared scheduler did not advance
    assert "AG120" not in {f.code for f in handle.findings()}
    _postmortem_names_the_spike(tmp_path / "run", capsys)


def test_accelerate_triage_says_the_loop_must_hand_it_the_batch(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle, *_ = _accelerate_run(tmp_path, spike=None, signatures=True)
    with pytest.raises(ValueError, match=r"accelerate does not hand it.*handle.record_batch"):
        ag.triage(handle)


@pytest.mark.parametrize("module", ["transformers", "lightning"])
def test_callback_options_get_the_guards_errors_when_made(module) -> None:
    pytest.importorskip(module)
    import importlib

    callback = importlib.import_module(f"ampguard.integrations.{module}").AmpGuardCallback
    with pytest.raises(ValueError, match="on_spike must be None, 'warn', 'skip'"):
        callback(on_spike="sometimes")
    with pytest.raises(ValueError, match="flight_recorder must be a number of windows"):
        callback(flight_recorder=1)


@pytest.mark.slow  # a real Lightning fit of 64 steps and the autopsy's replay
@pytest.mark.timeout(240)
def test_lightning_autopsy_replays_training_step_from_the_snapshot(tmp_path) -> None:
    _, callback, _ = _lightning_run(tmp_path, precision="bf16-mixed", snapshot_every=25)
    (d,) = ag.autopsy(callback.watch)  # the watch closed with the fit: its recorder remains
    assert d.step == SPIKE and d.verified, d.evidence
    assert d.mechanism == "outlier_batch" and d.evidence["reproduced"] is True


def _resume_fit(tmp_path, name, steps, ckpt=None, save=None):
    """A Lightning fit up to ``steps`` over 10-batch epochs; window SPIKE's batch is planted by
    ``training_step`` (the epochs repeat their data). ``ckpt``: resume from it; ``save``: write
    a checkpoint at the end. Returns the AG180 steps."""
    L = pytest.importorskip("lightning")
    from ampguard.integrations.lightning import AmpGuardCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
            )

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            if self.trainer.global_step + 1 == SPIKE:
                x, y = x.clone(), y.clone()
                x[:3] *= 50.0
                y[:3] = (y[:3] + 1) % 4
            return torch.nn.functional.cross_entropy(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = AmpGuardCallback(Telemetry(tmp_path / name, flush_every=16), report=False)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        default_root_dir=str(tmp_path / name), precision="bf16-mixed",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), data, ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
    return _codes_at(callback.findings())


@pytest.mark.slow  # three real Lightning fits (62, 40 and 22 steps)
@pytest.mark.timeout(300)
def test_lightning_resume_flags_the_same_spike_at_the_same_step(tmp_path) -> None:
    whole = _resume_fit(tmp_path, "whole", 62)
    assert whole == [SPIKE]
    ckpt = tmp_path / "step40.ckpt"
    assert _resume_fit(tmp_path, "first", 40, save=ckpt) == []
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if "AmpGuardCallback" in k]
    assert saved["watch"]["steps"] == 40 and saved["watch"]["spikes"]["count"] == 40
    assert _resume_fit(tmp_path, "second", 62, ckpt=str(ckpt)) == whole
