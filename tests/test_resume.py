"""Resume edge cases: a plain checkpoint restarts the scale, a running LR ramp survives a save,
and a dropped micro-batch at the floor is no collapse when the window still updates."""

import warnings

import pytest
import torch
from _models import small_mlp, train_steps

import ampguard as ag


def _setup(warmup=None, **kwargs):
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, ag.Guard(model, opt, precision="fp16", resume_warmup=warmup, **kwargs)


def test_plain_checkpoint_into_a_trained_guard_restarts_the_scale(tmp_path):
    model, opt, guard = _setup(scaler=ag.ScalerConfig(init_scale=1024.0))
    train_steps(model, guard, 3, bad={1, 2})
    assert guard.scale == 256.0
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "p.pt")
    with pytest.warns(RuntimeWarning, match="restarts at init_scale=1024"):
        ag.load_checkpoint(tmp_path / "p.pt", model=model, optimizer=opt, guard=guard)
    assert guard.scale == 1024.0  # what the warning says
    assert guard.resume["scale_reset"] is True


def test_plain_checkpoint_into_a_bf16_guard_does_not_warn_about_a_scale(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="bf16")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "p.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ag.load_checkpoint(tmp_path / "p.pt", model=model, optimizer=opt, guard=guard)
    assert guard.resume["scale_reset"] is False


def test_a_running_warmup_ramp_survives_save_and_resume(tmp_path):
    warmup = ag.ResumeWarmup(steps=6, lr_factor=0.25)
    model, opt, guard = _setup(warmup)
    guard.restart_scale()  # as after a plain checkpoint: the ramp starts
    train_steps(model, guard, 2)
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, guard=guard)
    seen_uninterrupted = []
    opt.register_step_pre_hook(lambda o, a, k: seen_uninterrupted.append(o.param_groups[0]["lr"]))
    train_steps(model, guard, 3)

    model2, opt2, guard2 = _setup(warmup)
    ag.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, guard=guard2)
    seen_resumed = []
    opt2.register_step_pre_hook(lambda o, a, k: seen_resumed.append(o.param_groups[0]["lr"]))
    train_steps(model2, guard2, 3)
    assert seen_resumed == seen_uninterrupted  # the ramp goes on where it was
    assert seen_resumed[0] < 0.1


def test_dropped_microbatch_at_the_floor_is_no_collapse_when_the_window_updates():
    model, _, guard = _setup(
        scaler=ag.ScalerConfig(init_scale=1.0, min_scale=1.0),
        accumulation_steps=2,
        contain_nonfinite_microbatches=True,
    )
    for micro in range(2):  # one bad micro-batch, one good: the window applies
        with guard.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        if micro == 0:
            loss = loss * float("nan")  # every gradient of this micro-batch is NaN
        guard.backward(loss)
        result = guard.step()
    assert result.applied and result.dropped_microbatches == 1
    assert guard.diagnostics()["skipped_by_cause"]["collapse"] == 0
