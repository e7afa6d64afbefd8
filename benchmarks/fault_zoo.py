"""The fault zoo: planted hardware faults, numerics cases and model/data bugs, triaged by ampguard
and by two peers' methods reimplemented here.

Run: ``python benchmarks/fault_zoo.py [--events 300] [--clean 200] [--gpt2 N] [--json OUT]``
(``--gpt2``: planted faults in HF GPT-2, for the replay cost on a real model:
:mod:`_fault_gpt2`).

* **Injected faults** (``ampguard.testing.inject_fault``): every bit class (exponent top bit,
  exponent low bit, mantissa top bit) x forward/backward x transient/persistent, in a module's
  output (Linear, GELU) or an op's output (``aten.addmm`` forward, ``aten.mm`` backward), at a
  random element, in a bf16 MLP. The step it strikes is the trigger (as a non-finite loss, a
  spike or an audit mismatch would name it).
* **Numerics**: the forensics zoo's cases (``benchmarks/zoo``) plus an fp16 overflow; **model or
  data**: a NaN in the batch, ``log(0)`` in the loss, an inf weight.
* **Clean steps**: steps with no fault, triaged as if named: any fault verdict is a false alarm.

Methods, each given the failed step:

* ``megatron``: Megatron's rerun state machine, reimplemented: rerun the step on the same
  device; a different loss is transient; the same loss is rerun on a *spare* device (here: the
  reference device); a different loss there is persistent, else "not a fault". Names nothing.
* ``torchtitan``: torchtitan's SDC check, reimplemented: replay the step and compare the loss and
  a gradient checksum; a mismatch raises (transient), a match says nothing. Names nothing.
* ``ampguard``: ``ag.triage`` (``ampguard.forensics.triage_step``), signatures recorded by
  ``ag.SignatureRecorder``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402
from _fault_gpt2 import run_gpt2  # noqa: E402
from _fault_inject import judged  # noqa: E402

import ampguard as ag  # noqa: E402
from ampguard.distributed import param_checksum  # noqa: E402
from ampguard.forensics import triage_step  # noqa: E402
from ampguard.replay import Preserved  # noqa: E402
from ampguard.testing import BITS, SyncCounter, inject_fault, on_reference_device  # noqa: E402

FAULTS = ("transient_fault", "persistent_fault")


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )


def _loss(m: nn.Module, b: Any) -> torch.Tensor:
    return F.mse_loss(m(b[0]).float(), b[1])


def _step(model, loss_fn, batch, precision, scale) -> tuple[float, int]:
    """One forward+backward; (loss, gradient checksum) as a peer's replay compares them."""
    model.zero_grad(set_to_none=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model, batch)
    (loss.float() * scale).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    check = param_checksum(grads) if grads else torch.zeros(())
    return float(loss.detach().float()), int(check)


def _same(a: tuple[float, int], b: tuple[float, int]) -> bool:
    return (a[0] == b[0] or (a[0] != a[0] and b[0] != b[0])) and a[1] == b[1]


def megatron(model, loss_fn, batch, precision, scale, recorded) -> dict[str, Any]:
    keep = Preserved(model)
    try:
        keep.reset()
        again = _step(model, loss_fn, batch, precision, scale)
        if not _same(again, recorded):
            return {"cause": "transient_fault"}
        keep.reset()
        with on_reference_device():  # the spare GPU
            spare = _step(model, loss_fn, batch, precision, scale)
        return {"cause": "persistent_fault" if not _same(spare, recorded) else "not_fault"}
    finally:
        keep.close()


def torchtitan(model, loss_fn, batch, precision, scale, recorded) -> dict[str, Any]:
    keep = Preserved(model)
    try:
        keep.reset()
        again = _step(model, loss_fn, batch, precision, scale)
        return {"cause": "transient_fault" if not _same(again, recorded) else "not_fault"}
    finally:
        keep.close()


def _record(model, loss_fn, batch, precision, scale):
    """Run the failed step once with signatures recorded; the state it started from is kept."""
    keep = Preserved(model)
    rec = ag.SignatureRecorder(model, capacity=1)
    keep.reset()
    peer = _step(model, loss_fn, batch, precision, scale)
    rec.remove()
    sig = rec.read(rec.steps[-1])
    keep.reset()
    keep.close()
    return sig, peer, rec.rng_state(sig.step)


def _step_time(model, loss_fn, batch, precision, scale) -> float:
    """One step-equivalent: a forward+backward of the step at its precision (the median of
    5, after one warm-up), the state put back. CPU time of this process (``process_time``,
    one thread), as the triage is timed: the other processes' load on a shared machine does
    not count."""
    keep = Preserved(model)
    try:
        times = []
        for _ in range(6):
            keep.reset()
            t0 = time.process_time()
            _step(model, loss_fn, batch, precision, scale)
            times.append(time.process_time() - t0)
        return statistics.median(times[1:])
    finally:
        keep.close()


def _judge(model, loss_fn, batch, precision, scale, optimizer=None) -> dict[str, dict[str, Any]]:
    sig, peer, rng = _record(model, loss_fn, batch, precision, scale)
    out = {}
    t0 = time.process_time()
    ev = triage_step(
        model,
        loss_fn,
        batch,
        sig,
        precision=precision,
        scale=scale,
        rng_state=rng,
        optimizer=optimizer,
    )
    spent = time.process_time() - t0
    out["ampguard"] = {
        "cause": ev.cause,
        "module": ev.module,
        "op": ev.op,
        "phase": ev.phase,
        "s": spent,
        "step_equiv": spent / _step_time(model, loss_fn, batch, precision, scale),
    }
    out["megatron"] = megatron(model, loss_fn, batch, precision, scale, peer)
    out["torchtitan"] = torchtitan(model, loss_fn, batch, precision, scale, peer)
    return out


def _fault_events(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cells = [
        (bit, phase, persistent, target)
        for bit in BITS
        for phase in ("forward", "backward")
        for persistent in (False, True)
        for target in ("module", "op")
    ]
    events = []
    for i in range(n):
        bit, phase, persistent, target = cells[i % len(cells)]
        if target == "op":  # a first layer's backward runs outside its backward hooks' scope
            pool = ["0", "2", "4"] if phase == "forward" else ["2", "4"]
        else:
            pool = ["0", "1", "2", "3", "4"] if phase == "forward" else ["0", "2", "4"]
        module = rng.choice(pool)
        op = None
        if target == "op":
            op = "aten.addmm" if phase == "forward" else "aten.mm"
        events.append(
            {
                "bit": bit,
                "phase": phase,
                "persistent": persistent,
                "module": module,
                "op": op,
                "element": rng.randrange(256),
                "seed": rng.randrange(10**6),
            }
        )
    return events


def _expected_op(e: dict[str, Any]) -> str:
    if e["op"] is not None:
        return e["op"]
    if e["phase"] == "forward":
        return "aten.gelu" if e["module"] in ("1", "3") else "aten.addmm"
    return "aten.mm"


def run_fault(e: dict[str, Any]) -> dict[str, Any]:
    model = _mlp(e["seed"] % 7)
    g = torch.Generator().manual_seed(e["seed"])
    batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    return judged(model, _loss, batch, e, _judge, _expected_op(e))


def _numerics_cases() -> list[tuple[str, Any, Any, Any, str, float, str, Any]]:
    cases = []
    for mod in zoo.discover():
        case = mod.build()
        precision = case.guard_kwargs.get("precision", "fp16")
        scale = case.locate_kwargs.get("scale", 2.0**16 if precision == "fp16" else 1.0)
        opt = case.locate_kwargs.get("optimizer")
        cases.append(
            (mod.NAME, case.model, case.loss_fn, case.batches[0], precision, scale, "numerics", opt)
        )

    class Hot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(self.fc1(x) * 3000.0)

    torch.manual_seed(0)
    cases.append(
        (
            "fp16_overflow",
            Hot(),
            _loss,
            (torch.randn(8, 16) * 30, torch.randn(8, 4)),
            "fp16",
            2.0**16,
            "numerics",
            None,
        )
    )
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    xn = x.clone()
    xn[2, 3] = float("nan")
    cases.append(("nan_in_batch", _mlp(1), _loss, (xn, y), "bf16", 1.0, "model_or_data", None))
    cases.append(
        (
            "log_zero",
            _mlp(2),
            lambda m, b: -torch.log(torch.relu(m(b[0]).float()) * 0).mean(),
            (x, y),
            "bf16",
            1.0,
            "model_or_data",
            None,
        )
    )
    m = _mlp(3)
    with torch.no_grad():
        m[2].weight[0, 0] = float("inf")
    cases.append(("inf_weight", m, _loss, (x, y), "bf16", 1.0, "model_or_data", None))
    return cases


def run_numerics() -> list[dict[str, Any]]:
    rows = []
    for name, model, loss_fn, batch, precision, scale, want, opt in _numerics_cases():
        res = _judge(model, loss_fn, batch, precision, scale, opt)
        rows.append({"case": name, "want": want, **res})
    return rows


def _clean_models() -> dict[str, Any]:
    """Small models for the clean steps: name -> (build(seed) -> (model, loss_fn, batch(i)),
    precision, scale)."""

    def mlp(seed):
        return _mlp(seed % 5), _loss, lambda i: _pair(i, (8, 16), (8, 4))

    def ln_dropout(seed):
        torch.manual_seed(seed % 5)
        m = nn.Sequential(
            nn.Linear(16, 32), nn.LayerNorm(32), nn.Dropout(0.1), nn.GELU(), nn.Linear(32, 4)
        )
        return m, _loss, lambda i: _pair(i, (8, 16), (8, 4))

    def conv(seed):
        torch.manual_seed(seed % 5)
        m = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4)
        )
        return m, _loss, lambda i: _pair(i, (4, 3, 8, 8), (4, 4))

    def gpt2(seed):
        import transformers

        torch.manual_seed(seed % 5)
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64
        )
        m = transformers.GPT2LMHeadModel(config)

        def batch(i):
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
            return (ids,)

        return m, lambda model, b: model(input_ids=b[0], labels=b[0]).loss, batch

    return {
        "MLP bf16": (mlp, "bf16", 1.0),
        "MLP fp16 (scale 2**16)": (mlp, "fp16", 2.0**16),
        "LayerNorm+dropout MLP bf16": (ln_dropout, "bf16", 1.0),
        "conv net bf16": (conv, "bf16", 1.0),
        "GPT-2 (1 layer, width 32) bf16": (gpt2, "bf16", 1.0),
    }


def _pair(i: int, xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + i)
    return torch.randn(*xs, generator=g), torch.randn(*ys, generator=g)


def _fault_half(model, loss_fn, batch, sig, precision, scale, rng) -> str:
    """The part of ``triage_step`` that can give a fault verdict, alone: the replay at the
    same precision compared with the record, then the reference check of every module (the
    fp32 replay and ``locate`` after it only tell numerics from model/data)."""
    from ampguard.core.policy import device_of, resolve_precision
    from ampguard.forensics._faultcheck import reference_check
    from ampguard.forensics._triage_runs import compare, run

    policy = resolve_precision(precision, device_of(model.parameters()))
    keep = Preserved(model, rng)
    try:
        keep.reset()
        low = run(model, loss_fn, batch, policy, scale, capture=True)
        if compare(sig, low) is not None:
            return "transient_fault"
        assert low.captures is not None
        if reference_check(model, low.captures, policy) is not None:
            return "persistent_fault"
        return "not_fault"
    finally:
        keep.close()


def run_clean(n: int, full: bool = False) -> dict[str, dict[str, Any]]:
    """``n`` clean steps (no fault), split 3:2:2:2:1 over the small models of
    :func:`_clean_models`, each
    recorded and then triaged by ampguard as if named failed: any fault verdict is a false
    alarm. A model is rebuilt every 50 steps (new seed). ``full``: the whole ``triage_step``;
    else its fault half (:func:`_fault_half`), the part that can give a fault verdict."""
    from collections import Counter

    models = _clean_models()
    weights = [3, 2, 2, 2, 1]  # GPT-2's triage costs the most: a tenth of the steps
    out = {}
    for (name, (build, precision, scale)), w in zip(models.items(), weights, strict=True):
        per = max(1, n * w // sum(weights))
        causes: Counter[str] = Counter()
        spent = 0.0
        for i in range(per):
            if i % 50 == 0:
                model, loss_fn, batch_of = build(i // 50)
            batch = batch_of(i)
            sig, _, rng = _record(model, loss_fn, batch, precision, scale)
            t0 = time.perf_counter()
            if full:
                ev = triage_step(
                    model, loss_fn, batch, sig, precision=precision, scale=scale, rng_state=rng
                )
                cause = ev.cause
            else:
                cause = _fault_half(model, loss_fn, batch, sig, precision, scale, rng)
            spent += time.perf_counter() - t0
            causes[cause] += 1
            if (i + 1) % 500 == 0:
                print(f"  ... clean, {name}: {i + 1} steps, {dict(causes)}", flush=True)
        out[name] = {
            "steps": per,
            "alarms": sum(causes[c] for c in FAULTS),
            "causes": dict(causes),
            "ms_per_step": 1e3 * spent / per,
        }
    return out


def _toy() -> tuple[nn.Module, Any]:
    model = _mlp(0)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    return model, lambda m: _loss(m, (x, y))


def _gpt2() -> tuple[nn.Module, Any]:
    """The real HF GPT-2 code, small: 2 layers, width 128, 4 heads, 64 positions, vocab 512
    (dropout 0.1 on, as GPT2Config has it)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


MODELS = {"toy": (_toy, 64, 61), "gpt2": (_gpt2, 4, 31)}  # (build, steps per round, rounds)


def overhead(model_name: str = "toy", rounds: int | None = None) -> dict[str, Any]:
    """Step time and host syncs of a bf16 Guard step with AdamW: bare, bare again (a second
    identical loop: the noise floor), with signatures on every window (``signatures=1``) and
    with the default (``signatures=True``: one window in 32). The loops are interleaved in
    rounds in a rotating order, so the machine's load hits them alike, and timed in this
    thread's CPU time (one torch thread: the steps run here; waits for the loaded machine are
    left out); the ratio is the median over the rounds of the variant's mean over bare's."""
    from ampguard.guard._signatures import DEFAULT_EVERY

    build, steps, default_rounds = MODELS[model_name]
    rounds = rounds or default_rounds
    loops = {}
    variants = (
        ("bare", False),
        ("bare again (the noise floor)", False),
        ("every=1", 1),
        (f"default (1 in {DEFAULT_EVERY})", True),
    )
    for name, sig in variants:
        model, loss_of = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = ag.Guard(
            model, opt, precision="bf16", flight_recorder=False, on_spike=None, signatures=sig
        )

        def step(model=model, guard=guard, loss_of=loss_of) -> None:
            with guard.autocast():
                loss = loss_of(model)
            guard.backward(loss)
            guard.step()

        for _ in range(max(8, steps // 8)):
            step()
        with SyncCounter() as syncs:
            for _ in range(DEFAULT_EVERY):
                step()
        loops[name] = (step, syncs.count / DEFAULT_EVERY)
    means: dict[str, list[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = loops[name][0]
            t0 = time.thread_time()  # CPU time of this thread: the load's waits left out
            for _ in range(steps):
                step()
            means[name].append((time.thread_time() - t0) / steps)
    # each round's variant / bare (chunks next to each other share the machine's load), median
    return {
        k: {
            "median_ms": 1e3 * statistics.median(v),
            "ratio": statistics.median(a / b for a, b in zip(v, means["bare"], strict=True)),
            "syncs": loops[k][1],
        }
        for k, v in means.items()
    }


def _ddp_rank(rank: int, port: int, events: list[dict[str, Any]], out: Any) -> None:
    """One of 2 gloo ranks: each event trains 2 DDP windows with the fault on rank 1 at window
    1, then every rank calls ``ag.triage(guard, step=1)``; rank 0 reports the verdicts."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for e in events:
        inner = _mlp(e["seed"] % 7)
        model = nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guard = ag.Guard(
            model,
            opt,
            precision="bf16",
            snapshot_every=1,
            signatures=1,
            audit_every=None,
            on_spike=None,
        )
        inj = inject_fault(
            inner,
            module=e["module"],
            op=e["op"],
            bit=e["bit"],
            phase=e["phase"],
            persistent=e["persistent"],
            element=e["element"],
            rank=1,
            step=1,
            guard=guard,
        ).__enter__()
        for step in range(2):
            g = torch.Generator().manual_seed(e["seed"] + 100 * step + rank)
            b = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            with guard.autocast():
                loss = _loss(model, b)
            guard.backward(loss)
            guard.step(batch=b, loss_fn=_loss)
        (ev,) = ag.triage(guard, step=1)
        inj.remove()
        rows.append({"cause": ev.cause, "module": ev.module, "op": ev.op, "rank": ev.rank})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run_ddp(n: int) -> list[dict[str, Any]]:
    """``n`` injected events on 1 of 2 real gloo ranks (the last ``n`` of the zoo's cells)."""
    import socket

    import torch.multiprocessing as mp

    events = _fault_events(n, 1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, port, events, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(60)
    want = ["persistent_fault" if e["persistent"] else "transient_fault" for e in events]
    return [
        {"event": e, "want": w, "want_op": _expected_op(e), "ampguard": r}
        for e, w, r in zip(events, want, rows, strict=True)
    ]


def _score(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    faults = [r for r in rows if "event" in r]
    verdict = sum(r[method]["cause"] == r["want"] for r in faults)
    module = sum(r[method].get("module") == r["event"]["module"] for r in faults)
    pers = [r for r in faults if r["want"] == "persistent_fault"]
    op = sum(r[method].get("op") == r["want_op"] for r in pers)
    return {
        "events": len(faults),
        "verdict": verdict,
        "module": module,
        "op": op,
        "persistent": len(pers),
    }


def _print_gpt2(rows: list[dict[str, Any]]) -> None:
    s = _score(rows, "ampguard")
    cases = [r for r in rows if "case" in r]
    print(
        f"HF GPT-2 (2 layers, width 128, batch 4x64, bf16): {s['events']} planted faults, verdict "
        f"{s['verdict']}/{s['events']}, module {s['module']}/{s['events']}, op "
        f"{s['op']}/{s['persistent']}; "
        + ", ".join(f"{r['case']}: {r['ampguard']['cause']}" for r in cases)
    )
    print(f"  {'class':<22} {'events':>6} {'median':>7} {'mean':>6} {'max':>6}")
    for cls in ("transient_fault", "persistent_fault", "model_or_data", "not_fault (silent)"):
        eq = sorted(r["ampguard"]["step_equiv"] for r in rows if r["want"] == cls)
        if eq:
            print(
                f"  {cls:<22} {len(eq):>6} {statistics.median(eq):>7.1f} "
                f"{sum(eq) / len(eq):>6.1f} {eq[-1]:>6.1f}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--clean", type=int, default=200)
    parser.add_argument("--ddp", type=int, default=24, help="events on 1 of 2 gloo ranks")
    parser.add_argument(
        "--gpt2", type=int, default=0, help="planted faults in HF GPT-2 (2 x 128): their cost"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--clean-full",
        action="store_true",
        help="clean steps: the whole triage, not its fault half",
    )
    parser.add_argument(
        "--cost", nargs="*", default=["toy", "gpt2"], choices=sorted(MODELS), help="models timed"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cost = {m: overhead(m) for m in args.cost}  # first: the replays leave the allocator warm
    t0 = time.perf_counter()
    faults = [run_fault(e) for e in _fault_events(args.events, 0)]
    numerics = run_numerics()
    alarms = run_clean(args.clean, full=args.clean_full)
    ddp = run_ddp(args.ddp) if args.ddp else []
    gpt2 = run_gpt2(args.gpt2, _judge) if args.gpt2 else []
    wall = time.perf_counter() - t0
    print(
        f"fault zoo: {len(faults)} injected events, {len(numerics)} numerics/model cases, "
        f"{args.clean} clean steps ({wall:.0f} s)"
    )
    print(
        f"{'method':<11} {'verdict':>10} {'module':>10} {'op (pers.)':>11} "
        f"{'num/model: fault verdicts':>27}  spare device"
    )
    for method in ("megatron", "torchtitan", "ampguard"):
        s = _score(faults, method)
        false = sum(r[method]["cause"] in FAULTS for r in numerics)
        spare = "needs one" if method == "megatron" else "no"
        print(
            f"{method:<11} {s['verdict']:>4}/{s['events']:<5} {s['module']:>4}/{s['events']:<5} "
            f"{s['op']:>4}/{s['persistent']:<6} {false:>13}/{len(numerics):<13}  {spare}"
        )
    right = sum(r["ampguard"]["cause"] == r["want"] for r in numerics)
    print(
        f"ampguard on numerics/model cases: {right}/{len(numerics)} right class; "
        f"clean steps: {sum(c['alarms'] for c in alarms.values())} fault verdicts in "
        f"{sum(c['steps'] for c in alarms.values())}"
    )
    if ddp:
        s = _score(ddp, "ampguard")
        ranks = sum(r["ampguard"]["rank"] == 1 for r in ddp)
        print(
            f"DDP, 2 gloo ranks, fault on rank 1: verdict {s['verdict']}/{s['events']}, "
            f"module {s['module']}/{s['events']}, op {s['op']}/{s['persistent']}, "
            f"rank named {ranks}/{len(ddp)} (every rank returns the same events)"
        )
    for name, c in alarms.items():
        print(
            f"  clean, {name}: {c['alarms']} fault verdicts in {c['steps']} steps "
            f"({c['ms_per_step']:.0f} ms of triage per step; {c['causes']})"
        )
    mean = sum(r["ampguard"]["s"] for r in faults) / max(len(faults), 1)
    print(f"ampguard triage: {1e3 * mean:.0f} ms per event (mean)")
    print("replay cost per event, in step-equivalents (one forward+backward at the precision):")
    print(f"  {'class':<22} {'events':>6} {'median':>7} {'mean':>6} {'max':>6}")
    for cls in ("transient_fault", "persistent_fault", "numerics", "model_or_data"):
        eq = sorted(r["ampguard"]["step_equiv"] for r in faults + numerics if r["want"] == cls)
        if eq:
            print(
                f"  {cls:<22} {len(eq):>6} {statistics.median(eq):>7.1f} "
                f"{sum(eq) / len(eq):>6.1f} {eq[-1]:>6.1f}"
            )
    if gpt2:
        _print_gpt2(gpt2)
    for model_name, res in cost.items():
        print(
            f"signature cost, {model_name} (bf16, CPU; bare {res['bare']['median_ms']:.2f} ms "
            "per step): "
            + ", ".join(
                f"{k}: {v['ratio']:.3f}x, {v['syncs']:.0f} syncs/step"
                for k, v in res.items()
                if k != "bare"
            )
            + f" (bare: {res['bare']['syncs']:.0f} syncs/step)"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "faults": faults,
                    "numerics": numerics,
                    "clean": alarms,
                    "overhead": cost,
                    "ddp": ddp,
                    "gpt2": gpt2,
                },
                default=str,
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
