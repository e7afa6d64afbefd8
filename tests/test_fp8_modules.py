"""The fp8 plan names the matmul modules it cannot convert (transformers Conv1D, ...), and
``ag.conv1d_to_linear`` swaps Conv1D for nn.Linear exactly, on a small GPT-2 built from config."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampguard as ag

transformers = pytest.importorskip("transformers")

N_LAYER = 2  # GPT-2 has 4 Conv1D per block: c_attn, attn.c_proj, c_fc, mlp.c_proj


def _gpt2(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=N_LAYER,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _conv1d_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]


def test_plan_names_every_conv1d_with_the_fix():
    model = _gpt2()
    conv1d = _conv1d_names(model)
    assert len(conv1d) == 4 * N_LAYER
    plan = ag.fp8_plan(model, _loss, IDS)
    assert list(plan.layers) == ["lm_head"]  # the only nn.Linear
    assert list(plan.unconvertible) == conv1d
    info = plan.unconvertible["transformer.h.0.mlp.c_fc"]
    assert info["type"] == "Conv1D" and info["shape"] == [32, 128]
    assert "conv1d_to_linear" in info["fix"]
    table = plan.summary()
    assert "1 of 1 Linear layers ready" in table
    assert f"{len(conv1d)} more module(s) do matmuls but are not nn.Linear" in table
    assert all(n in table for n in conv1d) and "ag.conv1d_to_linear(model)" in table
    ag355 = [f for f in plan.findings() if f.code == "AG355"]
    assert len(ag355) == 1 and ag355[0].severity == "warning"
    assert set(ag355[0].evidence["modules"]) == set(conv1d)
    assert "conv1d_to_linear" in ag355[0].fix
    json.dumps(plan.to_dict())


def test_plan_names_attention_bilinear_and_convolutions():
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
            self.bil = nn.Bilinear(32, 32, 16)
            self.conv = nn.Conv1d(32, 32, 1)
            self.head = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.attn(x, x, x)
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)
            return self.head(self.bil(h.float(), x)).float().pow(2).mean()

    plan = ag.fp8_plan(Mixed(), lambda m, x: m(x), torch.randn(2, 4, 32))
    assert set(plan.layers) == {"attn.out_proj", "head"}  # out_proj is an nn.Linear
    assert {n: i["type"] for n, i in plan.unconvertible.items()} == {
        "attn": "MultiheadAttention",
        "bil": "Bilinear",
        "conv": "Conv1d",
    }
    assert "in_proj_weight" in plan.unconvertible["attn"]["reason"]


def test_plan_of_a_model_without_linear_names_what_it_has():
    model = _gpt2()
    with pytest.raises(ValueError, match=r"no nn.Linear layers.*c_attn \(Conv1D\).*conv1d_to_"):
        ag.fp8_plan(model.transformer, lambda m, x: m(input_ids=x).last_hidden_state.sum(), IDS)


def test_conv1d_to_linear_is_exact_and_the_plan_then_covers_every_matmul():
    model = _gpt2().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    out = ag.conv1d_to_linear(model)
    assert out is model and _conv1d_names(model) == []
    fc = model.transformer.h[0].mlp.c_fc
    assert type(fc) is nn.Linear and (fc.in_features, fc.out_features) == (32, 128)
    assert not fc.training  # the mode is kept
    after = model.state_dict()
    assert list(after) == list(before)  # same keys; Conv1D weights transposed
    for key, value in before.items():
        swapped = key.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        assert torch.equal(after[key], value.t() if swapped else value), key
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    assert torch.equal(got, expected)  # bitwise, fp32
    # gradients match too (the same addmm over the same memory layout)
    ref = _gpt2()
    swapped = ag.conv1d_to_linear(_gpt2())
    _loss(ref, IDS).backward()
    _loss(swapped, IDS).backward()
    g_ref = ref.transformer.h[1].attn.c_attn.weight.grad
    assert torch.equal(swapped.transformer.h[1].attn.c_attn.weight.grad, g_ref.t())
    plan = ag.fp8_plan(swapped, _loss, IDS)
    assert plan.unconvertible == {} and len(plan.layers) == 4 * N_LAYER + 1
    assert "AG355" not in {f.code for f in plan.findings()}


def test_conv1d_to_linear_trains_under_a_guard_and_checks_its_argument():
    model = ag.conv1d_to_linear(_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built after the swap
    guard = ag.Guard(model, opt, precision="bf16")
    first = None
    for _ in range(3):
        with guard.autocast():
            loss = _loss(model, IDS)
        guard.backward(loss)
        guard.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    assert ag.conv1d_to_linear(nn.Linear(4, 4)).weight.shape == (4, 4)  # nothing to swap
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ag.conv1d_to_linear("gpt2")
    with pytest.raises(ValueError, match="itself a Conv1D"):
        ag.conv1d_to_linear(_conv1d(8, 4))


def _conv1d(nf: int, nx: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)


def test_guard_fp8_names_the_conv1d_it_leaves_in_bf16():
    pytest.importorskip("torchao")
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match=r"8 module\(s\) do matmuls but are not nn.Linear"):
        guard = ag.Guard(model, opt, precision="fp8")
    assert guard.fp8.layers == ["lm_head"] and guard.precision == "fp8"
    assert guard.fp8.unconvertible == _conv1d_names(model)
    assert guard.fp8.summary()["unconvertible"] == _conv1d_names(model)
