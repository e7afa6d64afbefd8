"""locate's optimizer phase and poisoned buffers: a .half() model whose
Adam eps underflows, bf16 weights whose updates round away, BatchNorm statistics poisoned by
this batch's fp16 forward vs state broken before the step. Real fp16/bf16 weights, real Adam,
real BatchNorm, CPU autocast."""

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag


def mse(model: nn.Module, batch):
    x, y = batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(4.0)  # |w| up to ~1: a bf16 spacing of 2**-8 there
    return model.to(dtype)


def data(n: int = 16, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=gen), torch.randn(n, 4, generator=gen)


def raw_adam_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        mse(model, data(seed=i)).backward()
        opt.step()


# ---------------------------------------------------------------------- eps underflow
def test_half_model_whose_adam_eps_underflows_is_phase_optimizer():
    model = mlp(torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8: 0 in fp16
    raw_adam_steps(model, opt, 2)
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # really broken
    d = ag.locate(model, mse, data(), "fp16", optimizer=opt)
    assert (d.kind, d.phase, d.code) == ("eps_underflow", "optimizer", "AG366")
    assert d.stats["eps_underflow"][0] == {"group": 0, "eps": 1e-8, "dtype": "fp16"}
    assert "eps=1e-4" in d.explain() and "master weights" in d.to_finding().fix


def test_broken_weights_without_the_optimizer_are_still_phase_optimizer():
    model = mlp(torch.float16)
    raw_adam_steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), 2)
    d = ag.locate(model, mse, data(), "fp16")
    assert (d.kind, d.phase) == ("model_nonfinite", "optimizer")
    assert "optimizer=" in d.explain()


def test_finite_half_model_with_underflowing_eps_is_named_before_it_breaks():
    model = mlp(torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.clone() for p in model.parameters()]
    d = ag.locate(model, mse, data(), "fp16", optimizer=opt)
    assert (d.kind, d.phase) == ("eps_underflow", "optimizer")
    assert d.stats["nonfinite_after_step"]  # the one real step wrote inf/NaN ...
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert not opt.state  # ... and locate put the weights and the optimizer back


def test_half_model_with_an_eps_fp16_holds_is_silent():
    model = mlp(torch.float16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    d = ag.locate(model, mse, data(), "fp16", optimizer=opt)
    assert d.kind == "none", d.explain()


# ---------------------------------------------------------------------- stagnation
def test_bf16_weights_whose_updates_round_away_are_precision_stagnation():
    model = mlp(torch.bfloat16)
    d = ag.locate(model, mse, data(), "bf16", optimizer=torch.optim.Adam(model.parameters(), 1e-5))
    assert (d.kind, d.phase, d.code) == ("precision_stagnation", "optimizer", "AG365")
    assert d.stats["layers"]["0"] >= 0.9 and d.module in d.stats["layers"]  # the worst layer
    assert "bf16_stochastic_round" in d.to_finding().fix


def test_bf16_weights_with_updates_that_fit_and_fp32_weights_are_silent():
    model = mlp(torch.bfloat16)
    d = ag.locate(model, mse, data(), "bf16", optimizer=torch.optim.Adam(model.parameters(), 5e-2))
    assert d.kind == "none", d.explain()
    fp32 = mlp(torch.float32)
    d = ag.locate(fp32, mse, data(), "bf16", optimizer=torch.optim.Adam(fp32.parameters(), 1e-5))
    assert d.kind == "none"


def test_optimizer_argument_is_validated():
    model = mlp(torch.float32)
    try:
        ag.locate(model, mse, data(), "bf16", optimizer="adam")
    except TypeError as err:
        assert "optimizer must be a torch.optim.Optimizer" in str(err)
    else:
        raise AssertionError("no TypeError")


# ---------------------------------------------------------------------- poisoned buffers
def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def huge() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    return x * 3e5, y  # finite in fp32, beyond 65504 after the first Linear in fp16


def poisoned_by_a_skipped_step() -> nn.Sequential:
    model = bn_model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), "fp16", restore_buffers_on_skip=False
    )
    with guard.autocast():
        loss = mse(model, huge())
    guard.backward(loss)
    assert not guard.step().applied
    assert not torch.isfinite(model[1].running_mean).all()
    return model


def test_buffers_poisoned_by_this_batch_are_an_fp16_overflow_not_a_model_bug():
    d = ag.locate(poisoned_by_a_skipped_step(), mse, huge())
    assert (d.kind, d.phase, d.module) == ("fp16_overflow", "forward", "0")
    assert "1.running_mean" in d.stats["poisoned_buffers"]
    assert "restore_buffers_on_skip" in d.explain()


def test_buffers_broken_before_the_step_say_so():
    d = ag.locate(poisoned_by_a_skipped_step(), mse, data())  # a clean batch
    assert (d.kind, d.phase) == ("model_nonfinite", None)
    assert d.stats["broken_before_step"] is True
    assert "broken before this step" in d.explain()
    assert "reset_running_stats" in d.to_finding().fix


def test_auto_fallback_is_no_longer_blocked_by_poisoned_buffers():
    for restore in (True, False):
        model = bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guard = ag.Guard(model, opt, "fp16", auto_fallback=True, restore_buffers_on_skip=restore)
        for batch in (data(), huge()):
            with guard.autocast():
                loss = mse(model, batch)
            guard.backward(loss)
            guard.step(batch=batch, loss_fn=mse)
        assert [c["module"] for c in guard.diagnostics()["fallbacks"]] == ["0"], restore
