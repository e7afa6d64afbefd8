"""keep_fp32: matching modules run outside autocast in fp32; everything else is untouched."""

from collections import namedtuple

import pytest
import torch
import torch.nn as nn

from ampguard.forensics.islands import Fp32Islands, keep_fp32, match_modules

W = 16
Pair = namedtuple("Pair", "a b")


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(W, W)

    def forward(self, x):
        return self.q(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = nn.Linear(W, W)

    def forward(self, x):
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(W, W)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def fp16():
    return torch.autocast("cpu", dtype=torch.float16)


def output_dtypes(model, x):
    seen = {}
    hooks = [
        m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o.dtype))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    with fp16():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_matching_module_runs_in_fp32_and_the_rest_in_fp16():
    model = Net()
    keep_fp32(model, ["head"])
    seen = output_dtypes(model, torch.randn(4, W))
    assert seen["head"] == torch.float32
    assert seen["blocks.0.mlp"] == torch.float16


def test_glob_pattern_matches_each_block_and_their_children():
    model = Net()
    islands = keep_fp32(model, ["blocks.*.attn"])
    assert islands.modules == ("blocks.0.attn", "blocks.1.attn")
    seen = output_dtypes(model, torch.randn(4, W))
    assert seen["blocks.0.attn.q"] == seen["blocks.1.attn.q"] == torch.float32
    assert seen["blocks.1.mlp"] == torch.float16


def test_low_precision_inputs_are_cast_up_positional_keyword_and_nested():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, pair, *, extra):
            seen.update(
                x=x.dtype,
                a=pair.a.dtype,
                b=pair.b[0].dtype,
                extra=extra["t"].dtype,
                idx=pair.b[1].dtype,
            )
            return x

    model = nn.Sequential()
    model.add_module("probe", Probe())
    keep_fp32(model, ["probe"])
    h = torch.ones(2, dtype=torch.float16)
    model.probe(h, Pair(h, [h.bfloat16(), torch.ones(2, dtype=torch.long)]), extra={"t": h})
    assert seen == dict(
        x=torch.float32, a=torch.float32, b=torch.float32, extra=torch.float32, idx=torch.long
    )


def test_output_stays_fp32_so_a_large_value_survives_the_boundary():
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W))
    with torch.no_grad():
        model[0].weight.fill_(1e4)
    x = torch.ones(2, W)
    with fp16():
        assert not torch.isfinite(model(x)).all()
    keep_fp32(model, ["0"])
    with fp16():
        out0 = model[0](x)
    assert out0.dtype == torch.float32 and torch.isfinite(out0).all()
    assert out0.abs().max() > 65504


def test_autocast_is_back_on_after_the_island_even_when_it_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(Boom())
    keep_fp32(model, ["0"])
    with fp16():
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(2))
        assert torch.is_autocast_enabled("cpu")


def test_gradients_flow_through_an_island():
    model = Net()
    keep_fp32(model, ["blocks.1"])
    with fp16():
        loss = model(torch.randn(4, W)).float().pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_remove_restores_autocast_and_leaves_no_hooks():
    model = Net()
    islands = keep_fp32(model, ["head", "blocks.0"])
    islands.remove()
    assert islands.modules == ()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert output_dtypes(model, torch.randn(4, W))["head"] == torch.float16


def test_context_manager_removes_on_exit():
    model = Net()
    with keep_fp32(model, "head"):
        assert output_dtypes(model, torch.randn(4, W))["head"] == torch.float32
    assert output_dtypes(model, torch.randn(4, W))["head"] == torch.float16


def test_add_is_idempotent_and_reports_membership():
    model = Net()
    islands = Fp32Islands(model)
    assert islands.add("head") is True
    assert islands.add("head") is False
    assert "head" in islands and "blocks.0" not in islands
    assert len(model.head._forward_pre_hooks) == 1


def test_pattern_matching_nothing_names_keep_fp32_and_suggests_names():
    with pytest.raises(ValueError, match=r"keep_fp32 pattern 'haed'.*'head'"):
        keep_fp32(Net(), ["haed"])


def test_add_of_an_unknown_module_is_a_value_error():
    with pytest.raises(ValueError, match="keep_fp32"):
        Fp32Islands(Net()).add("nope")


@pytest.mark.parametrize("patterns", [3, [None], ["head", 1]])
def test_non_string_patterns_are_type_errors(patterns):
    with pytest.raises(TypeError, match="keep_fp32"):
        keep_fp32(Net(), patterns)


def test_match_modules_keeps_model_order_and_custom_argument_name():
    assert match_modules(Net(), ["head", "blocks.?"]) == ["blocks.0", "blocks.1", "head"]
    with pytest.raises(ValueError, match="my_arg"):
        match_modules(Net(), ["zzz"], argument="my_arg")
