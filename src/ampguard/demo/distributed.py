"""``ampguard demo --distributed ddp|fsdp2``: the demo on several processes, launched by torchrun.

Every rank trains the demo model on its shard of each batch (DDP or FSDP2, gloo on CPU). The
outlier burst lands on the LAST rank's shard only: its gradients overflow, the found_inf consensus
makes every rank skip those steps together, and the overflow origin names that rank. The Guard
audits the ranks every 50 steps and at checkpoint time; rank 0 writes the run log, the checkpoint
metadata and the summary.

The overflow origin is what each rank saw BEFORE the gradient reduction spread one rank's inf to
all: under DDP the non-finite-safe comm hook's per-rank bucket flags; under FSDP2 (whose consensus
sees the gradient shards after the reduce-scatter) :class:`_LocalOrigin`, the windows in which
this rank's own backward produced a non-finite activation gradient.

    torchrun --nproc-per-node 2 -m ampguard demo --distributed ddp
    torchrun --nproc-per-node 2 -m ampguard demo --distributed fsdp2
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ampguard._util.checks import check_int
from ampguard.checkpoint.distributed import save_distributed_checkpoint
from ampguard.core.scaler import ScalerConfig
from ampguard.demo._run import build_model
from ampguard.demo.data import DemoData, make_data
from ampguard.distributed.hooks import register_nonfinite_safe_hook
from ampguard.guard import Guard

__all__ = ["run_distributed_demo", "KINDS"]

KINDS = ("ddp", "fsdp2")


def run_distributed_demo(
    kind: str = "ddp",
    steps: int = 300,
    seed: int = 0,
    out: str | Path = "ampguard-runs/demo",
    precision: str = "fp16",
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train the demo under ``kind`` on every rank; return a summary dict (same on all ranks).

    Initialises the process group from torchrun's environment (gloo) unless one exists.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    check_int("steps", steps)
    owns_group = _init_group()
    try:
        result = _run(kind, steps, seed, Path(out), precision, progress, quiet)
        if owns_group:
            # no rank tears its connections down while a peer's last collective is in flight
            dist.barrier()
        return result
    finally:
        if owns_group:
            dist.destroy_process_group()


def _init_group() -> bool:
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "ampguard demo --distributed runs one process per rank; launch it with torchrun, "
            "e.g.: torchrun --nproc-per-node 2 -m ampguard demo --distributed ddp"
        )
    dist.init_process_group("gloo")
    return True


def _run(
    kind: str, steps: int, seed: int, run_dir: Path, precision: str, progress: bool, quiet: bool
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(seed=seed, steps=steps)
    if data.batch_size % world:
        raise ValueError(
            f"the demo batch of {data.batch_size} rows does not split over "
            f"{world} ranks; use a world size that divides it"
        )
    model = _wrap(build_model(data, seed), kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    guard = Guard(
        model,
        optimizer,
        precision=precision,
        clip_grad_norm=1.0,
        scaler=ScalerConfig(growth_interval=50),
        schedulers=[schedule],
        telemetry=run_dir,
        audit_every=50,
    )
    local = _LocalOrigin(model) if kind == "fsdp2" else None
    loss_before = _eval_loss(model, data)
    started = time.perf_counter()
    skipped = _train(guard, model, data, rank, world, progress and rank == 0, local)
    seconds = time.perf_counter() - started
    checkpoint = run_dir / ("checkpoint.pt" if kind == "ddp" else "checkpoint")
    save_distributed_checkpoint(
        checkpoint,
        model=model,
        optimizer=optimizer,
        guard=guard,
        scheduler=schedule,
        extra={"seed": seed},
    )
    state = guard.distributed
    if state is None:  # not reached: a DDP or fully_shard model always has a topology
        raise RuntimeError("the distributed demo needs an initialised process group")
    summary = state.summary()
    findings = state.findings(guard.steps)
    origin = (
        (summary["hook"] or {}).get("dropped_buckets")
        if local is None
        else local.gather(state.group, state.topology.ranks)
    )
    result = {
        "kind": kind,
        "world_size": world,
        "steps": steps,
        "precision": guard.precision,
        "skipped": skipped,
        "spike_steps": list(data.spike_steps),
        "scale_end": guard.scale,
        "loss_before": loss_before,
        "loss_after": _eval_loss(model, data),
        "seconds": seconds,
        "rank_overflows": summary["rank_overflows"],
        "audits": summary["audits"],
        "origin": origin,
        "findings": [f"{f.code} {f.title}" for f in findings],
        "run_dir": str(run_dir),
        "checkpoint": str(checkpoint),
    }
    guard.close()
    if rank == 0 and not quiet:
        print(_summary(result))
    return result


def _wrap(model: torch.nn.Sequential, kind: str) -> torch.nn.Module:
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        # drop=False: DDP's numerics unchanged; the hook only records which rank's local
        # gradients were non-finite before the all-reduce spread them (the overflow origin)
        register_nonfinite_safe_hook(ddp, drop=False)
        return ddp
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # shards in place and returns ``model`` itself (typed as an FSDPModule)
    return model


class _LocalOrigin:
    """FSDP2's overflow origin: per rank, the windows in which its OWN backward produced a
    non-finite activation gradient (local to the rank: FSDP2 reduces parameter gradients only).

    A forward hook on each Linear adds a hook on its output's gradient. Cost: one ``isfinite``
    reduction per Linear per backward on the device, no host sync; one gather at the end.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        device = next(model.parameters()).device
        self.windows = torch.zeros((), dtype=torch.int64, device=device)
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        self._handles = [
            m.register_forward_hook(self._on_forward)
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        ]

    def _on_forward(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self._bad |= ~torch.isfinite(grad).all()

    def end_window(self) -> None:
        self.windows += self._bad
        self._bad.zero_()

    def gather(self, group: Any, ranks: tuple[int, ...]) -> dict[int, int]:
        """``{global rank: windows}`` on every rank. Cost: one host sync, one gather."""
        for h in self._handles:
            h.remove()
        counts: list[Any] = [None] * len(ranks)
        dist.all_gather_object(counts, int(self.windows), group=group)
        return dict(zip(ranks, counts, strict=True))


def _train(
    guard: Guard,
    model: torch.nn.Module,
    data: DemoData,
    rank: int,
    world: int,
    progress: bool,
    local: _LocalOrigin | None = None,
) -> list[int]:
    from tqdm import tqdm

    rows = data.batch_size // world
    last = rank == world - 1
    skipped: list[int] = []
    bar = tqdm(
        data.batches(),
        total=data.steps,
        disable=not progress,
        desc=f"fp16 training on {world} ranks",
        unit="step",
        leave=False,
    )
    for step, (x, y) in enumerate(bar, start=1):
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        if step in data.spike_steps and not last:
            x = x / data.spike_factor  # the outlier burst hits the last rank's shard only
        with guard.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        if local is not None:
            local.end_window()
        if not guard.step().applied:  # the one host sync per step torch's GradScaler has too
            skipped.append(step)
    return skipped


def _eval_loss(model: torch.nn.Module, data: DemoData) -> float:
    with torch.no_grad():  # every rank runs it: FSDP2's forward gathers the shards
        return float(torch.nn.functional.mse_loss(model(data.eval_x).float(), data.eval_y))


def _summary(r: dict[str, Any]) -> str:
    seen = ", ".join(f"rank {k}: {v}" for k, v in r["rank_overflows"].items())
    origin = ", ".join(f"rank {k}: {v}" for k, v in (r["origin"] or {}).items())
    before = (
        "buckets non-finite BEFORE the all-reduce"
        if r["kind"] == "ddp"
        else "activation grads non-finite BEFORE the reduce-scatter"
    )
    lines = [
        f"ampguard demo: {r['steps']} steps in {r['precision']} on {r['world_size']} CPU ranks "
        f"({r['kind']}, gloo; {r['seconds']:.1f} s)",
        f"  eval loss (fp32):  {r['loss_before']:.4f} -> {r['loss_after']:.4f}",
        f"  skipped steps:     {len(r['skipped'])} of {r['steps']} on every rank "
        f"({', '.join(map(str, r['skipped'][:8]))}{' ...' if len(r['skipped']) > 8 else ''})",
        f"  outlier burst:     steps {r['spike_steps']}, last rank's shard only",
        f"  non-finite grads:  windows per rank, after the gradient reduction: {seen}",
    ]
    if origin:
        lines.append(f"  overflow origin:   {before}: {origin}")
    lines += [
        f"  cross-rank audits: {r['audits']} passed (scale, trackers, step counts"
        + (", parameter checksum)" if r["kind"] == "ddp" else "; FSDP2 shards differ by design)"),
        f"  loss scale:        ends at {r['scale_end']:g}",
    ]
    lines += [f"  finding:           {f}" for f in r["findings"]]
    lines += [
        f"  run folder:        {r['run_dir']} (run log by rank 0)",
        f"  checkpoint:        {r['checkpoint']}",
    ]
    return "\n".join(lines)
