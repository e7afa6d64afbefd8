"""The fault zoo's triage cost on a real model: planted faults and a model bug in HF GPT-2.

``fault_zoo.py --gpt2 N``: ``N`` faults planted (``ampguard.testing.inject_fault``) in the
``Conv1D`` layers of ``transformers.GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4,
n_positions=64, vocab_size=512))`` (dropout 0.1 on, replayed with the step's RNG), batch 4 x 64,
bf16; every bit class x forward/backward x transient/persistent; plus an inf weight (model or
data) and clean steps triaged in full (silent: ``locate`` runs). Its steps take ~15 ms on CPU, so
the per-module fixed costs that dominate the MLP's sub-millisecond steps weigh less here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from _fault_inject import judged

from ampguard.testing import BITS

__all__ = ["run_gpt2"]

_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _build(seed: int) -> tuple[torch.nn.Module, Callable[..., Any], tuple[torch.Tensor]]:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(seed))
    return model, (lambda m, b: m(input_ids=b[0], labels=b[0]).loss), (ids,)


def _events(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cells = [(b, ph, pers) for b in BITS for ph in ("forward", "backward") for pers in (0, 1)]
    return [
        {
            "bit": cells[i % len(cells)][0],
            "phase": cells[i % len(cells)][1],
            "persistent": bool(cells[i % len(cells)][2]),
            "module": f"transformer.h.{rng.randrange(2)}.{rng.choice(_LAYERS)}",
            "op": None,
            "element": rng.randrange(4096),
            "seed": rng.randrange(10**6),
        }
        for i in range(n)
    ]


def run_gpt2(n: int, judge: Callable[..., dict[str, Any]], clean: int = 2) -> list[dict[str, Any]]:
    """``n`` planted faults, one inf weight and ``clean`` clean steps on HF GPT-2, each judged
    by ``judge(model, loss_fn, batch, precision, scale)`` (the zoo's ``_judge``)."""
    rows = []
    for e in _events(n, 2):
        model, loss_fn, batch = _build(e["seed"] % 5)
        op = "aten.addmm" if e["phase"] == "forward" else "aten.mm"
        rows.append(judged(model, loss_fn, batch, e, judge, op))
    model, loss_fn, batch = _build(0)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
    res = judge(model, loss_fn, batch, "bf16", 1.0)
    rows.append({"case": "inf_weight", "want": "model_or_data", **res})
    for i in range(clean):
        model, loss_fn, batch = _build(10 + i)
        res = judge(model, loss_fn, batch, "bf16", 1.0)
        rows.append({"case": f"clean_{i}", "want": "not_fault (silent)", **res})
    return rows
