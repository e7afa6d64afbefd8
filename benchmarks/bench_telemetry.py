"""Telemetry overhead: step-time ratio vs a bare ``torch.amp.GradScaler`` loop, and host syncs.

Run: ``python benchmarks/bench_telemetry.py [--rounds 15] [--quick]``. Every loop trains its own
copy of the same model in fp16 autocast on the CPU, in one process; rounds are interleaved
(bare, guard, telemetry variants, bare, ...), each loop's step time in a round is divided by the
bare loop's in the same round, and the median over rounds is printed. Step time is this
process's CPU time (single-threaded), so other processes on a shared machine do not inflate it.
Telemetry's own time (CPU time inside its hooks and flushes, per step, the median of 3 runs of 300
steps; see ``HookClock``) is measured separately. Rows:

* ``guard``: the Guard without telemetry (for reference);
* ``(a) telemetry default``: ``Telemetry(run_dir)`` (grad stats every 10 steps, range stats every
  100, flush every 100);
* ``(a0) default, absorbed=False``: the defaults without the absorbed-overflow counting on range
  steps (what that counting costs is (a) less (a0); it runs outside the hooks HookClock times);
* ``(b) per-layer stats every step``: ``layer_every=1``;
* ``(c) range stats every 50 steps``: ``range_every=50`` (amortised over the round);
* a sweep over models with 50, 500 and 2000 parameter tensors, with every telemetry cost inside
  10 steps (``layer_every=1, range_every=10, flush_every=10``).

Host syncs are counted per step with a TorchDispatchMode on ``aten._local_scalar_dense`` (plus
``Tensor.tolist``) for the bare loop and the telemetry loop; telemetry's own device-to-host copy
happens only on flush steps (on CPU it is a memcpy that needs no sync, so it is counted apart).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    bare_step,
    guard_step,
    interleaved_rounds,
    mlp,
    syncs_per_step,
)

import ampguard as ag  # noqa: E402


def many_tensors(tensors: int) -> torch.nn.Module:
    """``tensors / 2`` small Linear layers (weight + bias each) in a residual chain."""

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(tensors // 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + 0.01 * layer(x)
            return x[:, :8]

    return Chain()


def loops(
    make_model: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    variants: dict[str, dict | None],
    root: Path,
) -> dict[str, Callable[[], None]]:
    """The bare loop plus one Guard loop per variant (None: no telemetry)."""
    model = make_model()
    out = {
        "bare": partial(
            bare_step,
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-4),
            torch.amp.GradScaler("cpu"),
            x,
            y,
        )
    }
    for name, kwargs in variants.items():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tel = None if kwargs is None else ag.Telemetry(root / name.replace(" ", "_"), **kwargs)
        out[name] = partial(
            guard_step, model, ag.Guard(model, opt, precision="fp16", telemetry=tel), x, y
        )
    return out


def ratios(run: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, float]:
    """Per round, each loop's CPU time per step over the bare loop's in the same round; the
    median over rounds. CPU time of this (single-threaded) process, so other processes on a
    shared machine do not count; on an idle machine it equals the wall time."""
    per_round = interleaved_rounds(run, rounds, steps, warmup=steps)  # warm-up: first flush too
    out = {name: statistics.median(r[name].cpu / r["bare"].cpu for r in per_round) for name in run}
    out["bare_ms"] = statistics.median(r["bare"].cpu * 1e3 for r in per_round)
    return out


class HookClock:
    """CPU time spent inside a Telemetry's hooks and flushes (instance-level wrappers).

    Reading the CPU clock is a system call: about 0.5 us back to back, but 2.6 us for the first
    read after a training step has run (its code and data are out of the caches then). Each
    timed call therefore reads the clock once before starting the timer, so that its cold read
    is not charged to telemetry, and the warm cost, calibrated on an empty wrapped call, is
    taken off every timed call (``overhead``)."""

    def __init__(self, tel: ag.Telemetry) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self.overhead = self._calibrate()
        for name in ("on_backward", "on_grads", "on_step", "flush", "_flush"):
            if hasattr(tel, name):
                setattr(tel, name, self._wrap(getattr(tel, name)))

    def _calibrate(self, n: int = 2000) -> float:
        empty = self._wrap(lambda: None)
        for _ in range(n):
            empty()
        took, self.seconds, self.calls = self.seconds / n, 0.0, 0
        return took

    def own(self) -> float:
        """Seconds inside telemetry, less the clock's own cost."""
        return max(0.0, self.seconds - self.calls * self.overhead)

    def _wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:  # a flush inside on_step: already on the clock
                return fn(*args, **kwargs)
            self._depth += 1
            self.calls += 1
            time.process_time()  # warm the clock: its cold first read is not telemetry's time
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0
                self._depth -= 1

        return timed


_PARTS = ("on_backward", "on_grads", "_sample", "_range_stats", "on_step", "_flush", "flush")


def breakdown(
    make_model: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    kwargs: dict,
    root: Path,
    steps: int,
) -> dict[str, float]:
    """Microseconds per step inside each telemetry method (nested ones included in their
    callers' too), less the CPU clock's own cost (calibrated on an empty wrapped call)."""
    model = make_model()
    tel = ag.Telemetry(root, **kwargs)
    guard = ag.Guard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision="fp16", telemetry=tel
    )
    for _ in range(40):  # past the default layer_every's dense first 32 steps
        guard_step(model, guard, x, y)
    spent = {name: 0.0 for name in _PARTS}
    calls = dict.fromkeys(_PARTS, 0)

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args, **kw):
            time.process_time()  # warm the clock (see HookClock)
            t0 = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.process_time() - t0
                calls[name] += 1

        return timed

    probe = wrap("flush", lambda: None)
    t0 = time.process_time()
    for _ in range(2000):
        probe()
    cost = (time.process_time() - t0) / 2000
    spent["flush"], calls["flush"] = 0.0, 0
    for name in _PARTS:
        if hasattr(tel, name):
            setattr(tel, name, wrap(name, getattr(tel, name)))
    for _ in range(steps):
        guard_step(model, guard, x, y)
    return {
        name: max(0.0, spent[name] - calls[name] * cost) / steps * 1e6
        for name in _PARTS
        if calls[name]
    }


def hook_share(
    make_model: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    kwargs: dict,
    root: Path,
    steps: int,
) -> float:
    """Telemetry's own CPU time per step (hooks + flushes, ``steps`` steps) in milliseconds."""
    model = make_model()
    tel = ag.Telemetry(root, **kwargs)
    guard = ag.Guard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision="fp16", telemetry=tel
    )
    # warm-up, outside the clock: past the default layer_every's dense first 32 steps (the
    # steady state of a run; those steps sample every step so a short run's heatmap is useful)
    for _ in range(40):
        guard_step(model, guard, x, y)
    clock = HookClock(tel)
    for _ in range(steps):
        guard_step(model, guard, x, y)
    return clock.own() / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=100, help="steps per round (default 100)")
    p.add_argument("--quick", action="store_true", help="3 rounds, smaller sweep")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="only print where telemetry's own time goes (us/step per method)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 3 if args.quick else args.rounds
    root = Path(tempfile.mkdtemp(prefix="ampguard-bench-telemetry-"))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 8)

    variants = {
        "guard": None,
        "(a) telemetry default": {},
        "(a0) default, absorbed=False": {"absorbed": False},
        "(b) per-layer stats every step": {"layer_every": 1},
        "(c) range stats every 50 steps": {"range_every": 50},
    }
    make = lambda: mlp(args.width, args.depth, torch.nn.GELU)  # noqa: E731
    if args.breakdown:
        for name, kwargs in variants.items():
            if kwargs is not None:
                parts = breakdown(make, x, y, kwargs, root / f"parts{len(name)}", 300)
                print(
                    f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + " us/step"
                )
        return 0
    r = ratios(loops(make, x, y, variants, root), rounds, args.steps)
    print(
        f"MLP width {args.width} depth {args.depth} batch {args.batch}: bare step "
        f"{r['bare_ms']:.2f} ms CPU; {rounds} interleaved rounds x {args.steps} steps, median"
    )
    print(f"  {'loop':34s} {'ratio vs bare':>14s} {'telemetry us/step':>18s} {'share':>7s}")
    for name, kwargs in variants.items():
        own = (  # the median of 3 runs of 300 steps each
            ""
            if kwargs is None
            else statistics.median(
                hook_share(make, x, y, kwargs, root / f"clock{len(name)}-{k}", 300)
                for k in range(3)
            )
        )
        share = "" if kwargs is None else f"{own / r['bare_ms']:.2%}"
        own = "" if kwargs is None else f"{own * 1e3:.1f}"
        print(f"  {name:34s} {r[name]:13.3f}x {own:>18s} {share:>7s}")

    # Sweep: every telemetry cost within 10 steps (stats every step, range stats and a flush
    # every 10), so 10-step rounds measure all of it even where a step takes a second.
    full = {"layer_every": 1, "range_every": 10, "flush_every": 10}
    print(f"parameter-tensor sweep (residual chain of Linear(16, 16), batch 32; telemetry {full}):")
    xs, ys = torch.randn(32, 16), torch.randn(32, 8)
    for n in (50, 500) if args.quick else (50, 500, 2000):
        chain = lambda n=n: many_tensors(n)  # noqa: E731
        s = ratios(
            loops(chain, xs, ys, {"guard": None, "telemetry": full}, root / f"n{n}"),
            {50: 9, 500: 5, 2000: 3}[n] if not args.quick else 3,
            10,
        )
        own = hook_share(chain, xs, ys, full, root / f"n{n}clock", 20)
        print(
            f"  {n:5d} tensors: bare {s['bare_ms']:7.1f} ms/step | guard {s['guard']:.3f}x, "
            f"guard+telemetry {s['telemetry']:.3f}x bare | telemetry's own time "
            f"{own / s['bare_ms']:.1%} of the bare step"
        )

    model = mlp(args.width, args.depth, torch.nn.GELU)
    bare = partial(
        bare_step, model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu"), x, y
    )
    model = mlp(args.width, args.depth, torch.nn.GELU)
    tel = ag.Telemetry(root / "syncs", range_every=50)
    guard = ag.Guard(model, torch.optim.AdamW(model.parameters()), precision="fp16", telemetry=tel)
    tstep = partial(guard_step, model, guard, x, y)
    n = 200
    b, t = syncs_per_step(bare, n), syncs_per_step(tstep, n)
    extra = [i + 1 for i in range(n) if t[i] != b[i]]
    print(
        f"host syncs per step over {n} steps: bare {sum(b) / n:.2f}, Guard+telemetry "
        f"{sum(t) / n:.2f}; steps where they differ: {extra or 'none'}; telemetry flushes "
        f"(one device-to-host copy each): {tel.flushes} (steps 100, 200)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
