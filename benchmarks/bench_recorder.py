"""The flight recorder's cost: Guard with the recorder and spike detection (the default,
N=256, snapshots every 100 windows) against the same Guard without them and the bare torch bf16
loop, in the same run, rounds interleaved (median of the rounds, CPU time by default); and the
host syncs of each (the recorder adds none).

Models: ``mlp`` (the toy MLP of the other benchmarks, width x depth), ``gpt2`` (HF
``GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64,
vocab_size=512))``, batch x 64 tokens) and ``gpt2-4x256`` (n_layer=4, n_embd=256, n_head=4,
n_positions=128, vocab_size=2048, batch x 128 tokens).

Columns: ``recorder`` and ``no rec.`` over the bare loop, ``own`` = recorder / no recorder (the
recorder's own cost) and ``own us`` its absolute time per step, ``A/A`` = a second Guard without
the recorder over the first (the noise floor of the run: a difference below it is not
measured), ``direct us`` the recorder's own host time per window measured inside it
(:func:`direct_us`, over ``--direct`` windows, sampled windows and snapshots included) and
``direct %`` that over the Guard's step without the recorder, the host syncs per step of each
loop.

Run: ``python benchmarks/bench_recorder.py --model gpt2 [--clip 1.0] [--rounds 15] [--steps 10]``.
``--device cuda`` runs it on a GPU (there the ring and detector ops are kernel launches).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import count_syncs, interleaved_rounds, medians, mlp  # noqa: E402

import ampguard as ag  # noqa: E402

GPT2 = {
    "gpt2": ({"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 64, "vocab_size": 512}, 64),
    "gpt2-4x256": (
        {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128, "vocab_size": 2048},
        128,
    ),
}


def make(args: argparse.Namespace, dev: torch.device) -> tuple[Callable, Callable]:
    """``(new_model, loss_of_model)`` for ``args.model``; every model starts from seed 0."""
    if args.model == "mlp":
        x = torch.randn(args.batch, args.width, device=dev)
        y = torch.randn(args.batch, 8, device=dev)
        return (lambda: mlp(args.width, args.depth).to(dev)), (
            lambda m: F.mse_loss(m(x).float(), y)
        )
    import transformers

    config, tokens = GPT2[args.model]
    ids = torch.randint(0, config["vocab_size"], (args.batch, tokens), device=dev)

    def new() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).to(dev)

    return new, lambda m: m(input_ids=ids, labels=ids).loss


def bare_step(model, opt, loss_of, device_type: str, clip: float | None) -> None:
    """The plain bf16 loop: autocast, backward, [clip,] step, zero_grad (no check, no
    scaler)."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = loss_of(model)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def guard_step(model, guard, loss_of) -> None:
    with guard.autocast():
        loss = loss_of(model)
    guard.backward(loss)
    guard.step()


def bench(args: argparse.Namespace, fused: bool) -> dict[str, float]:
    dev = torch.device(args.device)
    new, loss_of = make(args, dev)
    models = [new() for _ in range(4)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for m in models]
    clip = {"clip_grad_norm": args.clip}
    on = ag.Guard(
        models[1],
        opts[1],
        precision="bf16",
        flight_recorder=args.capacity,
        snapshot_every=args.snapshot_every,
        **clip,
    )
    off = [
        ag.Guard(m, o, precision="bf16", flight_recorder=False, on_spike=None, **clip)
        for m, o in zip(models[2:], opts[2:], strict=True)
    ]
    loops = {
        "bare": partial(bare_step, models[0], opts[0], loss_of, dev.type, args.clip),
        "recorder": partial(guard_step, models[1], on, loss_of),
        "no recorder": partial(guard_step, models[2], off[0], loss_of),
        "no recorder 2": partial(guard_step, models[3], off[1], loss_of),  # the noise floor
    }
    if dev.type == "cuda":
        loops = {k: _synced(v) for k, v in loops.items()}
    rounds = interleaved_rounds(loops, args.rounds, args.steps, warmup=5)
    med = medians(rounds, args.clock)
    cpu = dev.type == "cpu"
    return {
        "bare_ms": med["bare"] * 1e3,
        "on": med["recorder"] / med["bare"],
        "off": med["no recorder"] / med["bare"],
        "own": med["recorder"] / med["no recorder"],
        "own_us": (med["recorder"] - med["no recorder"]) * 1e6,
        "noise": med["no recorder 2"] / med["no recorder"],
        "syncs_bare": count_syncs(loops["bare"], 10) if cpu else float("nan"),
        "syncs_on": count_syncs(loops["recorder"], 10) if cpu else float("nan"),
        "syncs_off": count_syncs(loops["no recorder"], 10) if cpu else float("nan"),
        "direct_us": (direct := direct_us(on.flight_recorder, loops["recorder"], args.direct)),
        "direct_pct": direct / (med["no recorder"] * 1e6),
        "snapshot_mb": on.flight_recorder.memory()["snapshots"] / 2**20,
        "ring_kb": on.flight_recorder.memory()["ring"] / 2**10,
    }


def direct_us(watch, step: Callable[[], None], steps: int) -> float:
    """The recorder's own host time per window, measured inside it: this thread's CPU time in
    the Guard's calls into the recorder (its methods and the sampled windows' amax hooks), over
    ``steps`` windows. A direct reading, unlike the difference of two step medians not buried
    in the machine's noise; on the CPU (synchronous ops) it is the time the recorder adds."""
    spent = [0.0]

    def timed(fn):
        def run(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.thread_time() - t

        return run

    names = ("begin", "on_grads", "clip_parts", "spike_flag", "skip_found", "on_status")
    for name in (*names, "after_step"):
        setattr(watch, name, timed(getattr(watch, name)))
    if watch.amax is not None:
        make = watch.amax._hook
        watch.amax._hook = lambda i, mod: timed(make(i, mod))
    for _ in range(steps):
        step()
    for name in (*names, "after_step"):
        delattr(watch, name)
    if watch.amax is not None:
        del watch.amax._hook
    return spent[0] / steps * 1e6


def _synced(fn):
    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", *GPT2], default="mlp")
    ap.add_argument("--width", type=int, default=256, help="mlp only")
    ap.add_argument("--depth", type=int, default=4, help="mlp only")
    ap.add_argument("--batch", type=int, default=None, help="default: 64 (mlp), 8 (gpt2)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--snapshot-every", type=int, default=100)
    ap.add_argument("--direct", type=int, default=200, help="windows of the direct reading")
    ap.add_argument("--clip", type=float, default=None, help="clip_grad_norm (default: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="cpu",
        help="cpu (default): this process's CPU time, which leaves out the time a loaded "
        "machine takes the core away; wall: elapsed time",
    )
    ap.add_argument("--fused", choices=["both", "no", "yes"], default="both")
    args = ap.parse_args()
    if args.batch is None:
        args.batch = 64 if args.model == "mlp" else 8
    torch.set_num_threads(args.threads)
    shape = f"width {args.width} x depth {args.depth}" if args.model == "mlp" else args.model
    print(
        f"torch {torch.__version__}, {args.device}, {shape}, batch {args.batch}, "
        f"flight_recorder={args.capacity}, snapshot_every={args.snapshot_every}, "
        f"clip_grad_norm={args.clip}, "
        f"{args.clock} clock, median of {args.rounds} interleaved rounds x {args.steps} steps"
    )
    print(
        f"{'optimizer':12} {'bare ms':>8} {'recorder':>9} {'no rec.':>8} {'own':>7} "
        f"{'own us':>7} {'A/A':>6} {'direct us':>9} {'direct %':>8} {'syncs bare/rec/no':>18} "
        f"{'ring KB':>8} {'snap MB':>8}"
    )
    for fused in {"both": (False, True), "no": (False,), "yes": (True,)}[args.fused]:
        r = bench(args, fused)
        name = "AdamW fused" if fused else "AdamW"
        print(
            f"{name:12} {r['bare_ms']:8.3f} {r['on']:9.3f} {r['off']:8.3f} {r['own']:7.3f} "
            f"{r['own_us']:7.0f} {r['noise']:6.3f} {r['direct_us']:9.0f} "
            f"{r['direct_pct']:8.2%} "
            f"{r['syncs_bare']:6.1f}/{r['syncs_on']:.1f}/{r['syncs_off']:.1f}"
            f"      {r['ring_kb']:8.1f} {r['snapshot_mb']:8.2f}"
        )


if __name__ == "__main__":
    main()
