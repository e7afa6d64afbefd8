"""The flight recorder's cost: Guard with the recorder and spike detection (the default,
N=256, snapshots every 100 windows) against the same Guard without them and the bare torch bf16
loop, in the same run, rounds interleaved; and the host syncs of each (the recorder adds none).

Run: ``python benchmarks/bench_recorder.py [--width 256] [--depth 4] [--rounds 15]``.
``--device cuda`` runs it on a GPU (there the ring and detector ops are kernel launches).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import count_syncs, interleaved_medians, mlp  # noqa: E402

import ampguard as ag  # noqa: E402


def bare_step(model, opt, x, y, device_type: str) -> None:
    """The plain bf16 loop: autocast, backward, step, zero_grad (no check, no scaler)."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def guard_step(model, guard, x, y) -> None:
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()


def bench(args: argparse.Namespace, fused: bool) -> dict[str, float]:
    dev = torch.device(args.device)
    x, y = torch.randn(args.batch, args.width, device=dev), torch.randn(args.batch, 8, device=dev)
    models = [mlp(args.width, args.depth).to(dev) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for m in models]
    on = ag.Guard(models[1], opts[1], precision="bf16", flight_recorder=args.capacity)
    off = ag.Guard(models[2], opts[2], precision="bf16", flight_recorder=False, on_spike=None)
    loops = {
        "bare": partial(bare_step, models[0], opts[0], x, y, dev.type),
        "recorder": partial(guard_step, models[1], on, x, y),
        "no recorder": partial(guard_step, models[2], off, x, y),
    }
    if dev.type == "cuda":
        loops = {k: _synced(v) for k, v in loops.items()}
    med = interleaved_medians(loops, args.rounds, args.steps, warmup=5)
    return {
        "bare_ms": med["bare"] * 1e3,
        "on": med["recorder"] / med["bare"],
        "off": med["no recorder"] / med["bare"],
        "own": med["recorder"] / med["no recorder"],
        "syncs_bare": count_syncs(loops["bare"], 20) if dev.type == "cpu" else float("nan"),
        "syncs_on": count_syncs(loops["recorder"], 20) if dev.type == "cpu" else float("nan"),
        "syncs_off": count_syncs(loops["no recorder"], 20) if dev.type == "cpu" else float("nan"),
        "snapshot_mb": on.flight_recorder.memory()["snapshots"] / 2**20,
        "ring_kb": on.flight_recorder.memory()["ring"] / 2**10,
    }


def _synced(fn):
    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.device}, width {args.width} x depth {args.depth}, "
        f"batch {args.batch}, flight_recorder={args.capacity}"
    )
    print(
        f"{'optimizer':12} {'bare ms':>8} {'recorder':>9} {'no rec.':>8} {'own':>7} "
        f"{'syncs bare/rec/no':>18} {'ring KB':>8} {'snap MB':>8}"
    )
    for fused in (False, True):
        r = bench(args, fused)
        name = "AdamW fused" if fused else "AdamW"
        print(
            f"{name:12} {r['bare_ms']:8.3f} {r['on']:9.3f} {r['off']:8.3f} {r['own']:7.3f} "
            f"{r['syncs_bare']:6.1f}/{r['syncs_on']:.1f}/{r['syncs_off']:.1f}      "
            f"{r['ring_kb']:8.1f} {r['snapshot_mb']:8.2f}"
        )


if __name__ == "__main__":
    main()
