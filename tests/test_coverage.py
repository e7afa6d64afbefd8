"""ag.coverage: per-module precision census of one step; AG310 escaped autocast, AG311 fragile."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _precisions import untraced

import ampguard as ag

W = 16


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def make_batch():
    return torch.randn(8, W), torch.randn(8, W)


def codes(cov):
    return [f.code for f in cov.findings()]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.norm = nn.LayerNorm(W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.out = nn.Linear(W, W)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(0).chunk(3, -1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)[0])


class SubModelOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = MLP()
        self.critic = MLP()

    def forward(self, x):
        h = self.encoder(x)
        with torch.autocast("cpu", enabled=False):
            return self.critic(h.float())


class FloatIsland(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):  # the module's own manual fp32 island
            return self.fc(x.float())


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.island = FloatIsland()
        self.head = nn.Linear(W, W)

    def forward(self, x):
        return self.head(self.island(x))


class _PlainMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(w.dtype)  # autocast is off here: this runs in fp32
        return grad @ w, grad.t() @ x


class _DecoratedMatmul(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(w.dtype)
        return grad @ w, grad.t() @ x


class CustomFn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(W, W) / 4)

    def forward(self, x):
        return self.fn.apply(x, self.weight)


class CustomNet(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.custom = CustomFn(fn)
        self.head = nn.Linear(W, W)

    def forward(self, x):
        return self.head(self.custom(x))


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.policy = MLP()
        self.target = MLP()


def td_loss(model, batch):
    obs, next_obs = batch
    q = model.policy(obs).float()
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        target = model.target(next_obs)  # the target net's forward runs outside autocast
    return F.mse_loss(q, target)


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.gate = nn.Linear(W, W)

    def forward(self, x):
        return self.gate(torch.exp(self.fc(x)))


# ---------------------------------------------------------------------- AG310
def test_submodel_under_autocast_disabled_escapes():
    cov = ag.coverage(SubModelOutside(), mse, make_batch())
    assert cov.escaped == [
        {
            "module": "critic",
            "phase": "forward",
            "reason": "called_without_autocast",
            "heavy_fp32": 6,
        }
    ]
    assert codes(cov) == ["AG310"]


def test_manual_float_island_escapes_and_names_the_island_module():
    cov = ag.coverage(Wrapper(), mse, make_batch())
    assert [(e["module"], e["reason"]) for e in cov.escaped] == [("island", "fp32_inside")]
    assert cov.modules[""]["heavy_forward"] == {"fp16": 1, "fp32": 1}


def test_custom_function_without_custom_bwd_escapes_in_backward():
    cov = ag.coverage(CustomNet(_PlainMatmul), mse, make_batch())
    assert [(e["module"], e["phase"], e["reason"]) for e in cov.escaped] == [
        ("custom", "backward", "backward_in_fp32")
    ]
    assert "custom_bwd" in cov.findings()[0].fix


def test_custom_function_with_custom_fwd_and_bwd_does_not_escape():
    cov = ag.coverage(CustomNet(_DecoratedMatmul), mse, make_batch())
    assert "AG310" not in codes(cov)


def test_rl_target_net_outside_autocast_escapes_and_policy_does_not():
    cov = ag.coverage(ActorCritic(), td_loss, make_batch())
    assert [e["module"] for e in cov.escaped] == ["target"]
    assert cov.modules["policy"]["heavy_forward"] == {"fp16": 2}
    assert cov.modules["target"]["autocast"] is False


def test_keep_fp32_modules_are_not_findings_nor_their_parents():
    cov = ag.coverage(SubModelOutside(), mse, make_batch(), keep_fp32=["critic"])
    assert cov.escaped == []


# ---------------------------------------------------------------------- AG311
def test_exp_in_fp16_is_a_fragile_op_naming_module_and_op():
    cov = ag.coverage(Fragile(), mse, make_batch())
    assert cov.fragile == [
        {"module": "", "op": "aten.exp", "dtype": "fp16", "count": 1, "max_numel": 8 * W}
    ]
    (finding,) = cov.findings()
    assert finding.code == "AG311" and "aten.exp" in finding.title


def test_large_reduction_in_fp16_is_fragile_and_small_one_is_not():
    def summed(model, batch):
        return model(batch[0]).sum().float()

    small = ag.coverage(MLP(), summed, make_batch())
    large = ag.coverage(MLP(), summed, make_batch(), large_reduction=64)
    assert small.fragile == []
    assert [(f["module"], f["op"]) for f in large.fragile] == [(None, "aten.sum")]


def test_softmax_in_fp16_is_fragile():
    class Soft(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, x):
            return self.fc(x).softmax(-1)

    cov = ag.coverage(Soft(), mse, make_batch())
    assert [f["op"] for f in cov.fragile] == ["aten._softmax"]


# ---------------------------------------------------------------------- healthy and census
@pytest.mark.parametrize("model_cls", [MLP, Attention])
def test_healthy_models_have_no_findings(model_cls):
    assert codes(ag.coverage(model_cls(), mse, make_batch())) == []


def test_all_matmuls_of_a_healthy_mlp_run_in_low_precision():
    assert ag.coverage(MLP(), mse, make_batch()).low_precision_share == 1.0


def test_cross_entropy_upcast_is_not_fragile():
    def ce(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1].argmax(-1))

    assert codes(ag.coverage(MLP(), ce, make_batch())) == []


def test_counts_are_inclusive_of_children_and_split_by_pass():
    cov = ag.coverage(MLP(), mse, make_batch())
    root, fc1 = cov.modules[""], cov.modules["fc1"]
    assert root["heavy_forward"] == {"fp16": 2}
    assert fc1["heavy_backward"] == {"fp16": 1}  # no input grad needed for the batch
    assert cov.modules["fc2"]["heavy_backward"] == {"fp16": 2}
    assert fc1["casts"] == 5 and fc1["autocast"] is True  # 3 forward, 2 for param grads
    assert cov.ops["aten.addmm"] == {"fp16": 2}


def test_bf16_census():
    cov = ag.coverage(MLP(), mse, make_batch(), precision="bf16")
    assert cov.modules[""]["heavy_forward"] == {"bf16": 2} and cov.precision == "bf16"


def test_model_state_is_restored_and_no_hooks_are_left():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ag.coverage(model, mse, make_batch())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_to_dict_round_trips_through_json_and_summary_names_modules():
    cov = ag.coverage(SubModelOutside(), mse, make_batch())
    back = ag.Coverage.from_dict(json.loads(json.dumps(cov.to_dict())))
    assert back == cov
    assert "critic" in cov.summary() and "AG310" in cov.summary()


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("precision", untraced())
def test_bad_precision_names_the_argument(precision):
    with pytest.raises(ValueError, match="precision"):
        ag.coverage(MLP(), mse, make_batch(), precision=precision)


def test_bad_large_reduction_names_the_argument():
    with pytest.raises(ValueError, match="large_reduction"):
        ag.coverage(MLP(), mse, make_batch(), large_reduction=0)


def test_unknown_keep_fp32_pattern_names_the_argument():
    with pytest.raises(ValueError, match="keep_fp32"):
        ag.coverage(MLP(), mse, make_batch(), keep_fp32=["nope"])


def test_importing_the_submodule_keeps_ag_coverage_callable():
    from ampguard.forensics.autocast_coverage import Coverage as FromModule

    assert FromModule is ag.Coverage
    cov = ag.coverage(MLP(), mse, make_batch())
    assert isinstance(cov, ag.Coverage)
