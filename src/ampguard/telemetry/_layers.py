"""Parameter layout for telemetry: layers (parameters grouped by owning module) and range chunks.

Done once when telemetry attaches, so the per-step work is a fixed number of multi-tensor ops
whatever the number of parameter tensors.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ampguard.telemetry.source import TelemetrySource

__all__ = ["Layout", "Chunk", "build_layout", "plan_chunks", "run_meta", "local"]

_ROOT = "(root)"
_OUTSIDE = "(not in model)"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


@dataclass
class Layout:
    """Parameters in layer order with their layer index, and per-layer names and sizes."""

    names: list[str]
    params: list[torch.Tensor]
    layer_of: list[int]  # layer index of each parameter in ``params``
    numel: list[int]  # elements per layer
    tensors: list[int]  # parameter tensors per layer


@dataclass
class Chunk:
    """A slice of the parameters whose gradients are flattened together on range steps.

    ``items``: (parameter index, start, end) element ranges; ``lengths``/``layer``: device tensors
    with each item's length and layer index, for segment reductions without Python loops.
    """

    items: list[tuple[int, int, int]]
    lengths: torch.Tensor
    layer: torch.Tensor
    total: int


def build_layout(model: torch.nn.Module, params: list[torch.Tensor]) -> Layout:
    """Group ``params`` (a Guard's optimizer parameters) by the module that directly owns them."""
    owner: dict[int, str] = {}
    order: list[str] = []
    for mname, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) not in owner:
                owner[id(p)] = mname or _ROOT
                if owner[id(p)] not in order:
                    order.append(owner[id(p)])
    seen: set[int] = set()
    by_layer: dict[str, list[torch.Tensor]] = {}
    for p in params:
        if id(p) in seen or local(p).numel() == 0:
            continue
        seen.add(id(p))
        by_layer.setdefault(owner.get(id(p), _OUTSIDE), []).append(p)
    names = [n for n in [*order, _OUTSIDE] if n in by_layer]
    flat: list[torch.Tensor] = []
    layer_of: list[int] = []
    for i, name in enumerate(names):
        flat.extend(by_layer[name])
        layer_of.extend([i] * len(by_layer[name]))
    return Layout(
        names=names,
        params=flat,
        layer_of=layer_of,
        numel=[sum(local(p).numel() for p in by_layer[n]) for n in names],
        tensors=[len(by_layer[n]) for n in names],
    )


def plan_chunks(layout: Layout, device: torch.device, max_elements: int) -> list[Chunk]:
    """Split the layer-ordered parameters (their local shards) into chunks of at most
    ``max_elements`` elements."""
    chunks: list[Chunk] = []
    items: list[tuple[int, int, int]] = []
    size = 0

    def close() -> None:
        nonlocal items, size
        if items:
            lengths = torch.tensor([b - a for _, a, b in items], dtype=torch.int64, device=device)
            layer = torch.tensor(
                [layout.layer_of[i] for i, _, _ in items], dtype=torch.int64, device=device
            )
            chunks.append(Chunk(items, lengths, layer, size))
        items, size = [], 0

    for i, p in enumerate(layout.params):
        n = local(p).numel()
        for start in range(0, n, max_elements):
            end = min(n, start + max_elements)
            if size + end - start > max_elements:
                close()
            items.append((i, start, end))
            size += end - start
    close()
    return chunks


def run_meta(
    source: TelemetrySource, layout: Layout, telemetry_config: dict[str, Any]
) -> dict[str, Any]:
    """The ``meta.json`` content of a new run of ``source`` (a Guard or a watched loop)."""
    from ampguard._version import __version__

    model = source.model
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "format": 1,
        "ampguard_version": __version__,
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": str(source.device),
        "model": {
            "class": type(model).__name__,
            "parameters": n_params,
            "trainable_tensors": len(layout.params),
            "layers": len(layout.names),
        },
        "layers": {"names": layout.names, "numel": layout.numel, "tensors": layout.tensors},
        "precision": source.precision,
        "requested_precision": source.requested_precision,
        "scaler": source.scaler_config.to_dict(),
        "guard": {
            "accumulation_steps": source.accumulation_steps,
            "clip_grad_norm": source.clip_grad_norm,
            "optimizers": [type(o).__name__ for o in source.optimizers],
            "contain_nonfinite_microbatches": source.contain_nonfinite_microbatches,
        },
        "telemetry": telemetry_config,
        "resumes": [],
    }
