"""A skipped step leaves no trace in the buffers: a BatchNorm whose fp16 forward
overflowed keeps the statistics it had before the window; an applied window keeps its update.
Real fp16 autocast on CPU, real BatchNorm, real optimizers (fused and not)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.testing import SyncCounter

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}


def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def batch(i: int, huge: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
    if huge:  # finite in fp32, beyond 65504 after the first Linear in fp16
        x = x * 3e5
    return x, y


def run_step(guard: ag.Guard, model: nn.Module, i: int, huge: bool = False) -> ag.StepResult:
    x, y = batch(i, huge)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    return guard.step()


def bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model[1].named_buffers()}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_skipped_fp16_window_leaves_batchnorm_stats_as_before(opt):
    model = bn_model()
    guard = ag.Guard(model, OPTIMIZERS[opt](model.parameters()), precision="fp16")
    run_step(guard, model, 0)
    before = bn_state(model)
    result = run_step(guard, model, 1, huge=True)
    assert result.overflow and not result.applied
    after = bn_state(model)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    model.eval()
    assert torch.isfinite(model(batch(2)[0])).all()  # eval is not NaN


def test_opt_out_keeps_the_poisoned_statistics():
    model = bn_model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), "fp16", restore_buffers_on_skip=False
    )
    run_step(guard, model, 0)
    result = run_step(guard, model, 1, huge=True)
    assert not result.applied
    assert not torch.isfinite(model[1].running_var).all()  # what the default prevents
    model.eval()
    assert not torch.isfinite(model(batch(2)[0])).all()


def test_applied_window_keeps_its_buffer_update_bitwise():
    model = bn_model()
    plain = copy.deepcopy(model)
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16")
    run_step(guard, model, 0)
    with torch.autocast("cpu", dtype=torch.float16):
        plain(batch(0)[0])
    for key, value in bn_state(plain).items():
        assert torch.equal(bn_state(model)[key], value), key
    assert int(model[1].num_batches_tracked) == 1


def test_bf16_nonfinite_skip_restores_and_accumulation_snapshots_the_first_forward():
    model = bn_model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), "bf16", accumulation_steps=2
    )
    before = bn_state(model)
    x, y = batch(0)
    for xs in (x, x.clone().fill_(float("nan"))):  # the 2nd micro-batch is NaN
        with guard.autocast():
            loss = F.mse_loss(model(xs).float(), y)
        guard.backward(loss)
        result = guard.step()
    assert result.nonfinite and not result.applied
    for key, value in before.items():  # both micro-batches' updates are undone
        assert torch.equal(bn_state(model)[key], value), key


def test_fused_restore_costs_no_host_sync():
    model = bn_model()
    guard = ag.Guard(model, torch.optim.Adam(model.parameters(), fused=True), precision="fp16")
    run_step(guard, model, 0)
    x, y = batch(1, huge=True)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    with SyncCounter() as syncs:
        guard.step()
    assert syncs.count == 0
    assert torch.isfinite(model[1].running_var).all()


def test_a_model_without_buffers_pays_nothing_and_the_flag_is_validated():
    model = nn.Linear(4, 4)
    assert ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1)).restore_buffers_on_skip
    with pytest.raises(TypeError, match="restore_buffers_on_skip"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), restore_buffers_on_skip=1)


def test_a_dropped_microbatch_forward_is_undone_under_containment():
    model = bn_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        "fp16",
        accumulation_steps=2,
        contain_nonfinite_microbatches=True,
    )
    reference = copy.deepcopy(model)
    x, y = batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        reference(x)  # only the good micro-batch's statistics
    for xs in (x, batch(1, huge=True)[0]):  # the 2nd micro-batch overflows and is dropped
        with guard.autocast():
            loss = F.mse_loss(model(xs).float(), y)
        guard.backward(loss)
        result = guard.step()
    assert result.applied and result.dropped_microbatches == 1
    for key, value in bn_state(reference).items():
        assert torch.equal(bn_state(model)[key], value), key


def _nan_window(guard: ag.Guard, model: nn.Module) -> ag.StepResult:
    x, y = batch(3)
    with guard.autocast():
        loss = F.mse_loss(model(x.fill_(float("nan"))).float(), y)
    guard.backward(loss)
    return guard.step()


def test_buffers_replaced_after_the_guard_was_built_are_followed():
    model = bn_model()
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), "bf16")
    run_step(guard, model, 0)
    model[1].running_mean = torch.full((16,), 0.5)  # a new tensor object under the same name
    model[1].running_var = torch.full((16,), 2.0)
    before = bn_state(model)
    assert not _nan_window(guard, model).applied
    for key, value in before.items():
        assert torch.equal(bn_state(model)[key], value), key


def test_model_double_then_float_after_the_guard_is_followed():
    model = bn_model()
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), "bf16")
    run_step(guard, model, 0)
    model.double().float()  # every buffer is a new tensor now
    before = bn_state(model)
    assert not _nan_window(guard, model).applied
    for key, value in before.items():
        assert torch.equal(bn_state(model)[key], value), key
    assert torch.isfinite(model[1].running_var).all()


def test_a_buffer_registered_on_a_model_that_had_none_is_followed():
    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            out = self.lin(x)
            if hasattr(self, "ema"):
                self.ema.mul_(0.9).add_(out.detach().float().mean() * 0.1)
            return out

    torch.manual_seed(0)
    model = Ema()
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), "bf16")
    run_step(guard, model, 0)
    model.register_buffer("ema", torch.zeros(()).reshape(1))
    run_step(guard, model, 1)
    before = model.ema.clone()
    assert torch.isfinite(before).all() and before.item() != 0
    assert not _nan_window(guard, model).applied
    assert torch.equal(model.ema, before)
