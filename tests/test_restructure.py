"""tools/restructure.py on a copy of this tree: it plans, refuses what it cannot place, moves.

tools/restructure.py deletes this file when it runs (the move cannot run twice).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COPY = ("src", "tests", "benchmarks", "tools", "README.md", "pyproject.toml",
        ".pre-commit-hooks.yaml")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, root / name)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "flat"], check=True)
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "tools/restructure.py", *args], cwd=root,
                          capture_output=True, text=True, timeout=120)


def test_an_unplaced_module_stops_the_move_and_is_named(tmp_path):
    root = _tree(tmp_path)
    (root / "src/ampguard/newthing.py").write_text('"""New."""\n')
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-q", "-m", "new"], check=True)
    done = _run(root)
    assert done.returncode == 2
    assert '"newthing.py": "<package>/newthing.py",' in done.stderr
    assert (root / "src/ampguard/policy.py").exists()  # nothing moved
    assert _run(root, "--dry-run", "--map", "newthing.py=core/newthing.py").returncode == 0


def test_an_unknown_import_and_a_dirty_tree_stop_the_move(tmp_path):
    root = _tree(tmp_path)
    (root / "tests/test_policy.py").write_text("from ampguard.nothere import x\n")
    done = _run(root)
    assert done.returncode == 2 and "uncommitted" in done.stderr
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qam", "bad import"], check=True)
    done = _run(root)
    assert done.returncode == 2
    assert "tests/test_policy.py:1: import from unknown module ampguard.nothere" in done.stderr


def test_the_move_runs_once_and_the_moved_package_imports(tmp_path):
    root = _tree(tmp_path)
    done = _run(root)
    assert done.returncode == 0, done.stderr
    assert (root / "src/ampguard/core/scaler.py").exists()
    assert not (root / "src/ampguard/scaler.py").exists()
    check = ("import ampguard as ag, ampguard.cli, ampguard.fp32_islands as f; "
             "[getattr(ag, n) for n in ag.__all__]; print(f.keep_fp32.__module__)")
    out = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True,
                         env={"PYTHONPATH": str(root / "src"), "PATH": ""}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ampguard.forensics.islands"
    again = _run(root)
    assert again.returncode == 3 and "already restructured" in again.stderr
