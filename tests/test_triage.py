"""ag.triage: every cause on real CPU training runs with planted faults (ampguard.testing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampguard as ag
from ampguard.findings import Finding
from ampguard.testing import inject_fault


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _run(model, precision="bf16", steps=3, batch=_batch, fault=None, **guard_kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision=precision, snapshot_every=1, **guard_kw)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    inj = fault(model, guard) if fault is not None else None  # stays armed: a broken unit
    for i in range(steps):
        b = batch(i)
        with guard.autocast():
            loss = _loss(model, b)
        guard.backward(loss)
        guard.step(batch=b, loss_fn=_loss)
    return guard, rec, inj


def _fault(**kw):
    def plant(model, guard):
        return inject_fault(model, guard=guard, step=2, element=5, **kw).__enter__()

    return plant


def test_transient_forward_fault() -> None:
    model = _mlp()
    guard, rec, inj = _run(model, fault=_fault(module="4", bit="exponent_top"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (event,) = ag.triage(guard, recorder=rec)
    assert inj.fired_at == [2]
    assert (event.step, event.cause, event.module, event.phase) == (
        2,
        "transient_fault",
        "4",
        "forward",
    )
    assert event.evidence["reproduced"] is False and event.rank == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left as it was


def test_transient_backward_fault_names_the_module_whose_backward_was_wrong() -> None:
    model = _mlp()
    guard, rec, _ = _run(model, fault=_fault(module="2", phase="backward", bit="exponent_top"))
    (event,) = ag.triage(guard, recorder=rec, step=2)  # silent: named by step (an audit mismatch)
    assert (event.cause, event.module, event.phase) == ("transient_fault", "2", "backward")


def test_persistent_forward_fault_names_module_and_op() -> None:
    model = _mlp()
    guard, rec, _ = _run(model, fault=_fault(module="4", bit="exponent_top", persistent=True))
    (event,) = ag.triage(guard, recorder=rec)
    assert (event.cause, event.module, event.op, event.phase) == (
        "persistent_fault",
        "4",
        "aten.addmm",
        "forward",
    )
    assert event.evidence["reproduced"] is True and event.evidence["replays"] == 2


def test_persistent_op_fault_is_bisected_to_the_op() -> None:
    model = _mlp()
    plant = _fault(module="2", op="aten.gelu", bit="exponent_low", persistent=True)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Linear(32, 4)
    )
    torch.manual_seed(0)
    guard, rec, _ = _run(
        model, fault=_fault(module="1.1", op="aten.gelu", bit="exponent_low", persistent=True)
    )
    (event,) = ag.triage(guard, recorder=rec, step=2)
    assert (event.cause, event.module, event.op) == ("persistent_fault", "1.1", "aten.gelu")
    assert event.evidence["op_found_by"] == "op output"
    del plant


def test_persistent_backward_fault() -> None:
    model = _mlp()
    guard, rec, _ = _run(
        model, fault=_fault(module="2", phase="backward", bit="mantissa", persistent=True)
    )
    (event,) = ag.triage(guard, recorder=rec, step=2)
    assert (event.cause, event.module, event.phase, event.op) == (
        "persistent_fault",
        "2",
        "backward",
        "aten.mm",
    )


class _Hot(nn.Module):
    """fc1's output times 3000 leaves fp16's range: a numerics failure fp32 does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * 3000.0)


def test_numerics_attaches_locate_diagnosis() -> None:
    torch.manual_seed(0)
    guard, rec, _ = _run(
        _Hot(),
        precision="fp16",
        steps=2,
        batch=lambda i: (torch.randn(16, 8) * 30, torch.randn(16, 4)),
    )
    (event,) = ag.triage(guard, recorder=rec)
    assert event.cause == "numerics" and event.diagnosis is not None
    assert event.diagnosis.kind == "fp16_overflow" and event.op == "aten.mul"
    assert event.evidence["fp32_failed"] is False


def test_model_or_data() -> None:
    def batch(i):
        x, y = _batch(i)
        if i == 1:
            x[3, 2] = float("nan")
        return x, y

    guard, rec, _ = _run(_mlp(), steps=2, batch=batch)
    (event,) = ag.triage(guard, recorder=rec)
    assert (event.step, event.cause, event.module) == (1, "model_or_data", "0")
    assert event.evidence["fp32_failed"] is True


def test_event_is_a_finding() -> None:
    model = _mlp()
    guard, rec, _ = _run(model, fault=_fault(module="4", bit="exponent_top", persistent=True))
    (event,) = ag.triage(guard, recorder=rec)
    f = event.finding()
    assert isinstance(f, Finding) and f.code == "AG383" and f.step == 2
    assert "'4'" in f.title and f.evidence["rank"] == 0 and f.evidence["op"] == "aten.addmm"


def test_clean_run_has_no_event_and_no_fault() -> None:
    guard, rec, _ = _run(_mlp(), steps=4)
    assert ag.triage(guard, recorder=rec) == []
    (event,) = ag.triage(guard, recorder=rec, step=3)  # a clean step named: not a fault
    assert event.cause == "model_or_data" and event.evidence["reproduced"] is True


def test_plain_loop_with_own_restore() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", flight_recorder=False, on_spike=None)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    snaps = {}
    with inject_fault(model, module="4", step=1, guard=guard, element=5):
        for i in range(2):
            snaps[i] = {k: v.clone() for k, v in model.state_dict().items()}
            with guard.autocast():
                loss = _loss(model, _batch(i))
            rec.observe_loss(loss)
            guard.backward(loss)
            guard.step()
    (event,) = ag.triage(
        guard,
        recorder=rec,
        loss_fn=_loss,
        batch=_batch(1),
        restore=lambda s: model.load_state_dict(snaps[s]),
    )
    assert (event.step, event.cause, event.module) == (1, "transient_fault", "4")


def test_bad_input() -> None:
    guard, rec, _ = _run(_mlp(), steps=2)
    with pytest.raises(ValueError, match="create the Guard with signatures=True"):
        ag.triage(guard)
    with pytest.raises(TypeError, match="recorder must be a SignatureRecorder"):
        ag.triage(guard, recorder=object())
    with pytest.raises(ValueError, match=r"step=9 is not recorded"):
        ag.triage(guard, recorder=rec, step=9)
    model = _mlp()
    g2 = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    r2 = ag.SignatureRecorder(model, clock=lambda: g2.steps)
    for i in range(3):
        with g2.autocast():
            loss = _loss(model, _batch(i))
        g2.backward(loss)
        g2.step()
    with pytest.raises(ValueError, match="cannot replay step 0: it needs the batch of step 0"):
        ag.triage(g2, recorder=r2, step=0)


def test_events_are_written_to_the_run_folder_and_listed_by_postmortem(tmp_path, capsys) -> None:
    from ampguard.cli._main import main

    run = tmp_path / "run"
    model = _mlp()
    plant = _fault(module="4", bit="exponent_top", persistent=True)
    guard, rec, _ = _run(model, fault=plant, telemetry=str(run))
    (event,) = ag.triage(guard, recorder=rec)
    guard.close()
    assert (run / "triage" / "rank0.json").is_file()
    assert main(["postmortem", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        "triage (step 2, rank 0): persistent_fault at module '4' op aten.addmm in forward [AG383]"
        in out
    )
    (run / "triage" / "rank0.json").write_text("{}", encoding="utf-8")
    assert main(["postmortem", str(run)]) == 2  # a corrupt triage file: one clear error
    assert "not an ampguard triage file" in capsys.readouterr().err


def test_guard_signatures_is_the_default_recorder() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1, signatures=1)
    assert isinstance(guard.signatures, ag.SignatureRecorder)
    with inject_fault(model, module="4", step=2, guard=guard, element=5):
        for i in range(3):
            b = _batch(i)
            with guard.autocast():
                loss = _loss(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=_loss)
    (event,) = ag.triage(guard)
    assert (event.step, event.cause, event.module) == (2, "transient_fault", "4")
    with pytest.raises(ValueError, match="signatures must be True"):
        ag.Guard(model, opt, precision="bf16", signatures=0)


def _recorded(model, loss_fn, batch, precision, scale):
    """One run of ``batch`` with signatures recorded; the model's state is put back."""
    from ampguard.replay import Preserved

    keep = Preserved(model)
    rec = ag.SignatureRecorder(model, capacity=1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn(model, batch)
    (loss.float() * scale).backward()
    rec.remove()
    sig = rec.read(rec.steps[-1])
    keep.close()
    return sig


def test_silent_fp16_underflow_is_numerics() -> None:
    """Nothing goes non-finite (no scaler: the gradients flush to zero in fp16): the step is
    still a numerics failure, read from the fp32 replay, not model or data."""
    from ampguard.forensics import triage_step

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]).float(), b[1]) * 1e-3

    sig = _recorded(model, loss_fn, batch, "fp16", 1.0)
    assert not sig.bad
    event = triage_step(model, loss_fn, batch, sig, precision="fp16", scale=1.0)
    assert event.cause == "numerics", event
    assert event.diagnosis is not None and event.diagnosis.kind == "fp16_underflow"


def test_silent_bf16_stagnation_with_optimizer_is_numerics() -> None:
    """bf16 weights whose Adam updates round away: finite everywhere, numerics (the optimizer's
    precision), found with the optimizer passed."""
    from ampguard.forensics import triage_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(4.0)
        model[2].weight.mul_(0.05)
    model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0].to(torch.bfloat16)).float(), b[1])

    sig = _recorded(model, loss_fn, batch, "bf16", 1.0)
    event = triage_step(model, loss_fn, batch, sig, precision="bf16", optimizer=opt)
    assert event.cause == "numerics", event
    assert event.diagnosis is not None and event.diagnosis.kind == "precision_stagnation"


def test_a_healthy_step_named_by_hand_is_not_numerics_nor_a_fault() -> None:
    from ampguard.forensics import triage_step

    model = _mlp()
    b = _batch(0)
    sig = _recorded(model, _loss, b, "bf16", 1.0)
    event = triage_step(model, _loss, b, sig, precision="bf16")
    assert event.cause == "model_or_data" and event.diagnosis is None


def _guarded(model, signatures, steps, fault=None, precision="bf16"):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision=precision, snapshot_every=1, signatures=signatures)
    inj = fault(model, guard) if fault is not None else None
    for i in range(steps):
        b = _batch(i)
        with guard.autocast():
            loss = _loss(model, b)
        guard.backward(loss)
        guard.step(batch=b, loss_fn=_loss)
    return guard, inj


def test_signatures_true_samples_and_a_sampled_out_step_is_compared_on_its_loss() -> None:
    """signatures=True records one window in 32; a fault on another window is still found
    (its replay's loss differs from the flight recorder's), with no module named."""
    from ampguard.guard._signatures import DEFAULT_EVERY

    model = _mlp()
    guard, inj = _guarded(model, True, 3, _fault(module="4", bit="exponent_top"))
    assert guard.signatures.every == DEFAULT_EVERY == 32 and guard.signatures.steps == [0]
    (event,) = ag.triage(guard, step=2)
    inj.remove()
    assert inj.fired_at == [2]
    assert (event.step, event.cause, event.module) == (2, "transient_fault", None)
    assert "sampled out" in event.evidence["first_difference"]


def test_a_sampled_out_clean_step_replays_equal_even_with_dropout() -> None:
    """The RNG state of every step is kept, so a dropout model's unrecorded step replays the
    same masks and the same loss: no fault verdict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 4))
    guard, _ = _guarded(model, True, 3)
    (event,) = ag.triage(guard, step=2)
    assert event.cause not in ("transient_fault", "persistent_fault"), event
    assert event.evidence["reproduced"] is True


def test_triage_events_are_guard_findings_also_after_close(tmp_path) -> None:
    from ampguard.cli import main

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(
        model,
        opt,
        precision="bf16",
        snapshot_every=1,
        signatures=1,
        telemetry=str(tmp_path / "run"),
    )
    with inject_fault(model, module="4", step=2, guard=guard, element=5):
        for i in range(3):
            b = _batch(i)
            with guard.autocast():
                loss = _loss(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=_loss)
    assert not [f for f in guard.findings() if f.code.startswith("AG38")]
    (event,) = ag.triage(guard)
    found = [f for f in guard.findings() if f.code.startswith("AG38")]
    assert [(f.code, f.step) for f in found] == [("AG382", 2)]
    guard.close()
    assert [f.code for f in guard.findings() if f.code.startswith("AG38")] == ["AG382"]
    assert main(["postmortem", str(tmp_path / "run")]) == 0


def test_triage_findings_without_telemetry() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1, signatures=1)
    with inject_fault(model, module="4", step=1, guard=guard, element=5):
        for i in range(2):
            b = _batch(i)
            with guard.autocast():
                loss = _loss(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=_loss)
    ag.triage(guard)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [f.code for f in guard.findings()] == ["AG382"]


class _Tied(nn.Module):
    """An embedding and a head sharing one weight (as GPT-2's wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def test_a_tied_weight_is_not_a_persistent_fault() -> None:
    """The head's weight gradient also holds the embedding's: the reference of the head alone
    differs from it, and that is no fault (found on HF GPT-2's tied wte/lm_head)."""
    from ampguard.forensics import triage_step

    model = _Tied()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]).float().flatten(0, 1), b[0].flatten())

    sig = _recorded(model, loss_fn, (ids,), "bf16", 1.0)
    event = triage_step(model, loss_fn, (ids,), sig, precision="bf16")
    assert event.cause not in ("transient_fault", "persistent_fault"), event


def test_a_window_accumulated_over_micro_batches_is_not_replayed_as_one_step() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = ag.Guard(model, opt, precision="bf16", snapshot_every=1, accumulation_steps=2)
    rec = ag.SignatureRecorder(model, clock=lambda: guard.steps)
    for i in range(4):  # two windows of two micro-batches
        b = _batch(i)
        with guard.autocast():
            loss = _loss(model, b)
        guard.backward(loss)
        guard.step(batch=b, loss_fn=_loss)
    assert len(guard.flight_recorder.batches[2]) == 2  # the last window's micro-batches
    with pytest.raises(ValueError, match="the batch of step 1"):
        ag.triage(guard, recorder=rec, step=1)
