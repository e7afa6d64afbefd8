"""A DDP communication hook that keeps one rank's non-finite gradients from poisoning the rest.

Plain DDP sums every rank's gradients: one NaN on one rank makes the all-reduced gradient NaN on
every rank, and the whole step is skipped. With this hook a rank whose local gradient bucket is
non-finite sends zeros instead, and the sum is divided by the number of healthy ranks, so the
step goes ahead with the mean over the healthy ranks. The per-rank "dropped" flags travel in the
same all-reduce (no extra collective) and are counted on the device for telemetry.

>>> from ampguard.distributed.hooks import register_nonfinite_safe_hook
>>> state = register_nonfinite_safe_hook(ddp_model)          # before the first backward
>>> ...                                                      # train through a Guard
>>> state.summary()["dropped_buckets"]                       # {rank: buckets dropped}

If every rank is non-finite the result is NaN, and the Guard skips the step as usual.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

from ampguard.findings import Finding, make

__all__ = [
    "NonfiniteSafeState",
    "nonfinite_safe_allreduce_hook",
    "register_nonfinite_safe_hook",
    "hook_state",
]


class NonfiniteSafeState:
    """State of :func:`nonfinite_safe_allreduce_hook`: the group and the per-rank counters.

    ``drop=False`` keeps DDP's plain mean but still records which ranks were non-finite (the
    overflow origin, which a plain all-reduce hides). ``dropped_buckets`` (device, int64,
    ``world``) counts, per rank, the buckets it contributed non-finite gradients to.
    """

    def __init__(self, process_group: Any = None, drop: bool = True) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("NonfiniteSafeState needs an initialised torch.distributed group")
        if not isinstance(drop, bool):
            raise TypeError(f"drop must be a bool, got {type(drop).__name__}")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.ranks = tuple(dist.get_process_group_ranks(self.group))
        self.drop = drop
        self.dropped_buckets: torch.Tensor | None = None
        self.last_flags: torch.Tensor | None = None

    def record(self, flags: torch.Tensor) -> None:
        """Count the ranks ``flags`` (``world``, nonzero where a rank's bucket was non-finite)
        marks; called by the hook for every bucket. Cost: no host sync."""
        counts = (flags > 0).long()
        if self.dropped_buckets is None:
            self.dropped_buckets = torch.zeros_like(counts)
        self.dropped_buckets.add_(counts)
        self.last_flags = flags

    def summary(self) -> dict[str, Any]:
        """``{"drop", "dropped_buckets": {rank: count}}``. Cost: one host sync."""
        counts = (
            [0] * self.world_size if self.dropped_buckets is None else self.dropped_buckets.tolist()
        )
        return {"drop": self.drop, "dropped_buckets": dict(zip(self.ranks, counts, strict=True))}

    def findings(self, step: int | None = None) -> list[Finding]:
        """AG132 for each rank whose contribution was non-finite. Cost: one host sync."""
        counts = self.summary()["dropped_buckets"]
        bad = {r: c for r, c in counts.items() if c}
        if not bad:
            return []
        action = (
            "left out of the all-reduce; the step used the healthy ranks' mean"
            if self.drop
            else "spread to every rank through the all-reduce"
        )
        return [
            make(
                "AG132",
                message=f"rank(s) {sorted(bad)} sent non-finite local gradients ({action})",
                step=step,
                evidence={"dropped_buckets": {str(r): c for r, c in counts.items()}},
                fix=(
                    "Inspect the named ranks' data and devices; ampguard.locate on one of their "
                    "batches names the module that overflowed."
                ),
            )
        ]


def nonfinite_safe_allreduce_hook(
    state: NonfiniteSafeState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: all-reduce the bucket, leaving out ranks whose bucket is non-finite.

    Register with ``ddp_model.register_comm_hook(state, nonfinite_safe_allreduce_hook)``.
    Cost: one extra read and copy of each bucket and ``world`` extra elements in the same
    all-reduce; no host sync.
    """
    buf = bucket.buffer()
    world = state.world_size
    bad = ~torch.isfinite(buf.sum(dtype=torch.float32))
    packed = torch.empty(buf.numel() + world, dtype=buf.dtype, device=buf.device)
    packed[: buf.numel()].copy_(buf)
    if state.drop:
        packed[: buf.numel()].masked_fill_(bad, 0)
    flags = packed[buf.numel() :]
    flags.zero_()
    flags[state.rank] = bad.to(buf.dtype)
    fut = dist.all_reduce(packed, group=state.group, async_op=True).get_future()

    def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = done.value()[0]
        flags = out[buf.numel() :]
        state.record(flags)
        if not state.drop:
            return out[: buf.numel()].div_(world)
        # 0 healthy ranks: 0/0 = NaN, so the Guard sees an overflow and skips the step
        return out[: buf.numel()].div_(world - flags.sum())

    return fut.then(finish)


def register_nonfinite_safe_hook(
    model: torch.nn.parallel.DistributedDataParallel, drop: bool = True
) -> NonfiniteSafeState:
    """Register :func:`nonfinite_safe_allreduce_hook` on a DDP model; return its state.

    The state is also kept on the model, so a Guard on it reports the counters in its
    distributed summary and findings. Call before the first backward (DDP's rule).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "register_nonfinite_safe_hook needs a DistributedDataParallel model, got "
            f"{type(model).__name__}"
        )
    state = NonfiniteSafeState(model.process_group, drop=drop)
    model.register_comm_hook(state, nonfinite_safe_allreduce_hook)
    object.__setattr__(model, "_ampguard_hook_state", state)
    return state


def hook_state(model: torch.nn.Module) -> NonfiniteSafeState | None:
    """The state registered by :func:`register_nonfinite_safe_hook` on ``model``, if any."""
    return getattr(model, "_ampguard_hook_state", None)
