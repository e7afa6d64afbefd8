"""ResumeWarmup: an LR ramp only after a resume with a real scale gap, composing with schedulers."""

import warnings

import pytest
import torch

import ampguard as ag


def _setup(warmup=None, lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    guard = ag.Guard(model, opt, precision="fp16", schedulers=[sched], resume_warmup=warmup)
    return model, opt, sched, guard


def _train(model, opt, guard, steps, seen=None):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        with guard.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        if seen is not None:
            seen.append(opt.param_groups[0]["lr"])
        guard.step()


def _lr_spy(opt, seen):
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["lr"]))


def _resume_plain(path, warmup):
    model, opt, sched, guard = _setup(warmup)
    with pytest.warns(RuntimeWarning, match="restarts at init_scale"):
        ag.load_checkpoint(path, model=model, optimizer=opt, guard=guard)
    seen = []
    _lr_spy(opt, seen)
    _train(model, opt, guard, 6)
    return guard, seen


def test_scale_reset_on_resume_ramps_lr_from_factor_to_one(tmp_path):
    model, opt, _, guard = _setup()
    _train(model, opt, guard, 4)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "plain.pt")
    _, base = _resume_plain(tmp_path / "plain.pt", None)
    guard, seen = _resume_plain(tmp_path / "plain.pt", ag.ResumeWarmup(steps=4, lr_factor=0.25))
    assert guard.resume["warmup"] is True
    factors = [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0]
    assert seen == pytest.approx([b * f for b, f in zip(base, factors, strict=True)], rel=1e-12)
    assert seen[4:] == base[4:]  # bitwise back to the scheduler's values


def test_lrs_return_bitwise_to_the_scheduler_after_the_ramp():
    model, opt, sched, guard = _setup(ag.ResumeWarmup(steps=3, lr_factor=0.1))
    guard._mark_resume(scale_reset=True)
    ref_model, ref_opt, ref_sched, ref_guard = _setup()
    _train(model, opt, guard, 5)
    _train(ref_model, ref_opt, ref_guard, 5)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    assert guard.diagnostics()["resume_warmup_active"] is False


def test_large_gap_to_previous_scale_starts_the_ramp():
    model, opt, _, guard = _setup(ag.ResumeWarmup(steps=2, lr_factor=0.5, min_gap_bits=4))
    gap = guard.check_resume(previous_scale=2.0**10)  # resumed at 2**16: six powers of two
    assert gap == 6.0
    assert guard.resume["warmup"] is True
    seen = []
    _lr_spy(opt, seen)
    _train(model, opt, guard, 3)
    assert seen == pytest.approx([0.05, 0.075, 0.1], rel=1e-12)


def test_small_gap_changes_nothing_bitwise():
    model, opt, _, guard = _setup(ag.ResumeWarmup(steps=5, lr_factor=0.1, min_gap_bits=4))
    ref_model, ref_opt, _, ref_guard = _setup()
    assert guard.check_resume(previous_scale=2.0**15) == 1.0
    assert guard.resume["warmup"] is False
    _train(model, opt, guard, 6)
    _train(ref_model, ref_opt, ref_guard, 6)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_with_guard_state_does_not_ramp(tmp_path):
    model, opt, sched, guard = _setup()
    _train(model, opt, guard, 3)
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, guard=guard, scheduler=sched)
    model2, opt2, sched2, guard2 = _setup(ag.ResumeWarmup())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ag.load_checkpoint(
            tmp_path / "c.pt", model=model2, optimizer=opt2, guard=guard2, scheduler=sched2
        )
    assert guard2.resume["scale_reset"] is False
    assert guard2.resume["warmup"] is False


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"steps": 0}, "steps"),
        ({"lr_factor": 0.0}, "lr_factor"),
        ({"lr_factor": 1.5}, "lr_factor"),
        ({"min_gap_bits": 0}, "min_gap_bits"),
    ],
)
def test_bad_warmup_config_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ag.ResumeWarmup(**kwargs)


def test_resume_warmup_must_be_a_resume_warmup():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="resume_warmup"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), resume_warmup=0.1)
