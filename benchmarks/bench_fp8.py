"""fp8 on a small transformer-like model with one outlier-feature layer: the plan's table, the
final loss of bf16, naive fp8 (every Linear) and planned fp8 as gaps to bf16, and the plan's cost
as a ratio to one training step.

Run: ``python benchmarks/bench_fp8.py [--steps 150] [--rounds 5]``. The model is
``ampguard.demo.fp8_model.OutlierNet`` (the ``head``'s input carries an outlier feature of
``--outlier``, default 1e5, about 1.5e5x the median input).
Every variant trains from the same weights on the same batches. On a device without fp8 matmuls
(CPU, GPUs before sm_89) the fp8 figures are EMULATED (torchao emulate=True: real fp8 casts, the
matmul in high precision): the losses are what fp8 numerics give, the times are not fp8 speed.
The plan's cost is the median of ``--rounds`` interleaved rounds (plan, then one planned-fp8
step), as a ratio to the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import ampguard as ag
from ampguard.demo.fp8_model import OutlierNet, loss_fn, make_task

OUTLIER = 1e5  # the planted feature's value (--outlier)


def _train(
    precision: str, plan: ag.Fp8Plan | None, task: object, seed: int, device: str
) -> tuple[float, float]:
    """(final train loss: mean of the last tenth, eval loss) after training ``task``."""
    torch.manual_seed(seed)
    model = OutlierNet(outlier=OUTLIER).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(model, opt, precision=precision, fp8_plan=plan)
    losses = []
    for x, y in task.batches():
        with guard.autocast():
            loss = loss_fn(model, (x.to(device), y.to(device)))
        guard.backward(loss)
        guard.step()
        losses.append(loss.detach())
    tail = torch.stack(losses[-max(1, len(losses) // 10) :]).mean().item()
    with torch.no_grad(), guard.autocast():
        ev = loss_fn(model, (task.eval_x.to(device), task.eval_y.to(device))).item()
    return tail, ev


def _plan_cost(task: object, seed: int, rounds: int, device: str) -> tuple[float, float, float]:
    """(median plan seconds, median planned-fp8 step seconds, ratio), interleaved rounds."""
    torch.manual_seed(seed)
    model = OutlierNet(outlier=OUTLIER).to(device)
    batch = tuple(t.to(device) for t in next(task.batches()))
    plan = ag.fp8_plan(model, loss_fn, batch)  # warm-up
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = ag.Guard(model, opt, precision="fp8", fp8_plan=plan)

    def step() -> None:
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step()

    def timed(fn: object) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    step()  # warm-up
    plans, steps = [], []
    probe = OutlierNet(outlier=OUTLIER).to(device)  # plan an unconverted copy, as before training
    for _ in range(rounds):
        plans.append(timed(lambda: ag.fp8_plan(probe, loss_fn, batch)))
        steps.append(timed(step))
    p, s = statistics.median(plans), statistics.median(steps)
    return p, s, p / s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--outlier",
        type=float,
        default=1e5,
        help="value of the planted outlier feature (default 1e5)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    global OUTLIER
    OUTLIER = args.outlier
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", RuntimeWarning)  # the emulation notice: said below
    from ampguard.fp8._convert import has_fp8_matmul

    emulated = not has_fp8_matmul(torch.device(args.device))
    mark = " (EMULATED fp8)" if emulated else ""
    print(
        f"torch {torch.__version__}, device {args.device}{mark}, {args.steps} steps, "
        f"seed {args.seed}, outlier feature {args.outlier:g}"
    )
    task = make_task(seed=args.seed, steps=args.steps)
    torch.manual_seed(args.seed)
    probe = OutlierNet(outlier=OUTLIER).to(args.device)
    plan = ag.fp8_plan(probe, loss_fn, tuple(t.to(args.device) for t in next(task.batches())))
    print(plan.summary())
    print()
    rows = {}
    for name, precision, p in (
        ("fp32", "fp32", None),
        ("bf16", "bf16", None),
        ("fp8 naive (all Linear)", "fp8", None),
        ("fp8 planned", "fp8", plan),
    ):
        rows[name] = _train(precision, p, task, args.seed, args.device)
    base_tail, base_eval = rows["bf16"]
    print(
        f"{'variant':24} {'final train loss':>16} {'gap to bf16':>12} {'eval loss':>10} "
        f"{'gap to bf16':>12}"
    )
    for name, (tail, ev) in rows.items():
        star = mark if name.startswith("fp8") else ""
        print(
            f"{name:24} {tail:16.4f} {tail - base_tail:+12.4f} {ev:10.4f} "
            f"{ev - base_eval:+12.4f}{star}"
        )
    p, s, ratio = _plan_cost(task, args.seed, args.rounds, args.device)
    print(
        f"\nplan cost: {p * 1e3:.1f} ms = {ratio:.2f}x one planned-fp8 training step "
        f"({s * 1e3:.1f} ms{', emulated' if emulated else ''}), median of {args.rounds} "
        "interleaved rounds"
    )


if __name__ == "__main__":
    main()
