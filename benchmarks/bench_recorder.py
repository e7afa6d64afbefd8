"""The flight recorder's cost: Guard with the recorder and spike detection (the default,
N=256, snapshots every 100 windows) against the same Guard without them and the bare torch bf16
loop, in the same run, rounds interleaved (median of the rounds, CPU time by default); and the
host syncs of each (the recorder adds none).

Models: ``mlp`` (the toy MLP of the other benchmarks, width x depth), ``gpt2`` (HF
``GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64,
vocab_size=512))``, batch x 64 tokens) and ``gpt2-4x256`` (n_layer=4, n_embd=256, n_head=4,
n_positions=128, vocab_size=2048, batch x 128 tokens).

Run: ``python benchmarks/bench_recorder.py --model gpt2 [--rounds 15] [--steps 10]``.
``--device cuda`` runs it on a GPU (there the ring and detector ops are kernel launches).
"""

from __future__ import annotations

import argparse
import sys
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


def bare_step(model, opt, loss_of, device_type: str) -> None:
    """The plain bf16 loop: autocast, backward, step, zero_grad (no check, no scaler)."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = loss_of(model)
    loss.backward()
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
    models = [new() for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for m in models]
    on = ag.Guard(
        models[1],
        opts[1],
        precision="bf16",
        flight_recorder=args.capacity,
        snapshot_every=args.snapshot_every,
    )
    off = ag.Guard(models[2], opts[2], precision="bf16", flight_recorder=False, on_spike=None)
    loops = {
        "bare": partial(bare_step, models[0], opts[0], loss_of, dev.type),
        "recorder": partial(guard_step, models[1], on, loss_of),
        "no recorder": partial(guard_step, models[2], off, loss_of),
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
        "syncs_bare": count_syncs(loops["bare"], 10) if cpu else float("nan"),
        "syncs_on": count_syncs(loops["recorder"], 10) if cpu else float("nan"),
        "syncs_off": count_syncs(loops["no recorder"], 10) if cpu else float("nan"),
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
    ap.add_argument("--model", choices=["mlp", *GPT2], default="mlp")
    ap.add_argument("--width", type=int, default=256, help="mlp only")
    ap.add_argument("--depth", type=int, default=4, help="mlp only")
    ap.add_argument("--batch", type=int, default=None, help="default: 64 (mlp), 8 (gpt2)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--snapshot-every", type=int, default=100)
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
        f"{args.clock} clock, median of {args.rounds} interleaved rounds x {args.steps} steps"
    )
    print(
        f"{'optimizer':12} {'bare ms':>8} {'recorder':>9} {'no rec.':>8} {'own':>7} "
        f"{'own us':>7} {'syncs bare/rec/no':>18} {'ring KB':>8} {'snap MB':>8}"
    )
    for fused in {"both": (False, True), "no": (False,), "yes": (True,)}[args.fused]:
        r = bench(args, fused)
        name = "AdamW fused" if fused else "AdamW"
        print(
            f"{name:12} {r['bare_ms']:8.3f} {r['on']:9.3f} {r['off']:8.3f} {r['own']:7.3f} "
            f"{r['own_us']:7.0f} {r['syncs_bare']:6.1f}/{r['syncs_on']:.1f}/{r['syncs_off']:.1f}"
            f"      {r['ring_kb']:8.1f} {r['snapshot_mb']:8.2f}"
        )


if __name__ == "__main__":
    main()
