"""Forensics cost: ``locate``/``coverage`` per call and an armed Guard step, vs a bare torch step.

Run: ``python benchmarks/bench_forensics.py [--width 256] [--depth 4] [--batch 128]``. Every
figure is a ratio to the median step of a bare ``autocast`` + ``torch.amp.GradScaler`` loop
timed in the same process, rounds interleaved:

- ``guard, forensics on, unarmed``: ``Guard(forensics=True)`` between overflows (goal ~1.0x);
- ``guard, forensics armed``: the same Guard while it traces every op (goal <= 1.6x);
- ``transformers DebugUnderflowOverflow``: the bare loop with HF's forward-hook detector
  (only if ``transformers`` is installed; it checks forward activations only);
- ``ag.locate`` and ``ag.coverage``: one call each on the same model and batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import bare_step, count_syncs, guard_step, interleaved_medians, mlp  # noqa: E402

import ampguard as ag  # noqa: E402
from ampguard.forensics._optrace import HUNT_BATCH  # noqa: E402
from ampguard.guard._forensics import ARM_STEPS  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    return mlp(width, depth, torch.nn.GELU, layer_norm=True)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _bare(width: int, depth: int, batch, hf: bool = False):
    model = _model(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    if hf:
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(model)  # its hooks cannot be removed: a model of its own
    return partial(bare_step, model, opt, scaler, *batch)


def _guarded(width: int, depth: int, batch, armed: bool):
    model = _model(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = ag.Guard(model, opt, precision="fp16", forensics=True)

    def step() -> None:
        if armed:
            guard._forensics._armed = ARM_STEPS  # stay armed: every op traced
        guard_step(model, guard, *batch)

    return step


def _per_call(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _has_transformers() -> bool:
    try:
        import transformers.debug_utils  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, 8))
    loops = {
        "bare torch step": _bare(args.width, args.depth, batch),
        "guard, forensics on, unarmed": _guarded(args.width, args.depth, batch, armed=False),
        "guard, forensics armed": _guarded(args.width, args.depth, batch, armed=True),
    }
    if _has_transformers():
        loops["transformers DebugUnderflowOverflow"] = _bare(args.width, args.depth, batch, True)
    med = interleaved_medians(loops, args.rounds, args.steps, warmup=3)
    base = med["bare torch step"]
    model = _model(args.width, args.depth)
    calls = {
        "ag.locate (one call)": lambda: ag.locate(model, _loss, batch),
        "ag.coverage (one call)": lambda: ag.coverage(model, _loss, batch),
    }
    for fn in calls.values():
        fn()
    timed = {**med, **{name: _per_call(fn, args.rounds) for name, fn in calls.items()}}
    syncs = count_syncs(loops["guard, forensics armed"], 3)
    print(
        f"torch {torch.__version__}, MLP width {args.width} x depth {args.depth}, "
        f"batch {args.batch}, fp16 autocast on CPU, {args.threads} thread(s)"
    )
    print(f"{'':40} {'ms':>9} {'x bare step':>12}")
    for name, seconds in timed.items():
        print(f"{name:40} {seconds * 1e3:9.2f} {seconds / base:12.2f}")
    print(
        f"host syncs per armed step: {syncs:.0f} (one read per {HUNT_BATCH} fp16 ops until the "
        "first non-finite one and at the end of each pass, plus one read of the trace)"
    )


if __name__ == "__main__":
    main()
