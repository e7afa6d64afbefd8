"""A type checker sees ampguard's public API: ``ag.Guard`` is the class, not ``Any``.

``ampguard/__init__`` re-exports lazily (PEP 562 ``__getattr__``), which a checker cannot follow;
its ``if TYPE_CHECKING:`` imports are what make the names real. This runs mypy (skipped when it is
not installed) on a snippet that uses the package the way a user would. It shares mypy's cache
with ``mypy`` at the repository root (same config, same folder), so a warm run takes a second.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ampguard

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """\
import torch

import ampguard as ag

model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g: ag.Guard = ag.Guard(model, optimizer)
reveal_type(g)
reveal_type(g.step(loss=torch.zeros(())))
reveal_type(ag.compare)
reveal_type(ag.fp8_plan)
reveal_type(ag.lint_source)
g.no_such_attribute
"""


def _mypy(tmp_path: Path, source: str) -> list[str]:
    """mypy's lines about ``source`` (not about the modules it imports)."""
    snippet = tmp_path / "ampguard_typing_snippet.py"
    snippet.write_text(textwrap.dedent(source))
    env = dict(os.environ)
    package_root = Path(ampguard.__file__).resolve().parents[1]
    if package_root.name not in ("site-packages", "dist-packages"):
        # a checkout (editable install or PYTHONPATH): check the tree the tests import;
        # an installed wheel is found through its py.typed marker instead
        env["MYPYPATH"] = str(package_root)
    config = ROOT / "pyproject.toml"
    cmd = [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context", str(snippet)]
    if config.is_file():
        cmd[3:3] = ["--config-file", str(config)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert "Traceback" not in done.stderr, done.stderr
    # by file name: a warm cache may report the snippet under the folder it was first checked in
    return [line for line in done.stdout.splitlines() if f"{snippet.name}:" in line]


def _qualname(cls: type) -> str:
    """How mypy names a class: where it is defined (``ampguard.core.results.StepResult``), read
    from a function of its body (a public class's ``__module__`` names its public home)."""
    defined = next(v.__module__ for v in vars(cls).values() if inspect.isfunction(v))
    return f"{defined}.{cls.__qualname__}"


@pytest.mark.slow  # runs mypy in a subprocess
def test_public_api_is_typed(tmp_path: Path) -> None:
    lines = _mypy(tmp_path, SNIPPET)
    revealed = [
        line.split("Revealed type is ", 1)[1].strip('"')
        for line in lines
        if "Revealed type is" in line
    ]
    assert len(revealed) == 5, lines
    guard, step, compare, fp8_plan, lint_source = revealed
    assert guard == _qualname(ampguard.Guard)
    assert step == _qualname(ampguard.StepResult)
    assert compare.endswith(f"-> {_qualname(ampguard.Comparison)}"), compare
    assert fp8_plan.endswith(f"-> {_qualname(ampguard.Fp8Plan)}"), fp8_plan
    assert lint_source.endswith(f"-> list[{_qualname(ampguard.Finding)}]"), lint_source
    # the class is real to the checker, so a misspelt attribute is an error (with Any it passes)
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 1 and '"Guard" has no attribute "no_such_attribute"' in errors[0], lines


def test_public_classes_show_their_public_path():
    # repr(ampguard.Guard) names where a user imports it, not the private module that defines it
    import importlib

    names = [n for n in ampguard.__all__ if isinstance(getattr(ampguard, n, None), type)]
    classes = [getattr(ampguard, n) for n in names]
    assert classes
    for cls in classes:
        home = cls.__module__
        assert not any(p.startswith("_") for p in home.split(".")), repr(cls)
        assert repr(cls) == f"<class '{home}.{cls.__qualname__}'>"
        assert getattr(importlib.import_module(home), cls.__qualname__) is cls, repr(cls)
