"""Guard vs a bare ``torch.amp.GradScaler`` loop: step-time ratio and host syncs per step.

Run: ``python benchmarks/bench_guard.py [--width 256] [--rounds 15]``. Both loops train the same
model in fp16 autocast on the CPU in the same process; rounds are interleaved and the median step
time of each is compared. Prints one table row per optimizer setting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import count_syncs, interleaved_medians  # noqa: E402

import ampguard as ag  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))


def _bare_step(model, opt, scaler, x, y, clip):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _guard_step(model, guard, x, y):
    with guard.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()


def bench(width: int, depth: int, batch: int, rounds: int, steps: int, fused: bool,
          clip: bool) -> dict[str, float]:
    x, y = torch.randn(batch, width), torch.randn(batch, 8)
    m1, m2 = _model(width, depth), _model(width, depth)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-4, fused=fused)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-4, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    guard = ag.Guard(m2, o2, precision="fp16", clip_grad_norm=1.0 if clip else None)
    loops = {
        "bare": lambda: _bare_step(m1, o1, scaler, x, y, clip),
        "guard": lambda: _guard_step(m2, guard, x, y),
    }
    for step in loops.values():  # warm-up
        for _ in range(5):
            step()
    med = interleaved_medians(loops, rounds, steps)
    return {
        "bare_ms": med["bare"] * 1e3, "guard_ms": med["guard"] * 1e3,
        "ratio": med["guard"] / med["bare"],
        "bare_syncs": count_syncs(loops["bare"], 20),
        "guard_syncs": count_syncs(loops["guard"], 20),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, width {args.width} x depth {args.depth}, batch {args.batch}")
    print(f"{'setting':24} {'bare ms':>8} {'guard ms':>9} {'ratio':>6} {'syncs bare/guard':>17}")
    for fused in (False, True):
        for clip in (False, True):
            r = bench(args.width, args.depth, args.batch, args.rounds, args.steps, fused, clip)
            name = f"AdamW{' fused' if fused else ''}{' + clip' if clip else ''}"
            print(f"{name:24} {r['bare_ms']:8.3f} {r['guard_ms']:9.3f} {r['ratio']:6.3f} "
                  f"{r['bare_syncs']:8.1f}/{r['guard_syncs']:.1f}")


if __name__ == "__main__":
    main()
