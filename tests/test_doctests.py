"""The ``>>>`` examples in the package's docstrings run, in a small shared namespace.

Each module with examples is imported and its docstrings run with :mod:`doctest` in a fresh
folder, with ``torch``, ``F``, ``nn``, ``ag``, a tiny ``model`` (``body`` -> ``act`` ->
``head``), ``optimizer``/``opt``, ``data``, ``x``, ``y``, ``batch`` and ``loss_fn`` defined.
Examples that need CUDA, several processes or a framework's full run are listed in :data:`SKIP`
with the reason; a module whose optional dependency is missing is skipped.
"""

from __future__ import annotations

import doctest
import importlib
import io
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag

SRC = Path(__file__).resolve().parents[1] / "src" / "ampguard"
# Docstrings (doctest names) whose examples need what a doctest cannot build here.
SKIP = {
    "ampguard.testing.inject_fault": "needs the user's model (an fc1 layer) and training loop",
    "ampguard.forensics._locate.locate": "needs a model that overflows in fp16",
    "ampguard.forensics.autocast_coverage.coverage": "needs a model with an escaped module",
    "ampguard.checkpoint.distributed": "needs a torch.distributed process group",
    "ampguard.distributed.hooks": "needs a DDP model in a process group",
    "ampguard.integrations.watch": "needs CUDA (torch.amp.GradScaler('cuda'))",
    "ampguard.integrations.accelerate": "needs an Accelerator run on CUDA",
    "ampguard.integrations.lightning": "needs a Lightning Trainer run",
    "ampguard.integrations.transformers": "needs a Hugging Face Trainer run",
    "ampguard.integrations.sinks": "needs W&B / MLflow accounts",
    # the fp8 branch: its summary prints timings; give it an expected output, then drop
    "ampguard.fp8": "prints a plan with timings (no expected output yet)",
}


def _modules_with_examples() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__main__" or ">>>" not in path.read_text(encoding="utf-8"):
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out.append(".".join(parts))
    return out


def _namespace() -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(body=nn.Linear(8, 16), act=nn.ReLU(), head=nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def make_experiment() -> ag.Experiment:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return ag.Experiment(
            m,
            torch.optim.SGD(m.parameters(), lr=0.01),
            [(x, y)] * 2,
            lambda mm, b: F.mse_loss(mm(b[0]), b[1]),
        )

    ns: dict[str, object] = {
        "torch": torch,
        "F": F,
        "nn": nn,
        "ag": ag,
        "ampguard": ag,
        "model": model,
        "optimizer": optimizer,
        "opt": optimizer,
        "x": x,
        "y": y,
        "data": [(x, y)] * 3,
        "batch": (x, y),
        "loss_fn": _loss_fn,
        "make_experiment": make_experiment,
    }
    return ns


def _loss_fn(a: object, b: object) -> torch.Tensor:
    """``loss_fn(output, target)`` in training loops, ``loss_fn(model, batch)`` in probes."""
    if isinstance(a, nn.Module):
        x, y = b  # type: ignore[misc]
        return F.mse_loss(a(x), y)
    return F.mse_loss(a, b)  # type: ignore[arg-type]


def _a_run(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    with ag.Guard(model, optimizer, precision="fp16", telemetry="runs/exp1") as guard:
        for x, y in data:
            with guard.autocast():
                loss = F.mse_loss(model(x), y)
            guard.backward(loss)
            guard.step()


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # an optional extra is not installed
        pytest.skip(f"{name}: {exc}")
    ns = _namespace()
    if name.startswith("ampguard.reporting"):  # its examples read a run folder
        pytest.importorskip("matplotlib")
        _a_run(ns["model"], ns["optimizer"], ns["data"])  # type: ignore[arg-type]
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = io.StringIO()
    tests = finder.find(module, name, globs={**vars(module), **ns})
    assert tests, f"{name} has '>>>' but doctest found no example"
    if all(t.name in SKIP for t in tests if t.examples):
        pytest.skip("; ".join(SKIP[t.name] for t in tests if t.examples))
    for test in tests:
        if test.name in SKIP:
            continue
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()
