"""Cost of ``Guard(restore_buffers_on_skip=True)`` (the default) on a model with BatchNorm.

Run: ``python benchmarks/bench_buffers.py [--width 256] [--depth 4] [--rounds 15]``. Two Guards
train identical BatchNorm MLPs in fp16 autocast on the CPU, one with the buffer snapshot on and
one with it off; rounds are interleaved and the median CPU time per step compared (goal:
<= 1.01x); the snapshot is also timed alone, which a shared machine's noise does not blur.
The snapshot is one multi-tensor copy of the buffers per window (BatchNorm's running mean and
variance and its counter: 2 * width + 1 values per layer, against width**2 weights); a skipped
window adds one copy back (Python-stepped optimizers) or one ``where`` per buffer (fused ones).
A third loop times the stagnation probe's cost on bf16 weights (sampled every 50 windows).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import guard_step, interleaved_rounds, medians  # noqa: E402

import ampguard as ag  # noqa: E402
from ampguard.core.buffer_restore import BufferSnapshot  # noqa: E402


def bn_mlp(width: int, depth: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8)).to(dtype)


def bench(width: int, depth: int, batch: int, rounds: int, steps: int, fused: bool) -> dict:
    x, y = torch.randn(batch, width), torch.randn(batch, 8)
    loops = {}
    for name, restore in (("off", False), ("on", True)):
        model = bn_mlp(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        guard = ag.Guard(model, opt, precision="fp16", restore_buffers_on_skip=restore)
        loops[name] = partial(guard_step, model, guard, x, y)
    med = medians(interleaved_rounds(loops, rounds, steps, warmup=5), "cpu")
    return {"off_ms": med["off"] * 1e3, "on_ms": med["on"] * 1e3, "ratio": med["on"] / med["off"]}


def snapshot_us(width: int, depth: int, calls: int = 2000) -> tuple[float, float, float]:
    """Microseconds per snapshot (take), per host-known restore and per lazy (device-flag)
    restore, timed alone (CPU time): the feature's per-window cost, free of the step-time noise
    of a shared machine."""
    snap = BufferSnapshot.of(bn_mlp(width, depth))
    assert snap is not None
    t0 = time.process_time()
    for i in range(calls):
        snap.take(i)
    take = (time.process_time() - t0) / calls * 1e6
    t0 = time.process_time()
    for _ in range(calls):
        snap.restore(calls - 1)
    back = (time.process_time() - t0) / calls * 1e6
    skipped = torch.zeros((), dtype=torch.bool)
    t0 = time.process_time()
    for _ in range(calls):
        snap.restore_where(calls - 1, skipped)
    return take, back, (time.process_time() - t0) / calls * 1e6


def bench_stagnation(width: int, depth: int, batch: int, rounds: int, steps: int) -> dict:
    """bf16 weights: the probe (on, it watches bf16 weights) vs the same loop with fp32 master
    weights is not a like-for-like comparison, so the probe is timed against itself switched
    off by a sampling interval longer than the run."""
    x, y = torch.randn(batch, width, dtype=torch.bfloat16), torch.randn(batch, 8)
    loops = {}
    for name, every in (("probe_off", 10**9), ("probe_on", 50)):
        model = bn_mlp(width, depth, torch.bfloat16)
        guard = ag.Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision="bf16")
        assert guard.stagnation is not None
        guard.stagnation.every = every
        loops[name] = partial(guard_step, model, guard, x, y)
    med = medians(interleaved_rounds(loops, rounds, steps, warmup=5), "cpu")
    return {
        "off_ms": med["probe_off"] * 1e3,
        "on_ms": med["probe_on"] * 1e3,
        "ratio": med["probe_on"] / med["probe_off"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50, help="steps per round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = (args.width, args.depth, args.batch, args.rounds, args.steps)
    print(f"BatchNorm MLP width={args.width} depth={args.depth} batch={args.batch}, fp16 CPU")
    print(f"{'optimizer':<14}{'restore off ms':>16}{'restore on ms':>16}{'ratio':>8}")
    for fused in (False, True):
        r = bench(*shape, fused)
        label = "AdamW fused" if fused else "AdamW"
        print(f"{label:<14}{r['off_ms']:>16.3f}{r['on_ms']:>16.3f}{r['ratio']:>8.3f}")
    take, back, lazy = snapshot_us(args.width, args.depth)
    print(
        f"alone: take {take:.1f} us per window ({take / 1e3 / r['off_ms']:.2%} of the fused "
        f"step), restore {back:.1f} us per skipped window, lazy restore (fused) {lazy:.1f} us "
        f"per window ({(take + lazy) / 1e3 / r['off_ms']:.2%} with the take)"
    )
    r = bench_stagnation(*shape)
    print(
        f"{'bf16 probe':<14}{r['off_ms']:>16.3f}{r['on_ms']:>16.3f}{r['ratio']:>8.3f}"
        "   (stagnation probe every 50 windows vs never)"
    )


if __name__ == "__main__":
    main()
