"""ampguard.inspect_model: static AMP checks and the fp32 range probe, checked against real fp16."""

from __future__ import annotations

import inspect
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag

FP16_MAX = 65504.0


def codes(findings):
    return [f.code for f in findings]


def one(findings, code):
    found = [f for f in findings if f.code == code]
    assert len(found) == 1, f"expected one {code}, got {codes(findings)}"
    return found[0]


def mlp(width=32):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def keep_in_fp32(model, names):
    """Run the named modules outside autocast on fp32 inputs (what keep_fp32 means)."""
    for name in names:
        module = model.get_submodule(name)
        inner = module.forward

        def forward(*args, _inner=inner):
            with torch.autocast("cpu", enabled=False):
                return _inner(*[a.float() for a in args])

        module.forward = forward


def fp16_forward(model, x):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x)


# ------------------------------------------------------------------------ hazard models


class Block(nn.Module):
    def __init__(self, gain=1.0):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x):
        return self.fc(x)


class Deep(nn.Module):
    """Overflow three levels down (outer.block.fc), after several finite layers."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.outer = nn.Module()
        self.outer.block = Block()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.outer.block.fc.bias.fill_(2e5)  # finite in fp32, inf in fp16

    def forward(self, x):
        return self.head(self.norm(self.outer.block(self.pre(x))))


class FunctionalOverflow(nn.Module):
    """The overflow comes from the parent's own code (x * 1e6), not from a child module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.inner = nn.Module()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x) * 1e6


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class AmpSquare(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class UsesSquare(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(self.fc(x))


def hidden_square(x):  # the Function is not named in any forward: only the graph shows it
    return Square.apply(x)


class HidesSquare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return hidden_square(self.fc(x))


myops = types.ModuleType("myops")  # a user extension module holding the Function
myops.Square = Square


class UsesModuleAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return myops.Square.apply(self.fc(x))


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.loud = nn.Linear(16, 4)
        self.quiet = nn.Linear(16, 4)

    def forward(self, x):
        return self.loud(x), self.quiet(x)


def two_head_loss(model, batch):
    loud, quiet = model(batch[0])
    return 3e3 * loud.pow(2).sum() + 1e-12 * quiet.pow(2).sum()


# ------------------------------------------------------------------------ static checks


def test_healthy_model_has_no_static_findings():
    assert ag.inspect_model(mlp()) == []


def test_healthy_probe_gives_only_an_fp16_plan(batch):
    findings = ag.inspect_model(mlp(), batch, mse)
    plan = one(findings, "AG331")
    assert codes(findings) == ["AG331"]
    assert plan.evidence["precision"] == "fp16" and plan.evidence["keep_fp32"] == []


def test_batchnorm_heavy_model_is_flagged():
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.Linear(32, 4),
    )
    f = one(ag.inspect_model(model), "AG320")
    assert f.evidence["modules"] == ["1", "4"]


def test_single_batchnorm_in_a_deep_mlp_is_not_heavy():
    layers = [nn.Linear(16, 16) for _ in range(8)] + [nn.BatchNorm1d(16)]
    assert "AG320" not in codes(ag.inspect_model(nn.Sequential(*layers)))


def test_saturating_activation_is_an_info_without_probe():
    f = one(ag.inspect_model(nn.Sequential(nn.Linear(16, 8), nn.Tanh())), "AG321")
    assert f.severity == "info" and f.evidence["modules"] == ["1"]


def test_probe_upgrades_saturation_seen_only_in_fp16(batch):
    model = nn.Sequential(nn.Linear(16, 8), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.mul_(0.1)
        model[0].bias.fill_(12.0)  # sigmoid(12) < 1 in fp32, == 1 in fp16
    findings = ag.inspect_model(model, batch[0], lambda m, x: m(x).mean())
    f = one(findings, "AG321")
    assert f.severity == "warning" and f.evidence["saturated_fraction"]["1"] > 0.9
    assert torch.all(fp16_forward(model, batch[0]) == 1.0)  # the prediction holds in fp16
    assert one(findings, "AG331").evidence["keep_fp32"] == ["1"]


def test_undecorated_custom_function_is_flagged_with_its_module():
    f = one(ag.inspect_model(UsesSquare(Square)), "AG322")
    assert f.evidence["functions"] == [f"{__name__}.Square"]
    assert f.evidence["modules"] == ["<root>"]


def test_custom_function_reached_through_a_module_attribute_is_flagged():
    f = one(ag.inspect_model(UsesModuleAttribute()), "AG322")
    assert f.evidence["functions"] == [f"{__name__}.Square"]


def test_custom_function_with_custom_fwd_and_bwd_passes(batch):
    findings = ag.inspect_model(UsesSquare(AmpSquare), batch[0], lambda m, x: m(x).sum())
    assert "AG322" not in codes(findings)


def test_custom_function_found_in_the_autograd_graph(batch):
    model = HidesSquare()
    assert "AG322" not in codes(ag.inspect_model(model))  # invisible to the static scan
    f = one(ag.inspect_model(model, batch[0], lambda m, x: m(x).sum()), "AG322")
    assert f.evidence["functions"] == [f"{__name__}.Square"]


def test_optimizer_with_fp16_parameters_is_an_error():
    model = mlp().half()
    f = one(ag.inspect_model(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), "AG323")
    assert f.severity == "error" and f.evidence["fp16_params"] == 4


@pytest.mark.parametrize("eps, flagged", [(1e-8, True), (1e-4, False)])
def test_adam_eps_below_fp16_resolution(eps, flagged):
    model = mlp().half()
    findings = ag.inspect_model(model, optimizer=torch.optim.Adam(model.parameters(), eps=eps))
    assert ("AG324" in codes(findings)) is flagged


def test_adam_eps_with_fp32_parameters_is_fine():
    model = mlp()
    findings = ag.inspect_model(model, optimizer=torch.optim.Adam(model.parameters(), eps=1e-8))
    assert "AG324" not in codes(findings)


def test_modules_already_half_are_named():
    model = mlp()
    model[2].half()
    f = one(ag.inspect_model(model), "AG325")
    assert f.evidence["modules"] == {"2": ["torch.float16"]}


# ------------------------------------------------------------------------ probe predictions


def test_deep_forward_overflow_names_the_innermost_module(batch):
    model = Deep()
    findings = ag.inspect_model(model, batch, mse)
    f = one(findings, "AG326")
    assert f.evidence["modules"] == ["outer.block.fc"]
    assert not torch.isfinite(fp16_forward(model, batch[0])).all()  # the prediction holds


def test_following_the_keep_fp32_plan_makes_fp16_finite(batch):
    model = Deep()
    plan = one(ag.inspect_model(model, batch, mse), "AG331")
    assert plan.evidence["precision"] == "fp16"
    keep_in_fp32(model, plan.evidence["keep_fp32"])
    assert torch.isfinite(fp16_forward(model, batch[0])).all()


def test_the_plan_stops_overflow_in_a_real_guard(batch):
    if "keep_fp32" not in inspect.signature(ag.Guard).parameters:
        pytest.skip("this Guard has no keep_fp32 yet")
    model = Deep()
    keep = one(ag.inspect_model(model, batch, mse), "AG331").evidence["keep_fp32"]
    overflowed = {}
    for plan in ([], keep):
        m = Deep()
        m.load_state_dict(model.state_dict())
        guard = ag.Guard(
            m,
            torch.optim.SGD(m.parameters(), lr=0.01),
            precision="fp16",
            keep_fp32=plan,
            scaler=ag.ScalerConfig(on_collapse="warn"),
        )
        overflowed[tuple(plan)] = []
        for _ in range(4):
            with guard.autocast():
                loss = mse(m, batch)
            guard.backward(loss)
            overflowed[tuple(plan)].append(guard.step().overflow)
    assert overflowed[()] == [True] * 4 and overflowed[tuple(keep)] == [False] * 4


def test_consumer_of_a_big_fp32_value_is_kept_in_fp32_too(batch):
    model = nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    with torch.no_grad():
        model[2].bias.fill_(1e5)
    plan = one(ag.inspect_model(model, batch, mse), "AG331")
    assert plan.evidence["keep_fp32"] == ["2", "4"]  # the ReLU passes fp32 through
    keep_in_fp32(model, plan.evidence["keep_fp32"])
    assert torch.isfinite(fp16_forward(model, batch[0])).all()


def test_overflow_in_a_parents_own_code_names_the_parent(batch):
    model = nn.Sequential(FunctionalOverflow(), nn.Linear(16, 4))
    f = one(ag.inspect_model(model, batch, mse), "AG326")
    assert f.evidence["modules"] == ["0", "1"]


def test_activations_near_fp16_max_warn(batch):
    model = mlp()
    with torch.no_grad():
        model[2].bias.fill_(2e4)
    f = one(ag.inspect_model(model, batch, mse), "AG327")
    assert list(f.evidence["amax"]) == ["2"]


def test_gradient_overflow_at_scale_one_recommends_bf16(batch):
    model = mlp()
    findings = ag.inspect_model(
        model, batch, lambda m, b: 1e7 * F.mse_loss(m(b[0]), b[1], reduction="sum")
    )
    assert one(findings, "AG328").severity == "error"
    assert one(findings, "AG331").evidence["precision"] == "bf16"


def test_gradient_overflow_prediction_holds_in_fp16(batch):
    model = mlp()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e7 * F.mse_loss(model(batch[0]), batch[1], reduction="sum")
    loss.backward()  # loss scale 1
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_gradient_underflow_names_the_starved_module(batch):
    findings = ag.inspect_model(TwoHeads(), batch, two_head_loss)
    f = one(findings, "AG329")
    assert list(f.evidence["flushed_fraction"]) == ["quiet"]
    assert f.evidence["limited_by"] == "loud"
    assert one(findings, "AG331").evidence["precision"] == "bf16"


def test_gradient_underflow_prediction_holds_in_fp16(batch):
    model = TwoHeads()
    scale = one(ag.inspect_model(model, batch, two_head_loss), "AG329").evidence["scale"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = two_head_loss(model, batch)
    (loss * scale).backward()
    assert torch.all(model.quiet.weight.grad == 0)
    model.zero_grad()
    two_head_loss(model, batch).backward()
    assert torch.any(model.quiet.weight.grad != 0)  # fp32 keeps them


def test_activations_flushed_to_zero_in_fp16(batch):
    model = nn.Sequential(nn.Linear(16, 4, bias=False))
    x = batch[0] * 1e-12
    f = one(ag.inspect_model(model, x), "AG330")
    assert f.evidence["flushed_fraction"] == {"0": 1.0}
    assert torch.all(fp16_forward(model, x) == 0)


def test_non_finite_in_fp32_is_not_an_amp_problem(batch):
    findings = ag.inspect_model(mlp(), batch, lambda m, b: m(b[0]).log().mean())
    assert codes(findings) == ["AG332"]


def test_forward_only_probe_says_gradients_were_not_probed(batch):
    plan = one(ag.inspect_model(mlp(), batch[0]), "AG331")
    assert plan.evidence["usable_scale"] is None
    assert "not probed" in plan.message


def test_experiment_supplies_batch_loss_and_optimizer(batch):
    model = Deep()
    half = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    exp = ag.Experiment(model, torch.optim.Adam([*model.parameters(), half]), [batch], mse)
    findings = ag.inspect_model(exp)
    assert {"AG323", "AG324", "AG326"} <= set(codes(findings))


def test_findings_are_json_serialisable(batch):
    model = Deep()
    findings = ag.inspect_model(model, batch, mse, optimizer=torch.optim.Adam(model.parameters()))
    assert json.loads(json.dumps([f.to_dict() for f in findings]))


# ------------------------------------------------------------------------ probe hygiene


def test_probe_restores_buffers_grads_and_rng(batch):
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    mse(model, batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = model[1].running_mean.clone(), model[1].num_batches_tracked.clone()
    rng = torch.get_rng_state()
    ag.inspect_model(model, batch, mse)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert torch.equal(model[1].running_mean, stats[0])
    assert torch.equal(model[1].num_batches_tracked, stats[1])
    assert torch.equal(torch.get_rng_state(), rng)


def test_probe_leaves_no_hooks(batch):
    model = Deep()
    ag.inspect_model(model, batch, mse)
    assert all(not m._forward_hooks for m in model.modules())


def test_probe_removes_hooks_when_the_loss_raises(batch):
    model = mlp()

    def broken(m, b):
        m(b[0])
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        ag.inspect_model(model, batch, broken)
    assert all(not m._forward_hooks for m in model.modules())


# ------------------------------------------------------------------------ bad input


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ag.inspect_model("resnet")


def test_loss_fn_needs_a_batch():
    with pytest.raises(ValueError, match="batch"):
        ag.inspect_model(mlp(), loss_fn=mse)


def test_optimizer_must_be_an_optimizer():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        ag.inspect_model(mlp(), optimizer="adam")


def test_loss_fn_must_return_a_scalar(batch):
    with pytest.raises(TypeError, match="scalar tensor"):
        ag.inspect_model(mlp(), batch, lambda m, b: m(b[0]))
