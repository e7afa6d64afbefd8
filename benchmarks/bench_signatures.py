"""The cost of ``Guard(signatures=...)``: the bare torch bf16 step, the Guard without signatures,
the Guard with the default (one window in 32) and with every window recorded (``signatures=1``),
on the toy MLP of the fault zoo and on HF GPT-2 (2 layers, width 128, batch 4 x 64 tokens).

The loops run in one process, one torch thread, in rounds of ``--steps`` steps, the order
rotating each round so that the machine's load hits them alike, timed in this thread's CPU
time (the waits of a loaded machine left out). Each figure is the median over the rounds of the
loop's mean over the Guard without signatures in the same round (``x off``), with the spread
(25th-75th percentile of the rounds' ratios); ``off again`` is a second, identical Guard
without signatures: the noise floor. Host syncs per step are counted with
:class:`ampguard.testing.SyncCounter` over 64 windows (two recorded by the default).

``--flight-recorder``: the Guards keep the flight recorder (on by default in ``Guard``); without
it (the default here, as in ``fault_zoo.py --cost``) the windows the default leaves out run no
hook at all.

Run: ``python benchmarks/bench_signatures.py [--models toy gpt2] [--rounds 31] [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.testing import SyncCounter


def _toy() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    return model, lambda m: F.mse_loss(m(x).float(), y)


def _gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


MODELS = {"toy": _toy, "gpt2": _gpt2}
STEPS = {"toy": 32, "gpt2": 8}  # steps per round: a round of each loop is some 20-50 ms


def loops(model_name: str, flight_recorder: bool) -> dict[str, Callable[[], None]]:
    """The five loops, each on its own model and AdamW."""
    out: dict[str, Callable[[], None]] = {}
    model, loss_of = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def bare(model: nn.Module = model, opt: Any = opt, loss_of: Any = loss_of) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out["bare step (no Guard)"] = bare
    recorder = {} if flight_recorder else {"flight_recorder": False, "on_spike": None}
    for name, sig in (("off", False), ("off again", False), ("default", True), ("every", 1)):
        model, loss_of = MODELS[model_name]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = ag.Guard(model, opt, precision="bf16", signatures=sig, **recorder)

        def step(model: nn.Module = model, guard: Any = guard, loss_of: Any = loss_of) -> None:
            with guard.autocast():
                loss = loss_of(model)
            guard.backward(loss)
            guard.step()

        out[name] = step
    return out


def run(model_name: str, rounds: int, steps: int, flight_recorder: bool) -> dict[str, Any]:
    """Per loop: median ms per step, the median ratio over ``off`` and its spread, syncs."""
    fns = loops(model_name, flight_recorder)
    syncs = {}
    for name, fn in fns.items():
        for _ in range(8):
            fn()
        with SyncCounter() as c:
            for _ in range(64):
                fn()
        syncs[name] = c.count / 64
    names = list(fns)
    per: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.thread_time()
            for _ in range(steps):
                fn()
            per[name].append((time.thread_time() - t0) / steps)
    out = {}
    for name, v in per.items():
        ratios = sorted(a / b for a, b in zip(v, per["off"], strict=True))
        q = statistics.quantiles(ratios, n=4)
        out[name] = {
            "ms": 1e3 * statistics.median(v),
            "ratio": statistics.median(ratios),
            "p25": q[0],
            "p75": q[2],
            "syncs": syncs[name],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["toy", "gpt2"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, help="steps per round and loop (toy 32, gpt2 8)")
    parser.add_argument("--flight-recorder", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for model_name in args.models:
        steps = args.steps or STEPS[model_name]
        res = run(model_name, args.rounds, steps, args.flight_recorder)
        print(
            f"{model_name} (bf16, CPU, AdamW, flight recorder "
            f"{'on' if args.flight_recorder else 'off'}; {args.rounds} rounds x {steps} "
            "steps; x off = over the Guard without signatures, median [p25-p75]):"
        )
        for name, r in res.items():
            print(
                f"  {name:<22} {r['ms']:7.3f} ms  {r['ratio']:.3f}x off "
                f"[{r['p25']:.3f}-{r['p75']:.3f}]  {r['syncs']:.2f} syncs/step"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
