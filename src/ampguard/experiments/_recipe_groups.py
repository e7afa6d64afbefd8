"""Layer groups for ``ag.recipe_search``: the Linear layers that read the same activation.

Layers fed the same tensor (the q/k/v projections of a block, a SwiGLU's gate and up) see the
same outlier features, so a format that fails one of them fails the others; the search promotes
and demotes such a group as one. :func:`groups` traces one forward of a batch (hooks on every
Linear, no gradient) and groups the layers whose input is the same tensor object; a layer that
shares its input with no other is a group of one. :func:`grouped_order` lists the groups in
the order of the plan's risk (a group as risky as its riskiest layer). Cost: one forward, no
host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["groups", "grouped_order"]


def groups(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any
) -> dict[str, tuple[str, ...]]:
    """``{layer: its group}`` (a tuple of layer names in model order) for every Linear."""
    seen: dict[str, int] = {}
    held: list[torch.Tensor] = []  # every input alive until the end: no address reused
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):

            def hook(mod: nn.Module, args: Any, name: str = name) -> None:
                if name not in seen and args and isinstance(args[0], torch.Tensor):
                    held.append(args[0])
                    seen[name] = id(args[0])

            hooks.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    finally:
        for h in hooks:
            h.remove()
    held.clear()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    out: dict[str, tuple[str, ...]] = {}
    for n in names:
        key = seen.get(n)
        out[n] = tuple(o for o in names if key is not None and seen.get(o) == key) or (n,)
    return out


def grouped_order(order: list[str], group_of: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The groups of ``order``'s layers, each once, at the place of its riskiest layer."""
    out: list[tuple[str, ...]] = []
    for n in order:
        g = tuple(o for o in group_of.get(n, (n,)) if o in order) or (n,)
        if g not in out:
            out.append(g)
    return out
