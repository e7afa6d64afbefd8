"""What a new user sees first: answers that were wrong or useless. AG355 skips convolutions no
Linear rewrite applies to; mxfp8/nvfp4 on stock GPT-2 name the Conv1D modules and the fix;
WandbSink keeps the user's WANDB_DIR."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.fp8._modules import unconvertible
from ampguard.integrations.sinks import wandb_init_kwargs


def test_ag355_skips_a_patch_embedding_convolution_but_names_a_1x1_one():
    model = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=4, stride=4),  # a ViT's patch embedding
        nn.Conv2d(16, 16, kernel_size=1),  # a Linear over the channels
    )
    found = unconvertible(model)
    assert list(found) == ["1"]
    assert "1x1" in found["1"]["fix"]


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_block_scaled_precision_on_gpt2_names_conv1d_and_the_fix(precision):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.lm_head = nn.Identity()  # only Conv1D matmuls left: none eligible
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ag.Guard(model, opt, precision=precision)
    text = " ".join(str(w.message) for w in caught if "no Linear layer" in str(w.message))
    assert "c_attn" in text and "c_fc" in text
    assert "ag.conv1d_to_linear" in text


def test_wandb_sink_keeps_wandb_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))
    assert "dir" not in wandb_init_kwargs(tmp_path / "run", {"project": "p"})
    monkeypatch.delenv("WANDB_DIR")
    assert wandb_init_kwargs(tmp_path / "run", {})["dir"] == str(tmp_path / "run")
    assert wandb_init_kwargs(tmp_path / "run", {"dir": "x"})["dir"] == "x"


def test_an_fp16_loop_without_a_scaler_is_warned_at_attach(tmp_path):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="no loss scaler"):
        handle = ag.watch(None, model, opt, tmp_path / "run", precision="fp16")
    handle.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 without a scaler is right: no warning
        ag.watch(None, model, opt, tmp_path / "bf16", precision="bf16").close()
