"""What each rank runs in tests/test_distributed.py: real gloo process groups, real DDP/FSDP2.

:func:`run_group` spawns ``world`` processes, each runs the named scenarios in order and puts
``(scenario, rank, "ok" | "error", value)`` on a queue. A scenario that raises ends its process
(as torchrun would), so the other ranks' next collective fails fast instead of hanging.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampguard as ag
from ampguard.checkpoint.distributed import load_distributed_checkpoint, save_distributed_checkpoint
from ampguard.distributed import PeerFailureError
from ampguard.distributed.hooks import register_nonfinite_safe_hook

SCALE = ag.ScalerConfig(init_scale=2.0**10, growth_interval=1000)
ROWS = 4  # rows per rank per micro-batch


# ---------------------------------------------------------------------- process plumbing
def run_group(
    world: int,
    scenarios: list[str],
    timeout: float = 100.0,
    tmp: str | None = None,
    pg_timeout: float = 30.0,
) -> dict[str, dict[int, tuple[str, Any]]]:
    """Run ``scenarios`` on ``world`` gloo ranks; ``{scenario: {rank: (status, value)}}``.

    ``pg_timeout``: the default group's timeout (what bounds a hang in DDP's own all-reduce).
    """
    tmp = tmp or tempfile.mkdtemp(prefix="ampguard-dist-")
    return run_ranks(_rank_main, world, scenarios, timeout, tmp, pg_timeout)


def run_ranks(
    target: Any, world: int, scenarios: list[str], timeout: float, tmp: str, pg_timeout: float
) -> dict[str, dict[int, tuple[str, Any]]]:
    """Spawn ``world`` processes of ``target(rank, world, port, scenarios, queue, tmp,
    pg_timeout)`` and collect their ``(scenario, rank, status, value)`` reports; a process
    still alive after ``timeout`` seconds is killed, so a hang fails instead of stalling."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=target, args=(r, world, port, scenarios, queue, tmp, pg_timeout))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[str, dict[int, tuple[str, Any]]] = {name: {} for name in scenarios}
    deadline = time.monotonic() + timeout
    expected = world * len(scenarios)
    got = 0
    try:
        while got < expected and time.monotonic() < deadline:
            try:
                name, rank, status, value = queue.get(timeout=0.5)
            except queue_module.Empty:  # is anyone still alive?
                if not any(p.is_alive() for p in procs):
                    break
                continue
            out[name][rank] = (status, value)
            got += 1
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
    return out


def _plain(value: Any) -> Any:
    """Tensors -> (exact) Python lists: a tensor sent through the queue needs its sender alive."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    scenarios: list[str],
    queue: Any,
    tmp: str,
    pg_timeout: float = 30.0,
) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout),
    )
    try:
        for i, name in enumerate(scenarios):
            if i:  # start each scenario together: a Guard's group is built within peer_timeout
                dist.barrier()
            try:
                value = SCENARIOS[name](rank, world, tmp)
            except BaseException as exc:
                queue.put(
                    (
                        name,
                        rank,
                        "error",
                        f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=4),
                    )
                )
                raise
            queue.put((name, rank, "ok", _plain(value)))
    finally:
        queue.close()
        queue.join_thread()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- models and data
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )


def batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch ``micro`` of window ``step`` (same on every rank)."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(rows, 16, generator=gen), torch.randn(rows, 4, generator=gen)


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * ROWS : (rank + 1) * ROWS]


def window(
    guard: ag.Guard,
    model: nn.Module,
    step: int,
    rank: int | None,
    world: int,
    inject: Callable[[], None] | None = None,
) -> ag.StepResult:
    """One accumulation window on this rank's shard (``rank=None``: the whole global batch)."""
    result = None
    for micro in range(guard.accumulation_steps):
        x, y = batch(step, micro, ROWS * world)
        if rank is not None:
            x, y = shard(x, rank), shard(y, rank)
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        if inject is not None and micro == guard.accumulation_steps - 1:
            inject()
        result = guard.step()
    assert result is not None
    return result


def flat(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    ps = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in ps]).clone()


def ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _poison(model: nn.Module, value: float = float("inf")) -> Callable[[], None]:
    def inject() -> None:
        from torch.distributed.tensor import DTensor

        g = next(model.parameters()).grad
        local = g._local_tensor if isinstance(g, DTensor) else g
        local.view(-1)[0] = value

    return inject


# ---------------------------------------------------------------------- scenarios
def inf_on_one_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Plain DDP; at window 2 the last rank's batch holds an inf (a bad sample): its gradients
    are non-finite BEFORE DDP's all-reduce, which carries them to every rank. No consensus runs;
    the end-of-run audit gathers the overflow origin (each rank's own loss)."""
    model = ddp(make_model())
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=SCALE
    )
    victim = world - 1
    applied, scales = [], []
    with _counting_allreduce(guard) as calls:
        for step in range(1, 5):
            applied.append(
                _bad_sample_window(
                    guard, model, step, rank, world, bad=step == 2 and rank == victim
                ).applied
            )
            scales.append(guard.scale)
    consensus_calls = len(calls)
    guard.audit()
    return {
        "applied": applied,
        "scales": scales,
        "params": flat(model),
        "summary": guard.distributed.summary(),
        "consensus_calls": consensus_calls,
        "needed": guard.distributed.consensus_needed,
    }


def _bad_sample_window(
    guard: ag.Guard, model: nn.Module, step: int, rank: int, world: int, bad: bool
) -> ag.StepResult:
    x, y = batch(step, 0, ROWS * world)
    x, y = shard(x, rank), shard(y, rank)
    if bad:
        x[0, 0] = float("inf")
    with guard.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    guard.backward(loss)
    return guard.step()


class _counting_allreduce:  # noqa: N801 - a context manager used like a function
    """Counts ``dist.all_reduce`` calls on the Guard's own group (the consensus) in the block."""

    def __init__(self, guard: ag.Guard) -> None:
        self.group = guard.distributed.group
        self.calls: list[int] = []

    def __enter__(self) -> list[int]:
        self.real = dist.all_reduce

        def counting(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            if kwargs.get("group") is self.group:
                self.calls.append(1)
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self.real


def inf_after_reduce(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Paths that keep the consensus: the last rank's gradient gets an inf AFTER the reduction
    (DDP with a comm hook; a plain model in the group). Every rank must skip window 2."""
    out = {}
    for kind in ("ddp_hook", "ddp_safe_hook", "plain"):
        model = make_model() if kind == "plain" else ddp(make_model())
        if kind != "plain":
            register_nonfinite_safe_hook(model, drop=kind == "ddp_safe_hook")
        guard = ag.Guard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            precision="fp16",
            scaler=SCALE,
            audit_every=None,
        )
        applied = []
        with _counting_allreduce(guard) as calls:
            for step in range(1, 4):
                hit = _poison(model) if (step == 2 and rank == world - 1) else None
                applied.append(window(guard, model, step, rank, world, hit).applied)
        out[kind] = {
            "applied": applied,
            "consensus_calls": len(calls),
            "params": flat(model),
            "rank_overflows": guard.distributed.summary()["rank_overflows"],
        }
    return out


def fault_after_reduce_plain_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The trade: under plain DDP a rank-local fault AFTER the all-reduce is not agreed on (no
    consensus); the last rank skips alone and the next audit names it (DesyncError)."""
    model = ddp(make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        audit_every=3,
    )
    for step in range(1, 5):
        hit = _poison(model) if (step == 2 and rank == world - 1) else None
        try:
            window(guard, model, step, rank, world, hit)
        except ag.DesyncError as exc:
            return {"step": step, "ranks": exc.ranks, "fields": sorted(exc.differences)}
    return {"step": None}


def _accumulation_run(
    rank: int,
    world: int,
    wrap: Callable[[nn.Module], nn.Module],
    windows: int = 3,
    inject_window: int | None = None,
) -> nn.Module:
    model = wrap(make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        accumulation_steps=2,
    )
    for step in range(1, windows + 1):
        faulty_window(
            guard, model, step, rank, world, bad=step == inject_window and rank == world - 1
        )
    model.guard = guard  # for the caller
    return model


def faulty_window(
    guard: ag.Guard, model: nn.Module, step: int, rank: int, world: int, bad: bool
) -> ag.StepResult:
    """:func:`window`; when ``bad``, one of this rank's gradients is inf.

    Plain DDP (no consensus): the fault comes BEFORE the all-reduce, as a real one would (a
    rank-local change after it is the audit's to catch). FSDP2 and the rest: in this rank's own
    (shard of the) gradient after the reduction, which only the consensus spreads.
    """
    if not bad:
        return window(guard, model, step, rank, world)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        handle = next(model.parameters()).register_hook(_inf_grad)
        try:
            return window(guard, model, step, rank, world)
        finally:
            handle.remove()
    return window(guard, model, step, rank, world, _poison(model))


def _inf_grad(grad: torch.Tensor) -> torch.Tensor:
    out = grad.clone()
    out.view(-1)[0] = float("inf")
    return out


def ddp_accumulation(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """DDP, 2 micro-batches per window; rank 0 also runs one process on the global batch."""
    calls = []

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_hook(state, bucket):  # noqa: ANN001 - DDP rejects string annotations
        calls.append(1)
        return allreduce_hook(state, bucket)

    def wrap(m: nn.Module) -> nn.Module:
        model = ddp(m)
        model.register_comm_hook(None, counting_hook)
        return model

    params = flat(_accumulation_run(rank, world, wrap))
    return {"allreduce_calls": len(calls), "params": params}


def single_process(world: int) -> torch.Tensor:
    """Reference (run in the test process): one process, the global batch, the same windows."""
    model = make_model()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        accumulation_steps=2,
    )
    for step in range(1, 4):
        window(guard, model, step, None, world)
    return flat(model)


def fsdp2_vs_ddp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FSDP2 and DDP, fp16 autocast, accumulation 2; window 2 overflows on the last rank only."""
    sharded = _accumulation_run(rank, world, fsdp2, inject_window=2)
    replicated = _accumulation_run(rank, world, ddp, inject_window=2)
    g = sharded.guard
    return {
        "max_diff": float((flat(sharded) - flat(replicated)).abs().max()),
        "moved": float((flat(replicated) - flat(make_model())).abs().max()),
        "kind": g.distributed.topology.kind,
        "skipped": g.skipped_steps,
        "scale": g.scale,
        "ddp_scale": replicated.guard.scale,
        "rank_overflows": g.distributed.summary()["rank_overflows"],
    }


def ddp_containment(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Micro-batch containment under DDP: the last rank's first micro-batch of window 2 is NaN."""
    model = ddp(make_model())
    guard, results = _containment(model, rank, world)
    return {
        "results": results,
        "params": flat(model),
        "rank_dropped": guard.distributed.summary()["rank_dropped_microbatches"],
    }


def single_containment(world: int) -> torch.Tensor:
    """Reference (run in the test process): the same windows on the global batch."""
    model = make_model()
    _containment(model, None, world)
    return flat(model)


def _containment(
    model: nn.Module, rank: int | None, world: int
) -> tuple[ag.Guard, list[tuple[bool, int]]]:
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        accumulation_steps=2,
        contain_nonfinite_microbatches=True,
    )
    results = []
    for step in range(1, 4):
        for micro in range(2):
            x, y = batch(step, micro, ROWS * world)
            if step == 2 and micro == 0:
                x[(world - 1) * ROWS :] = float("nan")  # the last rank's rows
            if rank is not None:
                x, y = shard(x, rank), shard(y, rank)
            with guard.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            guard.backward(loss)
            result = guard.step()
        results.append((result.applied, result.dropped_microbatches))
    return guard, results


def desync_raises(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The last rank's scale is changed at window 2; the audit runs every 3 windows."""
    model = ddp(make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        audit_every=3,
    )
    for step in range(1, 7):
        try:
            window(guard, model, step, rank, world)
        except ag.DesyncError as exc:
            return {
                "step": step,
                "ranks": exc.ranks,
                "message": str(exc),
                "differences": exc.differences,
                "code": exc.finding.code,
            }
        if step == 2 and rank == world - 1:
            guard.loss_scaler.fill_(64.0)
    return {"step": None}


def desync_repairs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _desync_policy(rank, world, "repair")


def desync_warns(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _desync_policy(rank, world, "warn")


def _desync_policy(rank: int, world: int, policy: str) -> dict[str, Any]:
    """Rank 1's scale and first weight change after window 1; the audit runs every 2 windows."""
    model = ddp(make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        audit_every=2,
        on_desync=policy,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 4):
            window(guard, model, step, rank, world)
            if step == 1 and rank == 1:
                guard.loss_scaler.fill_(64.0)
                with torch.no_grad():
                    model.module[0].weight.add_(1.0)
    return {
        "scale": guard.scale,
        "params": flat(model),
        "warnings": [str(w.message) for w in caught if "out of sync" in str(w.message)],
    }


def _resume_case(
    rank: int, world: int, tmp: str, wrap: Callable[[nn.Module], nn.Module], folder: str
) -> dict[str, Any]:
    path = os.path.join(tmp, folder)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, ag.Guard]:
        model = wrap(make_model(seed))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return (
            model,
            opt,
            ag.Guard(model, opt, precision="fp16", scaler=SCALE, accumulation_steps=2),
        )

    model, opt, guard = build(0)
    for step in range(1, 4):
        faulty_window(guard, model, step, rank, world, bad=step == 2 and rank == 0)
    torch.manual_seed(100 + rank)  # each rank's own RNG stream must come back on resume
    save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard, extra={"step": 3})
    rng_after_save = torch.rand(3)
    for step in range(4, 7):
        window(guard, model, step, rank, world)
    uninterrupted = flat(model)
    model2, opt2, guard2 = build(1)
    extra = load_distributed_checkpoint(path, model=model2, optimizer=opt2, guard=guard2)
    rng_restored = bool(torch.equal(torch.rand(3), rng_after_save))
    loaded_scale = guard2.scale
    for step in range(4, 7):
        window(guard2, model2, step, rank, world)
    return {
        "equal": bool(torch.equal(uninterrupted, flat(model2))),
        "extra": extra,
        "scale": guard2.scale,
        "loaded_scale": loaded_scale,
        "skipped": guard2.skipped_steps,
        "rng_restored": rng_restored,
        "rng": rng_after_save,
        "files": sorted(os.listdir(tmp)),
    }


def ddp_resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _resume_case(rank, world, tmp, ddp, "ddp.pt")


def fsdp2_resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return _resume_case(rank, world, tmp, fsdp2, "fsdp2-ckpt")


def hook_drops_nan_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The last rank's batch is NaN; the hook leaves it out and the step is applied."""
    model = ddp(make_model())
    register_nonfinite_safe_hook(model)
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=SCALE
    )
    x, y = batch(1, 0, ROWS * world)
    x, y = shard(x, rank), shard(y, rank)
    if rank == world - 1:
        x = torch.full_like(x, float("nan"))
    with guard.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    guard.backward(loss)
    applied = guard.step().applied
    return {
        "applied": applied,
        "params": flat(model),
        "hook": guard.distributed.summary()["hook"],
        "codes": [f.code for f in guard.distributed.findings()],
    }


def healthy_ranks_step(world: int) -> torch.Tensor:
    """Reference (run in the test process): one step on the healthy ranks' rows only."""
    model = make_model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=SCALE
    )
    x, y = batch(1, 0, ROWS * world)
    with guard.autocast():
        loss = nn.functional.mse_loss(
            model(x[: ROWS * (world - 1)]).float(), y[: ROWS * (world - 1)]
        )
    guard.backward(loss)
    guard.step()
    return flat(model)


def rank_raises(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The last rank raises between backward and step; the others must fail fast, not hang."""
    model = ddp(make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        peer_timeout=PEER,
    )

    def crash() -> None:
        raise RuntimeError("simulated crash on the last rank")

    window(guard, model, 1, rank, world)
    started = time.monotonic()
    try:
        window(guard, model, 2, rank, world, crash if rank == world - 1 else None)
        window(guard, model, 3, rank, world)  # plain DDP: no consensus; the backward fails
    except PeerFailureError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "ranks": exc.ranks,
            "seconds": time.monotonic() - started,
        }
    return {"error": None}


# ---------------------------------------------------------------------- failing peers
PEER = 1.5  # peer_timeout in the failure scenarios (the roll call waits 3 s, its minimum)
SLEEP = 7.0  # a hung rank's pause: longer than the survivors' timeout + roll call


def _failing(kind: str, rank: int, world: int, **kwargs: Any) -> tuple[nn.Module, ag.Guard]:
    model = {"ddp": ddp, "fsdp2": fsdp2, "plain": lambda m: m}[kind](make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=SCALE,
        peer_timeout=PEER,
        **kwargs,
    )
    return model, guard


def _until_failure(run: Callable[[], None]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        run()
    except PeerFailureError as exc:
        return {
            "error": "PeerFailureError",
            "ranks": exc.ranks,
            "message": str(exc),
            "seconds": time.monotonic() - started,
        }
    return {"error": None, "seconds": time.monotonic() - started}


def _sleep_before_step(kind: str, rank: int, world: int) -> dict[str, Any]:
    """The last rank pauses between backward and ``guard.step()`` of window 2."""
    model, guard = _failing(kind, rank, world, audit_every=None)
    window(guard, model, 1, rank, world)
    if rank == world - 1:
        return _until_failure(
            lambda: window(guard, model, 2, rank, world, lambda: time.sleep(SLEEP))
        )

    def survivor() -> None:
        for step in range(2, 5):
            window(guard, model, step, rank, world)

    return _until_failure(survivor)


def _sleep_in_audit(kind: str, rank: int, world: int) -> dict[str, Any]:
    """The last rank pauses inside the audit of window 2 (audit every 2 windows)."""
    model, guard = _failing(kind, rank, world, audit_every=2)
    if rank == world - 1:
        state = guard.distributed
        own = state.origin_columns
        state.origin_columns = lambda: (time.sleep(SLEEP), own())[1]  # type: ignore[method-assign]

    def run() -> None:
        for step in range(1, 4):
            window(guard, model, step, rank, world)

    return _until_failure(run)


def _crash(kind: str, rank: int, world: int) -> dict[str, Any]:
    """The last rank dies at the start of window 2 (before its forward)."""
    model, guard = _failing(kind, rank, world)
    window(guard, model, 1, rank, world)
    if rank == world - 1:
        os._exit(3)  # a crash: no exception, no goodbye
    return _until_failure(lambda: window(guard, model, 2, rank, world))


def demo_fsdp2(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from ampguard.demo.distributed import run_distributed_demo

    return run_distributed_demo(
        "fsdp2", steps=40, out=os.path.join(tmp, "demo-fsdp2"), progress=False, quiet=True
    )


SCENARIOS: dict[str, Callable[[int, int, str], Any]] = {
    f.__name__: f
    for f in (
        inf_on_one_rank,
        ddp_accumulation,
        ddp_containment,
        fsdp2_vs_ddp,
        desync_raises,
        desync_repairs,
        desync_warns,
        ddp_resume,
        fsdp2_resume,
        hook_drops_nan_rank,
        rank_raises,
        demo_fsdp2,
        inf_after_reduce,
        fault_after_reduce_plain_ddp,
    )
}


# ---------------------------------------------------------------------- non-finite gradients (step)
def fsdp2_bf16_nonfinite(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FSDP2 in bf16; at window 2 one rank's local gradient shard gets a NaN: every rank must
    skip that window (the check is rank-local, the consensus makes it global)."""
    model = fsdp2(make_model())
    guard = ag.Guard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision="bf16", clip_grad_norm=1.0
    )
    applied = []
    for step in range(1, 5):
        hit = _poison(model, float("nan")) if (step == 2 and rank == world - 1) else None
        applied.append(window(guard, model, step, rank, world, hit).applied)
    params = flat(model)
    return {
        "applied": applied,
        "params": params,
        "finite": bool(torch.isfinite(params).all()),
        "nonfinite": guard.diagnostics()["skipped_by_cause"]["nonfinite"],
    }


SCENARIOS[fsdp2_bf16_nonfinite.__name__] = fsdp2_bf16_nonfinite


def _per_wrapping(fault: Callable[[str, int, int], Any], kind: str) -> Callable[..., Any]:
    def scenario(rank: int, world: int, tmp: str) -> Any:
        return fault(kind, rank, world)

    return scenario


# The peer-fault scenarios run once per wrapping; the name says which ("crash_fsdp2"). Ranks
# look scenarios up by name, so these need no top-level function of their own.
for _name, _fault, _kinds in (
    ("sleep_before_step", _sleep_before_step, ("ddp", "fsdp2", "plain")),
    ("sleep_in_audit", _sleep_in_audit, ("ddp", "fsdp2", "plain")),
    ("crash", _crash, ("ddp", "fsdp2")),
):
    for _kind in _kinds:
        SCENARIOS[f"{_name}_{_kind}"] = _per_wrapping(_fault, _kind)


def serve(
    table: dict[str, Callable[[int, int, str], Any]],
    rank: int,
    world: int,
    port: int,
    scenarios: list[str],
    queue: Any,
    tmp: str,
    pg_timeout: float = 30.0,
) -> None:
    """A rank's body for :func:`run_ranks` over another module's scenario ``table`` (each
    ``f(rank, world, tmp)``): join the gloo group, run the scenarios in order, report each."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout),
    )
    try:
        for name in scenarios:
            try:
                value = table[name](rank, world, tmp)
            except BaseException as exc:
                queue.put((name, rank, "error", f"{exc!r}\n" + traceback.format_exc(limit=8)))
                raise
            queue.put((name, rank, "ok", _plain(value)))
    finally:
        queue.close()
        queue.join_thread()
    dist.destroy_process_group()
