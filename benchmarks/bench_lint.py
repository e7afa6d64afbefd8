"""Lines per second of ``ampguard lint`` over a detection repository's tree (or any folder).

The default tree is a YOLO-style detection repository (``benchmarks/yolo_tree.py`` writes it to a
temporary folder: ~16k lines in models/, utils/, train.py, val.py, ... with the imports between
them that such a repository has); ``--torch`` lints the installed torch package instead.

Runs on one core, in this process, timed in CPU seconds (``time.process_time``): files are read
into memory first, then linted one by one with every rule enabled, as ``ampguard lint DIR`` runs
them (under :func:`ampguard.lint._engine.relaxed_gc`), with project mode on (calls into other
files of the tree are resolved; a followed file is read from disk and parsed inside the timed
region) and off (each file alone). ``ast.parse`` alone over the same files is timed in the same
rounds as the floor any AST-based linter pays. Usage::

    python benchmarks/bench_lint.py --repeat 5       # the detection repository's tree
    python benchmarks/bench_lint.py --torch          # the installed torch package
    python benchmarks/bench_lint.py PATH --repeat 3  # any folder
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings

from ampguard.lint import iter_python_files
from ampguard.lint._engine import lint_bytes, make_options, relaxed_gc
from ampguard.lint._project import Project

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from yolo_tree import write_tree  # noqa: E402  (this folder's own module)


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit("torch is not installed; pass a folder to benchmark")
    return os.path.dirname(spec.origin)


def _cpu(fn) -> float:
    """CPU seconds of this process for one call (a busy shared machine barely moves it)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", nargs="?", default=None, help="folder (default: the detection repository tree)"
    )
    parser.add_argument("--torch", action="store_true", help="lint the installed torch package")
    parser.add_argument("--repeat", type=int, default=1, help="runs; the best is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ampguard-bench-lint-") as scratch:
        if args.path:
            root = args.path
        elif args.torch:
            root = _torch_dir()
        else:
            root = os.path.join(scratch, "yolo")
            write_tree(root)
        result = _bench(
            root, args.repeat, "yolo-style detection tree" if root.startswith(scratch) else root
        )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


def _bench(root: str, repeat: int, name: str) -> dict:
    files = []
    for path in iter_python_files([root]):
        with open(path, "rb") as handle:
            files.append((path, handle.read()))
    lines = sum(data.count(b"\n") for _, data in files)
    options = make_options()
    findings: list = []

    def parse_only() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for path, data in files:
                try:
                    ast.parse(data, filename=path)
                except (SyntaxError, ValueError):
                    pass

    def lint_all(project: bool) -> None:
        findings.clear()
        tree = Project([path for path, _ in files]) if project else None
        with relaxed_gc():
            for path, data in files:
                findings.extend(lint_bytes(data, path, options, tree))

    parse_t, single_t, lint_t = [], [], []
    single_findings = 0
    for _ in range(repeat):  # interleaved rounds; the best of each is reported
        parse_t.append(_cpu(parse_only))
        single_t.append(_cpu(lambda: lint_all(False)))
        single_findings = len(findings)
        lint_t.append(_cpu(lambda: lint_all(True)))
    parse_s, single_s, lint_s = min(parse_t), min(single_t), min(lint_t)
    return {
        "root": name,
        "files": len(files),
        "lines": lines,
        "findings": len(findings),
        "lint_cpu_seconds": round(lint_s, 3),
        "lint_lines_per_s": round(lines / lint_s),
        "single_file_findings": single_findings,
        "single_file_cpu_seconds": round(single_s, 3),
        "single_file_lines_per_s": round(lines / single_s),
        "project_over_single": round(lint_s / single_s, 2),
        "parse_cpu_seconds": round(parse_s, 3),
        "parse_lines_per_s": round(lines / parse_s),
        "lint_over_parse": round(lint_s / parse_s, 2),
        "python": sys.version.split()[0],
    }


if __name__ == "__main__":
    sys.exit(main())
