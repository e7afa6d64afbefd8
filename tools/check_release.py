"""Build the release artifacts and prove that the wheel works on its own.

Steps (each one fails the run with a one-line reason):

1. ``python -m build`` makes an sdist and a wheel in a fresh temporary folder.
2. ``twine check`` accepts both.
3. The wheel holds the package with ``py.typed`` and no tests, and its version is
   ``ampguard._version.__version__`` (the single source of the version).
4. A fresh virtual environment gets ``torch==<pinned>`` (the CPU build on local disk) and the
   wheel with its ``[report]`` extra, and runs ``ampguard demo`` and ``ampguard lint`` from
   a folder outside the source tree, so nothing can come from the checkout.

Run it from the repository root: ``python tools/check_release.py`` (about a minute after
torch's wheel is in pip's cache). ``.ci/run`` runs it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = "torch==2.13.0"


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"check_release: {' '.join(cmd[:4])} ... failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _source_version() -> str:
    tree = ast.parse((ROOT / "src" / "ampguard" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__version__":
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    sys.exit("check_release: src/ampguard/_version.py defines no __version__ string")


def _check_wheel(wheel: Path, version: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    if "ampguard/py.typed" not in names:
        sys.exit(f"check_release: {wheel.name} lacks ampguard/py.typed")
    strays = [n for n in names if n.startswith(("tests/", "benchmarks/", "tools/", "docs/"))]
    if strays:
        sys.exit(f"check_release: {wheel.name} holds files outside the package: {strays[:5]}")
    if f"-{version}-" not in wheel.name:
        sys.exit(f"check_release: wheel {wheel.name} does not carry version {version}")


def _smoke(wheel: Path, work: Path) -> None:
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip, exe = venv / "bin" / "pip", venv / "bin" / "ampguard"
    _run([str(pip), "install", "-q", TORCH_PIN])
    _run([str(pip), "install", "-q", f"{wheel}[report]"])
    out = _run([str(exe), "demo", "--steps", "60", "--out", str(work / "run")], cwd=work)
    if "report" not in out.lower():
        sys.exit(f"check_release: the installed demo printed no report path:\n{out}")
    script = work / "train.py"
    script.write_text("import torch\nx = torch.ones(2)\n")
    _run([str(exe), "lint", str(script)], cwd=work)


def main() -> None:
    version = _source_version()
    with tempfile.TemporaryDirectory(prefix="ampguard-release-") as tmp:
        work = Path(tmp)
        dist = work / "dist"
        _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
        artifacts = sorted(dist.iterdir())
        _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts)])
        wheel = next(p for p in artifacts if p.suffix == ".whl")
        _check_wheel(wheel, version)
        _smoke(wheel, work)
    print(
        f"check_release: ampguard {version}: sdist + wheel built, twine ok, "
        "wheel installed in a fresh venv ran `ampguard demo` and `ampguard lint`"
    )


if __name__ == "__main__":
    main()
