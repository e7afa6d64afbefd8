"""The multi-format plan's cost: ``ag.fp8_plan(..., formats=...)`` with 1 to 4 formats, as a ratio
to one bare-torch bf16 training step of the same model (autocast, backward, AdamW; goal: at most
3x, whatever the number of formats), and the per-layer recipe it gives.

Run: ``python benchmarks/bench_lowp.py [--rounds 5] [--width 256] [--batch 256]``. The model is
``ampguard.demo.fp8_model.OutlierNet`` (its ``head``'s input carries an outlier feature). Plans
and steps alternate (interleaved rounds; the median of each is reported) on the same batch; the
first plan of a process also computes each format's nominal figures (once), which is excluded by
a warm-up plan. The MXFP8 and NVFP4 figures come from the plan's own casts
(:mod:`ampguard.fp8._quant`, bitwise torchao's ``MXTensor.to_mx`` and ``NVFP4Tensor.to_nvfp4``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import ampguard as ag
from ampguard.demo.fp8_model import OutlierNet, loss_fn

SETS = (
    ("tensorwise",),
    ("tensorwise", "mxfp8"),
    ("tensorwise", "rowwise", "mxfp8"),
    ("tensorwise", "rowwise", "mxfp8", "nvfp4"),
)


def _timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    batch = (torch.randn(args.batch, 32), torch.randn(args.batch, 16))

    def net() -> OutlierNet:
        torch.manual_seed(0)
        return OutlierNet(width=args.width, hidden=args.hidden)

    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:  # the bare torch loop: bf16 autocast, backward, AdamW
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, batch)
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    probe = net()  # plan an untrained copy, as before training
    step()
    ag.fp8_plan(probe, loss_fn, batch, formats=SETS[-1])  # warm-up: imports, nominal figures
    plans: dict[int, list[float]] = {len(s): [] for s in SETS}
    steps = []
    for _ in range(args.rounds):
        for formats in SETS:
            plans[len(formats)].append(
                _timed(lambda f=formats: ag.fp8_plan(probe, loss_fn, batch, formats=f))
            )
            steps.append(_timed(step))
    s = statistics.median(steps)
    print(
        f"torch {torch.__version__}, CPU threads {args.threads}, OutlierNet width {args.width} "
        f"hidden {args.hidden}, batch {args.batch}; one bare bf16 step {s * 1e3:.1f} ms "
        f"(median of {len(steps)})"
    )
    print(f"{'formats':44} {'plan ms':>8} {'x step':>7}")
    for formats in SETS:
        p = statistics.median(plans[len(formats)])
        print(f"{', '.join(formats):44} {p * 1e3:8.1f} {p / s:7.2f}")
    plan = ag.fp8_plan(probe, loss_fn, batch, formats=SETS[-1])
    print()
    print(plan.summary())


if __name__ == "__main__":
    main()
