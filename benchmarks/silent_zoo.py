"""The silent-failure zoo: per case, what ``ag.locate``, a Guard (or watched) run and the advisor
said, against what the case expects.

Run: ``python benchmarks/silent_zoo.py [--case NAME ...] [--json OUT]``. The cases live in
``benchmarks/zoo/`` (one file each; the interface is in ``benchmarks/zoo/__init__.py``). Every
case is built afresh for each of the three tools, so the training run cannot change what
``locate`` or the advisor see. Exit status 1 when some expectation is not met.

Each case is a *silent* failure: nothing non-finite reaches the loss or the gradients of a
training step (or, for the advisor's cases, the module-level range check cannot see it), so a
bare ``torch.amp.GradScaler`` never notices.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import zoo  # noqa: E402

import ampguard as ag  # noqa: E402

__all__ = ["run_case", "main"]


def _locate(case: zoo.Case) -> dict[str, Any]:
    precision = case.guard_kwargs.get("precision", "fp16")
    d = ag.locate(case.model, case.loss_fn, case.batches[0], precision, **case.locate_kwargs)
    return {"kind": d.kind, "code": d.code, "module": d.module, "op": d.op, "text": str(d)}


def _train(case: zoo.Case, run_dir: Path) -> list[ag.Finding]:
    kwargs = {"precision": "fp16", **case.guard_kwargs}
    telemetry = ag.Telemetry(run_dir, range_every=2, flush_every=max(2, case.steps))
    if case.loop == "watch":
        dtype = torch.float16 if kwargs["precision"] == "fp16" else torch.bfloat16
        device = next(case.model.parameters()).device.type
        with ag.watch(
            None, case.model, case.optimizer, telemetry, precision=kwargs["precision"]
        ) as w:
            for i in range(case.steps):
                with torch.autocast(device, dtype=dtype):
                    loss = case.loss_fn(case.model, case.batches[i % len(case.batches)])
                loss.backward()
                case.optimizer.step()
                case.optimizer.zero_grad()
            return w.findings()
    with ag.Guard(case.model, case.optimizer, telemetry=telemetry, **kwargs) as guard:
        for i in range(case.steps):
            with guard.autocast():
                loss = case.loss_fn(case.model, case.batches[i % len(case.batches)])
            guard.backward(loss)
            guard.step()
        return guard.findings()


def _advise(case: zoo.Case) -> list[ag.Finding]:
    return ag.inspect_model(case.model, case.batches[0], case.loss_fn, optimizer=case.optimizer)


def _module_of(finding: ag.Finding) -> str | None:
    ev = finding.evidence or {}
    for key in ("module", "layer"):
        if isinstance(ev.get(key), str):
            return ev[key]
    modules = ev.get("modules")
    if isinstance(modules, dict) and modules:
        return next(iter(modules))
    return None


def run_case(case_module: ModuleType) -> dict[str, Any]:
    """Run one zoo case through locate, training and the advisor; returns what each said and
    ``ok`` / ``misses`` against the case's EXPECT."""
    expect = dict(case_module.EXPECT)
    out: dict[str, Any] = {"name": case_module.NAME, "description": case_module.DESCRIPTION}
    t0 = time.perf_counter()
    out["locate"] = _locate(case_module.build())
    with tempfile.TemporaryDirectory() as tmp:
        found = _train(case_module.build(), Path(tmp) / "run")
    out["guard"] = [{"code": f.code, "title": f.title, "module": _module_of(f)} for f in found]
    advice = _advise(case_module.build())
    out["advisor"] = [{"code": f.code, "title": f.title, "module": _module_of(f)} for f in advice]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    misses = []
    if "locate" in expect and out["locate"]["kind"] != expect["locate"]:
        misses.append(f"locate said {out['locate']['kind']!r}, expected {expect['locate']!r}")
    for tool in ("guard", "advisor"):
        if tool not in expect:
            continue
        hits = [f for f in out[tool] if f["code"] == expect[tool]]
        if not hits:
            misses.append(f"{tool} did not say {expect[tool]}")
        elif "module" in expect and all(f["module"] != expect["module"] for f in hits):
            misses.append(f"{tool}'s {expect[tool]} does not name {expect['module']!r}")
    if "module" in expect and "locate" in expect and out["locate"]["module"] != expect["module"]:
        misses.append(f"locate named {out['locate']['module']!r}, expected {expect['module']!r}")
    out["misses"] = misses
    out["ok"] = not misses
    return out


def _print(result: dict[str, Any]) -> None:
    mark = "ok  " if result["ok"] else "MISS"
    print(f"[{mark}] {result['name']}: {result['description']} ({result['seconds']} s)")
    print(f"       locate : {result['locate']['text']}")
    for tool in ("guard", "advisor"):
        said = ", ".join(
            f"{f['code']}" + (f" ({f['module']!r})" if f["module"] is not None else "")
            for f in result[tool]
        )
        print(f"       {tool:7}: {said or '(nothing)'}")
    for miss in result["misses"]:
        print(f"       miss   : {miss}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="run only this case (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = list(zoo.discover())
    if args.case:
        known = {m.NAME for m in cases}
        unknown = sorted(set(args.case) - known)
        if unknown:
            parser.error(f"--case {unknown[0]!r} is not a zoo case; known: {sorted(known)}")
        cases = [m for m in cases if m.NAME in args.case]
    results = []
    for module in cases:
        result = run_case(module)
        _print(result)
        results.append(result)
    caught = sum(r["ok"] for r in results)
    print(f"\n{caught} of {len(results)} silent failures named as expected")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
