"""Review of the core training step: containment without a scaler, exceptions inside the step,
and their interplay with the other features. Real torch on CPU, tiny models."""

import pytest
import torch
import torch.nn.functional as F
from _models import batch, make_model
from _precisions import plain
from torch import nn

import ampguard as ag

NAN = float("nan")


def micro(guard: ag.Guard, model: nn.Module, i: int, bad: bool = False) -> ag.StepResult:
    x, y = batch(i, bad)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    return guard.step()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------- containment, no scaler
@pytest.mark.parametrize("precision", plain(scaled=False))
def test_containment_without_scaler_skips_a_window_whose_microbatches_all_dropped(precision):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = ag.Guard(
        model, opt, precision=precision, accumulation_steps=2, contain_nonfinite_microbatches=True
    )
    for i in range(2):  # one good window: momentum buffers exist, a zero-grad step would move
        micro(guard, model, i)
    before = params_of(model)
    result = [micro(guard, model, i, bad=True) for i in range(2, 4)][-1]
    # no scaler: the skip's cause is non-finite gradients, not an fp16 overflow
    assert (result.applied, result.overflow, result.nonfinite, result.dropped_microbatches) == (
        False,
        False,
        True,
        2,
    )
    for a, b in zip(params_of(model), before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", plain(scaled=False))
def test_containment_without_scaler_counts_dropped_microbatches(precision):
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision=precision,
        accumulation_steps=2,
        contain_nonfinite_microbatches=True,
    )
    result = [micro(guard, model, i, bad=i == 0) for i in range(2)][-1]
    assert (result.applied, result.dropped_microbatches) == (True, 1)
    assert guard.diagnostics()["microbatches_dropped"] == 1


# ---------------------------------------------------------------------- exceptions in the step
class FailsOnce:
    """Mixin for a real optimizer whose next ``step`` raises once when ``fail`` is set (e.g. a
    transient OOM)."""

    fail = False

    def step(self, closure=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("transient failure inside optimizer.step")
        return super().step(closure)


class FlakySGD(FailsOnce, torch.optim.SGD):
    """SGD that fails once on demand."""


def failed_window(precision: str) -> tuple[ag.Guard, nn.Module]:
    model = make_model()
    opt = FlakySGD(model.parameters(), lr=1.0)
    guard = ag.Guard(model, opt, precision=precision)
    opt.fail = True
    with pytest.raises(RuntimeError, match="transient failure"):
        micro(guard, model, 0)
    return guard, model


@pytest.mark.parametrize("precision", plain())
def test_an_exception_inside_optimizer_step_leaves_no_gradients_behind(precision):
    _, model = failed_window(precision)
    assert all(p.grad is None for p in model.parameters())


def test_the_window_after_a_failed_step_updates_with_its_own_gradients_only():
    guard, model = failed_window("fp32")
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    x, y = batch(1)
    F.mse_loss(ref(x), y).backward()
    before = params_of(model)
    assert micro(guard, model, 1).applied
    for b, a, r in zip(before, params_of(model), ref.parameters(), strict=True):
        torch.testing.assert_close(b - a, r.grad)  # SGD lr=1: delta = this window's gradient


# ------------------------------------------------------------ clipping, several optimizers
@pytest.mark.parametrize("fused", [False, True])
def test_clipping_still_binds_the_optimizer_that_steps_when_another_overflowed(fused):
    model = make_model()
    opts = [
        torch.optim.SGD(model[0].parameters(), lr=1.0, fused=fused),
        torch.optim.SGD(model[2].parameters(), lr=1.0, fused=fused),
    ]
    guard = ag.Guard(model, opts, precision="fp16", clip_grad_norm=1e-3)
    before = params_of(model[0])
    x, y = batch(0)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    model[2].weight.grad.view(-1)[0] = float("inf")
    assert guard.step().optimizers_applied == (True, False)
    delta = torch.cat(
        [(b - a).flatten() for b, a in zip(before, model[0].parameters(), strict=True)]
    )
    assert 0 < torch.linalg.vector_norm(delta).item() <= 1e-3 * (1 + 1e-3)  # SGD lr=1


# ---------------------------------------------------------------------- state round trip
def test_state_round_trip_keeps_the_scale_history_and_its_change_count():
    model = make_model()
    cfg = ag.ScalerConfig(growth_interval=2)
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16", scaler=cfg
    )
    for i in range(7):  # growth at 2, 4, 6 and a backoff at 5: the scale changes often
        x, y = batch(i)
        with guard.autocast():
            loss = F.mse_loss(model(x).float(), y)
        guard.backward(loss)
        if i == 4:
            model[2].weight.grad.view(-1)[0] = float("inf")
        guard.step()
    fresh_model = make_model()
    fresh = ag.Guard(
        fresh_model,
        torch.optim.SGD(fresh_model.parameters(), lr=0.05),
        precision="fp16",
        scaler=cfg,
    )
    fresh.load_state_dict(guard.state_dict())
    before, after = guard.diagnostics(), fresh.diagnostics()
    assert before["scale_changes"] >= 3
    assert (after["scale_changes"], after["last_scales"]) == (
        before["scale_changes"],
        before["last_scales"],
    )


def test_adopting_a_torch_grad_scaler_state_starts_the_scale_history_at_its_scale(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
        tmp_path / "plain.pt",
    )
    guard = ag.Guard(model, opt, precision="fp16")
    with pytest.warns(RuntimeWarning, match="adopted the torch GradScaler state"):
        ag.load_checkpoint(tmp_path / "plain.pt", model=model, optimizer=opt, guard=guard)
    assert micro(guard, model, 0).applied
    diag = guard.diagnostics()
    assert diag["scale"] == 1024.0
    assert diag["scale_changes"] == 0  # the scale never changed after the resume
    assert {s["scale"] for s in diag["last_scales"]} == {1024.0}


def test_an_in_window_result_has_one_flag_per_optimizer():
    model = make_model()
    opts = [
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    ]
    guard = ag.Guard(model, opts, precision="fp16", accumulation_steps=2)
    assert micro(guard, model, 0).optimizers_applied == (False, False)


@pytest.mark.parametrize("contain", [False, True])
def test_loading_state_mid_window_drops_the_half_window_gradients(contain):
    def make(seed_model):
        model = make_model()
        model.load_state_dict(seed_model.state_dict())
        guard = ag.Guard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            precision="fp16",
            accumulation_steps=2,
            contain_nonfinite_microbatches=contain,
        )
        return guard, model

    base = make_model()
    saved = make(base)[0].state_dict()
    guard, model = make(base)
    micro(guard, model, 7)  # half a window, then a rollback to the saved state
    guard.load_state_dict(saved)
    ref_guard, ref_model = make(base)
    ref_guard.load_state_dict(saved)
    for i in range(2):
        micro(guard, model, i)
        micro(ref_guard, ref_model, i)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_pending_fused_result_stays_readable_after_load_state_dict():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = ag.Guard(model, opt, precision="fp16")
    saved = guard.state_dict()
    result = micro(guard, model, 0)  # flags still on the device
    guard.load_state_dict(saved)  # a rollback
    assert (result.applied, result.overflow) == (True, False)
    assert guard.diagnostics()["applied_steps"] == 0  # the loaded counters, not the dropped step


# -------------------------------------------------------------- telemetry of aborted windows
class FlakyFusedAdamW(FailsOnce, torch.optim.AdamW):
    """AdamW (built fused by the tests) that fails once on demand."""


def recorded_losses(run_dir) -> list[float]:
    from ampguard import runlog

    return [float(v) for v in runlog.load_run(run_dir).loss]


def test_telemetry_loss_of_the_window_after_a_failed_step_is_its_own(tmp_path):
    model = make_model()
    opt = FlakyFusedAdamW(model.parameters(), lr=1e-3, fused=True)
    guard = ag.Guard(model, opt, precision="fp16", telemetry=ag.Telemetry(tmp_path))
    opt.fail = True
    with pytest.raises(RuntimeError, match="transient failure"):
        micro(guard, model, 0)
    x, y = batch(1)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()
    guard.close()
    assert recorded_losses(tmp_path)[-1] == pytest.approx(loss.item(), rel=1e-6)


def test_telemetry_loss_after_a_mid_window_load_is_the_new_windows_own(tmp_path):
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        accumulation_steps=2,
        telemetry=ag.Telemetry(tmp_path),
    )
    saved = guard.state_dict()
    micro(guard, model, 0)  # half a window, then a rollback
    guard.load_state_dict(saved)
    losses = []
    for i in (1, 2):
        x, y = batch(i)
        with guard.autocast():
            loss = F.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        guard.backward(loss)
        guard.step()
    guard.close()
    assert recorded_losses(tmp_path)[-1] == pytest.approx(sum(losses) / 2, rel=1e-6)


# ---------------------------------------------------------------------- fallback mid-window
def test_a_fallback_acted_on_mid_window_unscales_the_windows_gradients():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, fused=True)
    guard = ag.Guard(
        model,
        opt,
        precision="fp16",
        scaler=ag.ScalerConfig(init_scale=128.0, min_scale=128.0, on_collapse="fallback"),
    )
    x, y = batch(0)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    model[2].weight.grad.view(-1)[0] = float("inf")
    guard.step()  # collapse at min_scale; a fused step's flags are read lazily
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    x, y = batch(1)
    with torch.autocast("cpu", dtype=torch.float16):
        F.mse_loss(ref(x).float(), y).backward()
    before = params_of(model)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)  # scaled by 128
    with pytest.warns(RuntimeWarning, match="switched precision"):
        assert guard.scale == 1.0  # reading the scale mid-window acts on the collapse
    assert guard.step().applied
    for b, a, r in zip(before, params_of(model), ref.parameters(), strict=True):
        torch.testing.assert_close(b - a, r.grad, rtol=1e-2, atol=1e-5)  # SGD lr=1


def test_close_still_closes_telemetry_when_a_pending_collapse_raises(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = ag.Guard(
        model,
        opt,
        precision="fp16",
        telemetry=ag.Telemetry(tmp_path),
        scaler=ag.ScalerConfig(init_scale=1.0),
    )  # on_collapse="raise"
    x, y = batch(0)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    model[2].weight.grad.view(-1)[0] = float("inf")
    guard.step()  # collapse at min_scale, flags pending on the device
    with pytest.raises(ag.ScaleCollapseError):
        guard.close()
    assert guard.telemetry.closed
    assert (tmp_path / "findings.json").exists()


def test_collapse_warn_with_a_fused_optimizer_warns_for_each_episode():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = ag.Guard(
        model, opt, precision="fp16", scaler=ag.ScalerConfig(init_scale=1.0, on_collapse="warn")
    )

    def window(i: int, overflow: bool) -> None:
        x, y = batch(i)
        with guard.autocast():
            loss = F.mse_loss(model(x).float(), y)
        guard.backward(loss)
        if overflow:
            model[2].weight.grad.view(-1)[0] = float("inf")
        guard.step()

    with pytest.warns(RuntimeWarning, match="collapsed at step 1"):
        window(1, True)  # episode 1: collapse ...
        window(2, False)  # ... ended by an applied step, both settled by one read
        assert guard.skipped_steps == 1
    with pytest.warns(RuntimeWarning, match="collapsed at step 3"):
        window(3, True)  # episode 2
        assert guard.skipped_steps == 2
