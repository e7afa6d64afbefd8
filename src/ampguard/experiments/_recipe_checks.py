"""The argument checks of ``ag.recipe_search``: each bad argument is one ``ValueError`` /
``TypeError`` naming it, before any step (an empty batch list, a budget that leaves fewer than
6 training steps, seeds that are not two different ints, a factory that is not callable, returns
no Module, the same object twice, or different models under the same seed). Cost: two calls of
the factory, no device work beyond what building the model does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ampguard._util.checks import check_finite

__all__ = ["_check_batches", "_check_budget", "_check_factory", "_check_seeds"]


def _check_batches(batches: Any) -> list[Any]:
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ValueError(
            "batches must be a non-empty list of batches (loss_fn(model, batch) for each), got "
            + ("an empty list" if isinstance(batches, (list, tuple)) else type(batches).__name__)
        )
    return list(batches)


def _check_budget(budget: Any, n: int) -> int:
    check_finite("budget", budget, positive=True)
    if budget > 1:
        raise ValueError(f"budget must be a share of one run's steps in (0, 1], got {budget!r}")
    total = math.floor(budget * n)
    if total < 6:
        raise ValueError(
            f"budget={budget!r} of {n} batches is {total} training steps: the search needs at "
            "least 6 (two bf16 branches and one recipe branch of 2 steps); give more batches "
            "or a larger budget"
        )
    return total


def _check_seeds(seeds: Any) -> tuple[int, int]:
    if (
        not isinstance(seeds, (tuple, list))
        or len(seeds) != 2
        or not all(isinstance(s, int) for s in seeds)
        or seeds[0] == seeds[1]
    ):
        raise ValueError(f"seeds must be two different ints (bf16's two runs), got {seeds!r}")
    return int(seeds[0]), int(seeds[1])


def _check_factory(factory: Any, seed: int) -> nn.Module:
    """Two calls under the same seed must build the same model (the branches' one start)."""
    if not callable(factory):
        raise TypeError(f"model_factory must be callable, got {type(factory).__name__}")
    torch.manual_seed(seed)
    a = factory()
    torch.manual_seed(seed)
    b = factory()
    if not isinstance(a, nn.Module):
        raise TypeError(f"model_factory must return a torch.nn.Module, got {type(a).__name__}")
    if a is b:
        raise ValueError(
            "model_factory returned the same model object on two calls: it must build a new "
            "model each call (every branch starts from a fresh copy)"
        )
    sa, sb = a.state_dict(), b.state_dict()
    if list(sa) != list(sb) or any(
        sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k]) for k in sa
    ):
        diff = next(
            (k for k in sa if k not in sb or sa[k].shape != sb[k].shape
             or not torch.equal(sa[k], sb[k])),
            next(iter(set(sb) - set(sa)), "?"),
        )  # fmt: skip
        raise ValueError(
            f"model_factory returned different models on two calls under the same seed "
            f"({diff!r} differs): the search compares branches from one start, so the factory "
            "must build the same model each call (seed inside it or build deterministically)"
        )
    if not any(isinstance(m, nn.Linear) for m in a.modules()):
        raise ValueError("model_factory's model has no nn.Linear layer: nothing to search")
    return a
