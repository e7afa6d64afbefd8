"""Guard vs a bare ``torch.amp.GradScaler`` loop: step-time ratio and host syncs per step.

Run: ``python benchmarks/bench_guard.py [--width 256] [--rounds 15]``. Both loops train the same
model in fp16 autocast on the CPU in the same process; rounds are interleaved and the median step
time of each is compared. Prints one table row per optimizer setting.

A second table times the bf16 path: a bare bf16 autocast loop (no scaler) against the Guard with
its non-finite check on (``skip_nonfinite=True``, the default: one multi-tensor check per window,
one host sync, none with fused AdamW) and off (``skip_nonfinite=False``), three loops interleaved.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import bare_step, count_syncs, guard_step, interleaved_medians, mlp  # noqa: E402

import ampguard as ag  # noqa: E402


def bench(
    width: int, depth: int, batch: int, rounds: int, steps: int, fused: bool, clip: bool
) -> dict[str, float]:
    x, y = torch.randn(batch, width), torch.randn(batch, 8)
    m1, m2 = mlp(width, depth), mlp(width, depth)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-4, fused=fused)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-4, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    guard = ag.Guard(m2, o2, precision="fp16", clip_grad_norm=1.0 if clip else None)
    loops = {
        "bare": partial(bare_step, m1, o1, scaler, x, y, clip),
        "guard": partial(guard_step, m2, guard, x, y),
    }
    med = interleaved_medians(loops, rounds, steps, warmup=5)
    return {
        "bare_ms": med["bare"] * 1e3,
        "guard_ms": med["guard"] * 1e3,
        "ratio": med["guard"] / med["bare"],
        "bare_syncs": count_syncs(loops["bare"], 20),
        "guard_syncs": count_syncs(loops["guard"], 20),
    }


def bare_bf16_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: bool
) -> None:
    """One step of the plain bf16 loop: autocast, backward, (clip), step; no scaler, no check."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_bf16(
    width: int, depth: int, batch: int, rounds: int, steps: int, fused: bool, clip: bool
) -> dict[str, float]:
    x, y = torch.randn(batch, width), torch.randn(batch, 8)
    models = [mlp(width, depth) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for m in models]
    kw = {"precision": "bf16", "clip_grad_norm": 1.0 if clip else None}
    checked = ag.Guard(models[1], opts[1], skip_nonfinite=True, **kw)
    unchecked = ag.Guard(models[2], opts[2], skip_nonfinite=False, **kw)
    loops = {
        "bare": partial(bare_bf16_step, models[0], opts[0], x, y, clip),
        "on": partial(guard_step, models[1], checked, x, y),
        "off": partial(guard_step, models[2], unchecked, x, y),
    }
    med = interleaved_medians(loops, rounds, steps, warmup=5)
    return {
        "bare_ms": med["bare"] * 1e3,
        "on": med["on"] / med["bare"],
        "off": med["off"] / med["bare"],
        "on_syncs": count_syncs(loops["on"], 20),
        "off_syncs": count_syncs(loops["off"], 20),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16-only", action="store_true", help="only the bf16 table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, width {args.width} x depth {args.depth}, batch {args.batch}")
    if not args.bf16_only:
        print(
            f"{'setting':24} {'bare ms':>8} {'guard ms':>9} {'ratio':>6} {'syncs bare/guard':>17}"
        )
    for fused in () if args.bf16_only else (False, True):
        for clip in (False, True):
            r = bench(args.width, args.depth, args.batch, args.rounds, args.steps, fused, clip)
            name = f"AdamW{' fused' if fused else ''}{' + clip' if clip else ''}"
            print(
                f"{name:24} {r['bare_ms']:8.3f} {r['guard_ms']:9.3f} {r['ratio']:6.3f} "
                f"{r['bare_syncs']:8.1f}/{r['guard_syncs']:.1f}"
            )
    print("\nbf16 (no scaler): Guard / bare bf16 loop, non-finite check on vs off")
    print(f"{'setting':24} {'bare ms':>8} {'check on':>9} {'check off':>10} {'syncs on/off':>13}")
    for fused in (False, True):
        for clip in (False, True):
            r = bench_bf16(args.width, args.depth, args.batch, args.rounds, args.steps, fused, clip)
            name = f"AdamW{' fused' if fused else ''}{' + clip' if clip else ''}"
            print(
                f"{name:24} {r['bare_ms']:8.3f} {r['on']:9.3f} {r['off']:10.3f} "
                f"{r['on_syncs']:8.1f}/{r['off_syncs']:.1f}"
            )


if __name__ == "__main__":
    main()
