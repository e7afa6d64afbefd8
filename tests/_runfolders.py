"""Hand-written run folders for the schema, fuzz and scale tests (no training: plain files), and
``step_records``, the step records of a run folder as the tests read them back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of ``run_dir``'s ``events.jsonl`` (other kinds, e.g. fp8, left out)."""
    lines = (Path(run_dir) / "events.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "step") == "step"]


LAYERS = ["enc", "a$b^$", "head"]  # legal (add_module("a$b^$", ...)); invalid as math text


def meta(layers: list[str] = LAYERS) -> dict[str, Any]:
    return {
        "format": 1,
        "model": {"class": "Net", "parameters": 100, "trainable_tensors": 6, "layers": len(layers)},
        "layers": {"names": list(layers), "numel": [10] * len(layers)},
        "precision": "fp16",
        "requested_precision": "fp16",
        "scaler": {"init_scale": 1024.0, "min_scale": 1.0, "growth_interval": 20, "dynamic": True},
        "guard": {"accumulation_steps": 1},
        "resumes": [],
    }


def step(
    n: int,
    width: int = len(LAYERS),
    *,
    scale: float = 1024.0,
    applied: bool = True,
    layers: bool = False,
    rng: bool = False,
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "step": n,
        "scale_before": scale,
        "scale": scale if applied else scale / 2,
        "applied": applied,
        "overflow": not applied,
        "collapse": False,
        "dropped": 0,
        "loss": 1.0 / n,
        "precision": "fp16",
    }
    if layers:
        rec["grad_norm"] = 1.0
        rec["layers"] = {"grad_norm": [0.5] * width}
    if rng:
        rec["range"] = {
            k: [0.01] * width
            for k in ("zero_frac", "amax", "headroom_bits", "underflow", "safe_lo", "safe_hi")
        }
        rec["range"]["window"] = [1.0, 4096.0]
    return rec


def steps(n: int, width: int = len(LAYERS)) -> list[dict[str, Any]]:
    return [
        step(i, width, applied=i % 7 != 0, layers=i % 2 == 0, rng=i % 5 == 0)
        for i in range(1, n + 1)
    ]


def write(
    path: Path, records: list[Any], meta_obj: Any = None, raw_lines: list[bytes] = ()
) -> Path:
    """A run folder: ``meta.json`` and ``events.jsonl`` (records as JSON lines, then raw lines)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").write_text(json.dumps(meta() if meta_obj is None else meta_obj))
    with open(path / "events.jsonl", "wb") as fh:
        for rec in records:
            fh.write(json.dumps(rec).encode() + b"\n")
        for line in raw_lines:
            fh.write(line)
    return path


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
