"""ampguard.locate: a zoo of planted fp16 hazards, each diagnosed by kind, pass, module and op."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard as ag
from ampguard.forensics import CODES, KINDS

W = 16


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def make_batch(lo=-1.0, hi=1.0):
    return torch.empty(8, W).uniform_(lo, hi), torch.randn(8, W)


class DeepForward(nn.Module):
    """Forward overflow three levels down: 'enc.1.1' sums sigmoids with weights of 2e4."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(W, W), nn.Sequential(nn.Sigmoid(), nn.Linear(W, W)))
        self.out = nn.Linear(W, W)
        with torch.no_grad():
            self.enc[1][1].weight.fill_(2e4)

    def forward(self, x):
        return self.out(self.enc(x))


class Block(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.gain = gain

    def forward(self, x):
        return self.fc(x) * self.gain  # the block's own functional code


class FunctionalParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(1.0), Block(1e6), Block(1.0)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LateOverflow(nn.Module):
    """Six x10 layers: finite through layers.3, inf at layers.4 for inputs in [1, 2]."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(6))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.eye(W) * 10)
                layer.bias.zero_()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x / 1e6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.LayerNorm(W), nn.Linear(W, W))
        self.head = nn.Linear(W, W)

    def forward(self, x):
        return self.head(self.body(x))


class _GradBoost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e7


class GradBomb(nn.Module):
    def forward(self, x):
        return _GradBoost.apply(x)


class BackwardOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.bomb = GradBomb()
        self.fc2 = nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(self.bomb(self.fc1(x)))


class Underflow(nn.Module):
    """The gradient reaching fc1 is ~1e-13 before scaling: it flushes to zero in fp16."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x):
        return self.fc2(self.fc1(x) * 1e-3)


class LogOfNegative(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.norm = nn.Sequential(nn.Identity(), SqrtLayer())

    def forward(self, x):
        return self.norm(self.fc(x))


class SqrtLayer(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 10.0)  # negative everywhere: NaN in fp32 too


class MaskedAttention(nn.Module):
    """Healthy: -inf attention mask, dropout, BatchNorm."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.drop = nn.Dropout(0.2)
        self.proj = nn.Linear(W, W)
        self.bn = nn.BatchNorm1d(W)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        mask = torch.triu(torch.ones(len(x), len(x), dtype=torch.bool), 1)
        att = (q @ k.T / 4).masked_fill(mask, float("-inf")).softmax(-1)
        return self.bn(self.proj(self.drop(att @ v)))


# ---------------------------------------------------------------------- kinds, passes, modules
def test_forward_overflow_nested_three_deep_names_the_inner_linear():
    d = ag.locate(DeepForward(), mse, make_batch())
    assert (d.kind, d.phase, d.module, d.op) == (
        "fp16_overflow",
        "forward",
        "enc.1.1",
        "aten.addmm",
    )
    assert d.stats["max_abs_fp32"] > 65504 and d.stats["inf_count"] > 0
    assert d.code == "AG301"


def test_functional_overflow_names_the_parent_not_its_child():
    d = ag.locate(FunctionalParent(), mse, make_batch())
    assert (d.kind, d.phase, d.module, d.op) == ("fp16_overflow", "forward", "blocks.1", "aten.mul")


def test_overflow_after_several_finite_layers_names_the_first_overflowing_layer():
    d = ag.locate(LateOverflow(), mse, make_batch(1.0, 2.0))
    assert (d.kind, d.phase, d.module) == ("fp16_overflow", "forward", "layers.4")
    assert d.stats["input_max_abs_fp16"] < 65504 < d.stats["max_abs_fp32"]


def test_backward_only_overflow_of_an_activation_gradient_names_the_producer():
    def loud(model, batch):
        return mse(model, batch) * 1e7

    d = ag.locate(MLP(), loud, make_batch())
    assert (d.kind, d.phase, d.module) == ("fp16_overflow", "backward", "head")


def test_backward_overflow_in_a_modules_own_backward_names_that_module():
    d = ag.locate(BackwardOnly(), mse, make_batch())
    assert (d.kind, d.phase, d.module, d.op) == ("fp16_overflow", "backward", "bomb", "aten.mul")


def test_underflow_names_the_dead_layer_and_the_flushing_op():
    def quiet(model, batch):
        return mse(model, batch) * 1e-8

    d = ag.locate(Underflow(), quiet, make_batch())
    assert (d.kind, d.phase, d.module) == ("fp16_underflow", "backward", "fc1")
    assert d.stats["dead_parameters"] == ["fc1.weight", "fc1.bias"]
    assert d.stats["grad_max_abs_fp32"] > 0
    assert d.stats["flushed_by"] == {"module": "", "op": "aten.mul"}
    assert d.code == "AG302"


def test_nan_in_fp32_too_is_model_nonfinite():
    d = ag.locate(LogOfNegative(), mse, make_batch())
    assert (d.kind, d.phase, d.module, d.op) == (
        "model_nonfinite",
        "forward",
        "norm.1",
        "aten.sqrt",
    )
    assert d.stats["nan_count"] == 8 * W


def test_nonfinite_weights_are_model_nonfinite_before_any_run():
    model = MLP()
    with torch.no_grad():
        model.body[3].weight[0, 0] = float("nan")
    d = ag.locate(model, mse, make_batch())
    assert (d.kind, d.module) == ("model_nonfinite", "body.3")
    assert d.stats["nonfinite_tensors"] == ["body.3.weight"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_batch_names_the_first_consuming_module(value):
    x, y = make_batch()
    x[3, 5] = value
    d = ag.locate(MLP(), mse, (x, y))
    assert (d.kind, d.phase, d.module) == ("input_nonfinite", "forward", "body.0")
    assert d.stats["inputs"][0]["path"] == "batch[0]"
    assert d.code == "AG304"


@pytest.mark.parametrize("model_cls", [MLP, MaskedAttention])
def test_healthy_models_are_none(model_cls):
    d = ag.locate(model_cls(), mse, make_batch())
    assert (d.kind, d.phase, d.module, d.op, d.benign) == ("none", None, None, None, False)
    assert d.code == "AG300" and d.ok


def test_healthy_model_in_bf16_is_none():
    d = ag.locate(MLP(), mse, make_batch(), precision="bf16")
    assert d.kind == "none" and d.scale == 1.0


def test_scaler_probe_overflow_is_benign():
    d = ag.locate(MLP(), mse, make_batch(), scale=2.0**40)
    assert (d.kind, d.phase, d.benign, d.code) == ("none", "backward", True, "AG305")
    assert "benign" in d.explain().lower() and "probing" in d.explain()
    assert 1.0 <= d.stats["max_safe_scale"] < 2.0**40


def test_real_backward_overflow_is_not_benign_at_default_scale():
    d = ag.locate(BackwardOnly(), mse, make_batch())
    assert not d.benign and "persists at loss scale 1" in d.explain()


# ---------------------------------------------------------------------- restoring the model
def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameters_buffers_grads_rng_and_modes_are_restored():
    model = MaskedAttention().train()
    model.drop.eval()
    batch = make_batch()
    mse(model, batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before, rng = _state(model), torch.get_rng_state()
    ag.locate(model, mse, batch)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training and not model.drop.training and model.bn.training


def test_no_hooks_are_left_behind():
    model = BackwardOnly()
    ag.locate(model, mse, make_batch())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)


def test_dropout_runs_compare_the_same_masks():
    model = nn.Sequential(nn.Linear(W, W), nn.Dropout(0.5), nn.Linear(W, W))
    d = ag.locate(model, mse, make_batch())
    assert d.kind == "none"
    assert abs(d.stats["loss"] - d.stats["loss_fp32"]) < 1e-2 * abs(d.stats["loss_fp32"])


# ---------------------------------------------------------------------- output shapes
def test_diagnosis_round_trips_through_json():
    d = ag.locate(LogOfNegative(), mse, make_batch())
    data = json.loads(json.dumps(d.to_dict()))
    back = ag.Diagnosis.from_dict(data)
    assert (back.kind, back.module, back.op, back.code) == (d.kind, d.module, d.op, d.code)


def test_to_finding_carries_code_fix_and_step():
    d = ag.locate(DeepForward(), mse, make_batch())
    f = d.to_finding(step=41)
    assert (f.code, f.severity, f.step) == ("AG301", "error", 41)
    assert "keep_fp32=['enc.1.1']" in f.fix and "enc.1.1" in f.message


def test_every_kind_has_a_code():
    assert set(KINDS) <= set(CODES)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("precision", ["fp32", "half", None])
def test_bad_precision_names_the_argument(precision):
    with pytest.raises(ValueError, match="precision"):
        ag.locate(MLP(), mse, make_batch(), precision=precision)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), "big", True])
def test_bad_scale_names_the_argument(scale):
    with pytest.raises(ValueError, match="scale"):
        ag.locate(MLP(), mse, make_batch(), scale=scale)


def test_non_callable_loss_fn_is_a_type_error():
    with pytest.raises(TypeError, match="loss_fn"):
        ag.locate(MLP(), "mse", make_batch())


def test_non_scalar_loss_is_a_value_error_and_leaves_no_hooks():
    model = MLP()
    with pytest.raises(ValueError, match="single-element"):
        ag.locate(model, lambda m, b: m(b[0]), make_batch())
    assert all(not m._forward_hooks for m in model.modules())


def test_nonfinite_target_consumed_only_by_the_loss_names_no_module():
    x, y = make_batch()
    y[0, 0] = float("nan")
    d = ag.locate(MLP(), mse, (x, y))
    assert (d.kind, d.module, d.op) == ("input_nonfinite", None, "aten.mse_loss")
    assert d.stats["inputs"][0]["path"] == "batch[1]"
