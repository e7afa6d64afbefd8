"""Cost of the distributed Guard (found_inf consensus + cross-rank audit) vs plain DDP + GradScaler.

Run: ``python benchmarks/bench_distributed.py [--world 2] [--width 256] [--rounds 15]``. Spawns
``--world`` CPU ranks (gloo). Every loop trains its own copy of the same DDP model in fp16
autocast; rounds are interleaved and rank 0 prints the median step time of each loop and its ratio
to the plain DDP + ``torch.amp.GradScaler`` loop measured in the same run:

- ``guard, not distributed``: ``Guard(..., process_group="local")``: the Guard without consensus
  or audit (the single-process Guard's own cost, for reference);
- ``guard, audit every 100``: the default. Under plain DDP no found_inf consensus runs (every
  rank's own check agrees: the averaged gradients carry a non-finite value to every rank); the
  audit (one all-reduce of ``world * 11`` int64 and one host sync) every 100 steps;
- ``guard + comm hook, audit 100``: the same with a DDP comm hook registered (torch's own
  ``allreduce_hook``, which reduces exactly as DDP does), so the consensus runs: one all-reduce of
  ``world * 2`` floats per step, what every path that keeps it (FSDP2, hooks, containment) pays;
- ``guard, audit every step``: an upper bound on what the audit costs when it runs.

Wall time on a shared CPU includes the time a rank waits in a collective for a descheduled peer;
the CPU-time columns leave that out. Host syncs per step are counted on rank 0
(``.item()``/``tolist``), as in bench_guard.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    bare_step,
    count_syncs,
    guard_step,
    interleaved_rounds,
    medians,
    mlp,
)

import ampguard as ag  # noqa: E402


def _model(width: int, depth: int) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(mlp(width, depth))


def _loops(args: argparse.Namespace) -> dict:
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 8)
    loops = {}
    bare = _model(args.width, args.depth)
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    loops["ddp + GradScaler"] = partial(bare_step, bare, bare_opt, scaler, x, y)
    settings = {
        "guard, not distributed": {"process_group": "local"},
        "guard, audit every 100": {"audit_every": 100},
        "guard, audit every step": {"audit_every": 1},
    }
    settings["guard + comm hook, audit 100"] = {"audit_every": 100, "hook": True}
    for name, kwargs in settings.items():
        model = _model(args.width, args.depth)
        if kwargs.pop("hook", False):
            model.register_comm_hook(None, allreduce_hook)
        guard = ag.Guard(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision="fp16", **kwargs
        )
        loops[name] = partial(guard_step, model, guard, x, y)
    return loops


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        loops = _loops(args)
        # Warm-up and rounds make the same calls on every rank (collectives). CPU time leaves
        # out the time a rank waits in a collective for the other rank, which on a shared,
        # oversubscribed CPU is mostly the other processes' doing.
        per_round = interleaved_rounds(loops, args.rounds, args.steps, warmup=10)
        med, cpu = medians(per_round, "wall"), medians(per_round, "cpu")
        syncs = {name: count_syncs(step, 100) for name, step in loops.items()}
        lone = _lone_allreduce_us(world)
        if rank == 0:
            _print(med, cpu, syncs, lone, world, args)
    finally:
        dist.destroy_process_group()


def _lone_allreduce_us(world: int, n: int = 500) -> float:
    buf = torch.zeros(world, 2)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return (time.perf_counter() - t0) / n * 1e6


def _print(
    med: dict, cpu: dict, syncs: dict, lone: float, world: int, args: argparse.Namespace
) -> None:
    base, cbase = med["ddp + GradScaler"], cpu["ddp + GradScaler"]
    print(
        f"torch {torch.__version__}, {world} CPU ranks (gloo), width {args.width} x depth "
        f"{args.depth}, batch {args.batch} per rank, {args.threads} thread(s) per rank"
    )
    print(f"{'loop':30} {'wall ms':>8} {'ratio':>6} {'cpu ms':>7} {'ratio':>6} {'syncs':>6}")
    for name, t in med.items():
        print(
            f"{name:30} {t * 1e3:8.3f} {t / base:6.3f} {cpu[name] * 1e3:7.3f} "
            f"{cpu[name] / cbase:6.3f} {syncs[name]:6.2f}"
        )
    extra = med["guard, audit every 100"] - med["guard, not distributed"]
    print(
        f"audit/100 (no consensus under plain DDP): {extra * 1e6:+.0f} us/step wall over the "
        f"non-distributed Guard; a lone {world}x2-float all_reduce takes {lone:.0f} us here"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mp.spawn(_rank, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
