"""The models and the task of the planted-spike zoo (``benchmarks/spike_zoo.py``).

- :class:`TinyGPT`: a decoder of ``depth`` blocks (token and position embeddings, causal
  attention with separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, an MLP ``fc`` /
  ``proj``, LayerNorms, ``lm_head``);
- :func:`gpt2`: Hugging Face's ``GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4,
  n_positions=64, vocab_size=512))``, real HF code with its dropout (0.1) on;
- :class:`Task`: a fixed random second-order chain over ``VOCAB`` tokens (the next token is set
  by the last two, so the models must attend to the previous position).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BATCH", "SEQ", "VOCAB", "Task", "TinyGPT", "gpt2", "groups", "loss_fn"]

VOCAB, SEQ, BATCH = 16, 16, 8


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc", nn.Linear(d, 4 * d))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("proj", nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 32, depth: int = 1, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2() -> nn.Module:
    """The real HF GPT-2 of the zoo (2 layers, width 128, 4 heads, 512-token vocabulary)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512)
    return transformers.GPT2LMHeadModel(cfg)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy (a TinyGPT returns logits, an HF model an output with them)."""
    tokens, targets = batch
    out = model(tokens)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Task:
    """A fixed random second-order chain: token ``i + 1`` is ``next[token i - 1, token i]``."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=g)

    def batch(self, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, VOCAB, (BATCH, 2), generator=g)
        for i in range(1, SEQ):
            seq[:, i + 1] = self.next[seq[:, i - 1], seq[:, i]]
        return seq[:, :-1], seq[:, 1:]


def groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """One AdamW param group per module (named), so that an LR can be planted in one layer."""
    by_module: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        by_module.setdefault(name.rsplit(".", 1)[0] if "." in name else name, []).append(p)
    return [{"params": ps, "lr": lr, "name": m} for m, ps in by_module.items()]
