"""Non-finite gradients never reach the weights in any precision, the
bound on non-finite skips, misuse errors, ScalerConfig validation, non-finite loss records.
Real bf16/fp16 autocast on CPU, real AdamW (plain and fused), real run folders."""

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _precisions import plain
from torch import nn

import ampguard as ag
from ampguard import runlog

NAN, INF = float("nan"), float("inf")
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(i: int, bad: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    if bad is not None:
        x[0, 0] = bad  # a corrupt sample: the loss and every gradient become non-finite
    return x, y


def step(guard: ag.Guard, model: nn.Module, i: int, bad: float | None = None, **kw):
    x, y = batch(i, bad)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    return guard.step(**kw)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---------------------------------------------------------------------- item 2: bf16 / fp32 skip
@pytest.mark.parametrize("precision", plain(scaled=False))
@pytest.mark.parametrize("opt_name", ["adamw", "adamw_fused"])
def test_a_nonfinite_window_is_skipped_and_matches_a_loop_without_that_batch(precision, opt_name):
    ref_model = make_model()
    ref = ag.Guard(
        ref_model,
        OPTIMIZERS[opt_name](ref_model.parameters()),
        precision=precision,
        clip_grad_norm=1.0,
    )
    for i in (0, 2):  # the same run without the bad batch
        step(ref, ref_model, i)
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    guard = ag.Guard(model, opt, precision=precision, clip_grad_norm=1.0)
    step(guard, model, 0)
    before = params(model)
    bad = step(guard, model, 1, bad=NAN)
    assert (bad.applied, bad.overflow, bad.nonfinite, bad.skip_cause) == (
        False,
        False,
        True,
        "nonfinite",
    )
    assert same(params(model), before)
    assert all(int(s["step"]) == 1 for s in opt.state.values())  # no optimizer step counted
    good = step(guard, model, 2)
    assert (good.applied, good.nonfinite, good.skip_cause) == (True, False, None)
    assert same(params(model), params(ref_model))  # bitwise: as if the batch never came
    assert guard.skipped_steps == 1
    assert guard.diagnostics()["skipped_by_cause"] == {
        "overflow": 0,
        "collapse": 0,
        "nonfinite": 1,
        "nonfinite_forward": 0,
    }


@pytest.mark.parametrize("value", [INF, -INF, NAN])
def test_inf_gradients_are_skipped_too(value):
    model = make_model()
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    x, y = batch(0)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    model[2].weight.grad.view(-1)[0] = value
    before = params(model)
    assert guard.step().nonfinite
    assert same(params(model), before)


@pytest.mark.parametrize("opt_name", ["adamw", "adamw_fused"])
def test_skip_nonfinite_false_restores_the_unchecked_path(opt_name):
    model = make_model()
    guard = ag.Guard(
        model, OPTIMIZERS[opt_name](model.parameters()), precision="bf16", skip_nonfinite=False
    )
    result = step(guard, model, 0, bad=NAN)
    assert (result.applied, result.nonfinite) == (True, False)  # nothing checked
    assert not finite(model)


def test_skip_nonfinite_must_be_a_bool():
    model = make_model()
    with pytest.raises(TypeError, match="skip_nonfinite must be True or False"):
        ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_nonfinite="yes")


def test_two_optimizers_skip_only_the_one_with_nonfinite_gradients():
    model = make_model()
    opts = [
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    ]
    guard = ag.Guard(model, opts, precision="bf16", clip_grad_norm=1.0)
    x, y = batch(0)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    model[2].weight.grad.view(-1)[0] = NAN
    first, second = params(model[0]), params(model[2])
    result = guard.step()
    assert result.optimizers_applied == (True, False)
    assert result.skip_cause == "nonfinite"
    assert not same(params(model[0]), first) and finite(model[0])  # clipped with a finite norm
    assert same(params(model[2]), second)


# ---------------------------------------------------------------------- item 1 + the bound
@pytest.mark.parametrize("opt_name", ["adamw", "adamw_fused"])
def test_nan_every_step_after_a_fallback_ends_in_a_collapse_error_not_nan_weights(
    opt_name, tmp_path
):
    model = make_model()
    cfg = ag.ScalerConfig(
        init_scale=4.0, min_scale=1.0, on_collapse="fallback", max_nonfinite_skips=4
    )
    guard = ag.Guard(
        model,
        OPTIMIZERS[opt_name](model.parameters()),
        precision="fp16",
        scaler=cfg,
        telemetry=tmp_path / "run",
    )
    start = params(model)
    with warnings.catch_warnings(), pytest.raises(ag.ScaleCollapseError) as err:
        warnings.simplefilter("ignore")  # the fallback warning
        for i in range(40):
            result = step(guard, model, i, bad=NAN)
            assert not result.applied
    assert guard.fallback is not None and guard.fallback["to"] == "bf16"
    assert same(params(model), start) and finite(model)
    msg = str(err.value)
    assert "4 consecutive windows" in msg and "bf16" in msg and "max_nonfinite_skips=4" in msg
    assert "fp16 -> bf16 fallback" in msg
    d = guard.diagnostics()
    assert d["skipped_by_cause"]["nonfinite"] == 4 and d["applied_steps"] == 0
    guard.close()
    run = runlog.load_run(tmp_path / "run")
    assert run.nonfinite.sum() == 4 and not run.applied.any()
    found = json.loads((tmp_path / "run" / runlog.FINDINGS).read_text())
    assert [f["severity"] for f in found if f["code"] == "AG109"] == ["error"]


def test_the_bound_counts_consecutive_skips_only():
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="bf16",
        scaler=ag.ScalerConfig(max_nonfinite_skips=3),
    )
    for i in range(3):  # two bad, one good: the run is making progress
        step(guard, model, 3 * i, bad=NAN)
        step(guard, model, 3 * i + 1, bad=NAN)
        assert step(guard, model, 3 * i + 2).applied
    step(guard, model, 10, bad=NAN)
    step(guard, model, 11, bad=NAN)
    with pytest.raises(ag.ScaleCollapseError, match="3 consecutive windows up to step 12"):
        step(guard, model, 12, bad=NAN)


def test_the_bound_under_warn_warns_once_per_episode_and_keeps_skipping():
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp32",
        scaler=ag.ScalerConfig(max_nonfinite_skips=2, on_collapse="warn"),
    )
    start = params(model)
    with pytest.warns(RuntimeWarning, match="non-finite gradients in 2 consecutive") as rec:
        for i in range(6):
            step(guard, model, i, bad=NAN)
    assert len([w for w in rec if "non-finite gradients" in str(w.message)]) == 1
    assert same(params(model), start)
    assert step(guard, model, 7).applied  # the episode ends
    with pytest.warns(RuntimeWarning, match="non-finite gradients in 2 consecutive"):
        for i in range(8, 10):
            step(guard, model, i, bad=NAN)


def test_fused_flags_settle_lazily_and_the_bound_acts_when_read():
    model = make_model()
    guard = ag.Guard(
        model,
        OPTIMIZERS["adamw_fused"](model.parameters()),
        precision="bf16",
        scaler=ag.ScalerConfig(max_nonfinite_skips=2),
    )
    start = params(model)
    results = [step(guard, model, i, bad=NAN) for i in range(3)]  # no sync, no raise yet
    assert same(params(model), start)
    with pytest.raises(ag.ScaleCollapseError):
        results[0].applied  # noqa: B018  (reading a flag settles them all)


def test_forensics_replays_a_nonfinite_bf16_step():
    model = make_model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", forensics=True
    )
    step(guard, model, 0)
    x, y = batch(1, NAN)

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]).float(), b[1])

    with guard.autocast():
        loss = loss_fn(model, (x, y))
    guard.backward(loss)
    assert guard.step(batch=(x, y), loss_fn=loss_fn).nonfinite
    assert [f for f in guard.findings() if f.code.startswith("AG3")]


# ---------------------------------------------------------------------- item 3: extra backward
@pytest.mark.parametrize("accumulation", [1, 3])
def test_more_backward_calls_than_accumulation_steps_raise(accumulation):
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="bf16",
        accumulation_steps=accumulation,
    )
    for i in range(accumulation):
        x, y = batch(i)
        guard.backward(F.mse_loss(model(x), y))
    grads = [p.grad.clone() for p in model.parameters()]
    x, y = batch(9)
    with pytest.raises(RuntimeError) as err:
        guard.backward(F.mse_loss(model(x), y))
    msg = str(err.value)
    assert f"called {accumulation + 1} times" in msg
    assert f"accumulation_steps={accumulation + 1}" in msg and "guard.step()" in msg
    assert same([p.grad for p in model.parameters()], grads)  # the extra backward never ran
    assert guard.step().applied  # the window is still usable


# ---------------------------------------------------------------------- item 4: foreign params
def test_an_optimizer_of_another_model_is_refused_naming_its_parameters():
    model_a, model_b = make_model(0), make_model(1)
    with pytest.raises(ValueError) as err:
        ag.Guard(model_a, torch.optim.AdamW(model_b.parameters()))
    msg = str(err.value)
    assert "4 of the optimizer's 4 parameters are not parameters of model" in msg
    assert "#0 (shape (16, 8))" in msg and "#2 (shape (4, 16))" in msg and "1 more" in msg


def test_one_extra_parameter_outside_the_model_is_named():
    model = make_model()
    extra = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match=r"1 of the optimizer's 5 .*#4 \(shape \(5,\)\)"):
        ag.Guard(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1))


# ---------------------------------------------------------------------- item 5: ScalerConfig
FIELDS = [
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
    "on_collapse",
    "dynamic",
    "max_nonfinite_skips",
]


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("value", ["2", None, [1.0], torch.tensor(2.0)])
def test_every_scaler_field_of_the_wrong_type_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"ScalerConfig\.{name} "):
        ag.ScalerConfig(**{name: value})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"growth_factor": INF}, "growth_factor"),
        ({"growth_factor": NAN}, "growth_factor"),
        ({"backoff_factor": NAN}, "backoff_factor"),
        ({"init_scale": NAN}, "init_scale"),
        ({"max_scale": 1e39}, "max_scale"),
        ({"min_scale": 1e-50}, "min_scale"),
        ({"init_scale": 1e39, "max_scale": 1e39}, "max_scale"),
        ({"growth_interval": 2**31}, "growth_interval"),
        ({"max_nonfinite_skips": 0}, "max_nonfinite_skips"),
    ],
)
def test_non_finite_and_out_of_fp32_range_values_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=rf"ScalerConfig\.{name} "):
        ag.ScalerConfig(**kwargs)


def test_fp32_limits_themselves_are_accepted():
    big = float(torch.finfo(torch.float32).max)
    ag.ScalerConfig(max_scale=big, init_scale=2.0**16)
    ag.ScalerConfig(min_scale=float(torch.finfo(torch.float32).tiny), init_scale=1.0)


# ---------------------------------------------------------------------- item 7: loss records
@pytest.mark.parametrize(("value", "name"), [(NAN, "nan"), (INF, "inf"), (-INF, "-inf")])
def test_a_nonfinite_loss_is_recorded_by_kind(value, name, tmp_path):
    model = make_model()
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", telemetry=tmp_path
    ) as guard:
        step(guard, model, 0)
        x, y = batch(1)
        with guard.autocast():
            loss = F.mse_loss(model(x).float(), y) * value  # and so are its gradients
        guard.backward(loss)
        guard.step()
    recs = [json.loads(line) for line in (tmp_path / runlog.EVENTS).read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    assert math.isfinite(recs[0]["loss"]) and "loss_nonfinite" not in recs[0]
    assert recs[1]["loss"] is None and recs[1]["loss_nonfinite"] == name
    assert recs[1]["nonfinite"] is True and recs[1]["applied"] is False
    assert list(runlog.load_run(tmp_path).loss_nonfinite) == [False, True]


def test_a_window_without_a_recorded_loss_is_null_without_a_kind(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ag.watch(None, model, opt, tmp_path, precision="fp32"):
        x, y = batch(0)
        F.mse_loss(model(x), y).backward()  # no record_loss: nothing to record
        opt.step()
    rec = [json.loads(line) for line in (tmp_path / runlog.EVENTS).read_text().splitlines()][-1]
    assert rec["loss"] is None and "loss_nonfinite" not in rec


def test_the_report_marks_nonfinite_losses(tmp_path):
    pytest.importorskip("matplotlib")
    model = make_model()
    with ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", telemetry=tmp_path
    ) as guard:
        for i in range(4):
            step(guard, model, i, bad=NAN if i == 2 else None)
    html = ag.report(tmp_path).read_text()
    assert "non-finite gradients (no loss scaler)" in html  # the skip table names the cause
    assert "AG109" in html


def test_numpy_scalars_are_accepted_as_plain_floats():
    np = pytest.importorskip("numpy")
    cfg = ag.ScalerConfig(init_scale=np.float32(1024.0), growth_factor=np.float64(2.0))
    assert type(cfg.init_scale) is float and cfg.init_scale == 1024.0
    assert type(cfg.growth_factor) is float
    assert type(cfg.to_dict()["init_scale"]) is float  # loads under weights_only
