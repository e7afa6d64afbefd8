"""The old import paths ``ampguard.fp32_islands`` and ``ampguard.distributed_hooks`` still work,
warn once with a ``DeprecationWarning`` naming the new path and the removal release, and point the
warning at the importing line; importing ``ampguard`` itself warns about nothing."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

OLD_PATHS = [
    ("ampguard.fp32_islands", "ampguard.forensics.islands"),
    ("ampguard.distributed_hooks", "ampguard.distributed.hooks"),
]


@pytest.mark.parametrize("old, new", OLD_PATHS)
def test_an_old_path_warns_once_and_gives_the_same_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shim = importlib.import_module(old)
        importlib.import_module(old)  # imported once: no second warning
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    message = str(deprecations[0].message)
    assert old in message and new in message and "removed in ampguard 0.5" in message
    assert deprecations[0].filename == __file__  # the importing line, not the shim
    target = importlib.import_module(new)
    assert shim.__all__ == target.__all__
    for name in target.__all__:
        assert getattr(shim, name) is getattr(target, name)


def test_importing_ampguard_and_the_new_paths_warns_nothing():
    code = (
        "import ampguard, ampguard.forensics.islands, ampguard.distributed.hooks\n"
        "ampguard.Guard, ampguard.locate\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
