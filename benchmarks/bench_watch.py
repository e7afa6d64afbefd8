"""Attach-mode overhead: the same GradScaler loop bare and under ``ag.watch``, and host syncs.

Run: ``python benchmarks/bench_watch.py [--rounds 15] [--steps 50] [--quick]``. Each loop trains
its own copy of the same MLP in fp16 autocast on the CPU, in one process; rounds are interleaved
(bare, watched, bare, ...) and each loop's median step time is divided by its bare twin's. Rows:
plain (foreach) AdamW and fused AdamW, each with ``ag.watch`` and a default ``ag.Telemetry``
(grad stats every 10 steps, range stats every 100, flush every 100): with the flight recorder
and spike detector (the default, ``on_spike="warn"``), without them (``flight_recorder=False,
on_spike=None``), and with ``on_spike="skip"`` (the flag folded into the GradScaler's
``found_inf``). Host syncs per step are
counted with a TorchDispatchMode on ``aten._local_scalar_dense`` (plus ``Tensor.tolist``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import bare_step, interleaved_medians, mlp, syncs_per_step  # noqa: E402

import ampguard as ag  # noqa: E402


def loop(
    width: int,
    depth: int,
    fused: bool,
    run_dir: Path | None,
    x: torch.Tensor,
    y: torch.Tensor,
    **options: Any,
) -> Callable[[], None]:
    """One training step of the user's loop; under ag.watch when ``run_dir`` is given."""
    model = mlp(width, depth, torch.nn.GELU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    if run_dir is not None:
        ag.watch(scaler, model, opt, telemetry=run_dir, **options)
    return partial(bare_step, model, opt, scaler, x, y)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=50, help="steps per round (default 50)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 20 steps")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds, steps = (3, 20) if args.quick else (args.rounds, args.steps)
    root = Path(tempfile.mkdtemp(prefix="ampguard-bench-watch-"))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 8)
    loops: dict[str, Callable[[], None]] = {}
    variants = {
        "watch": {},
        "no recorder": {"flight_recorder": False, "on_spike": None},
        "skip": {"on_spike": "skip"},
    }
    for kind, fused in (("plain", False), ("fused", True)):
        loops[f"bare {kind}"] = loop(args.width, args.depth, fused, None, x, y)
        for name, options in variants.items():
            folder = root / f"{kind}-{name.replace(' ', '-')}"
            loops[f"{name} {kind}"] = loop(args.width, args.depth, fused, folder, x, y, **options)
    med = interleaved_medians(loops, rounds, steps, warmup=steps)  # warm-up: first flush too
    print(
        f"MLP width {args.width} depth {args.depth} batch {args.batch}, fp16 autocast on CPU; "
        f"{rounds} interleaved rounds x {steps} steps, median"
    )
    for kind in ("plain", "fused"):
        bare = med[f"bare {kind}"]
        n = 200
        b = syncs_per_step(loops[f"bare {kind}"], n)
        for name in variants:
            watched = med[f"{name} {kind}"]
            w = syncs_per_step(loops[f"{name} {kind}"], n)
            extra = sum(wi - bi for wi, bi in zip(w, b, strict=True))
            print(
                f"  {kind:5s} AdamW, {name:11s}: bare {bare * 1e3:.2f} ms/step, watched "
                f"{watched * 1e3:.2f} ms/step, ratio {watched / bare:.3f}x; host syncs/step bare "
                f"{sum(b) / n:.2f}, watched {sum(w) / n:.2f} (extra over {n} steps: {extra}, "
                "at flushes)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
