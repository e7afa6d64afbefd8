"""Lines per second of ``ampguard lint`` over a large tree (default: the installed torch package).

Runs on one core, in this process, timed in CPU seconds (``time.process_time``): files are read
into memory first, then linted one by one with every rule enabled, with project mode on (as
``ampguard lint DIR`` runs: calls into other files of the tree are resolved; a followed file is
read from disk and parsed inside the timed region) and off (each file alone). ``ast.parse`` alone
over the same files is timed in the same rounds as the floor any AST-based linter pays. Usage::

    python benchmarks/bench_lint.py                 # the installed torch package
    python benchmarks/bench_lint.py PATH --repeat 3 # any folder
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import time
import warnings

from ampguard.lint import iter_python_files
from ampguard.lint._engine import lint_bytes, make_options
from ampguard.lint._project import Project


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
    parser.add_argument("path", nargs="?", default=None, help="folder (default: installed torch)")
    parser.add_argument("--repeat", type=int, default=1, help="runs; the best is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    root = args.path or _torch_dir()
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
        for path, data in files:
            findings.extend(lint_bytes(data, path, options, tree))

    parse_t, single_t, lint_t = [], [], []
    single_findings = 0
    for _ in range(args.repeat):  # interleaved rounds; the best of each is reported
        parse_t.append(_cpu(parse_only))
        single_t.append(_cpu(lambda: lint_all(False)))
        single_findings = len(findings)
        lint_t.append(_cpu(lambda: lint_all(True)))
    parse_s, single_s, lint_s = min(parse_t), min(single_t), min(lint_t)
    result = {
        "root": root,
        "files": len(files),
        "lines": lines,
        "findings": len(findings),
        "lint_cpu_seconds": round(lint_s, 2),
        "lint_lines_per_s": round(lines / lint_s),
        "single_file_findings": single_findings,
        "single_file_lines_per_s": round(lines / single_s),
        "parse_cpu_seconds": round(parse_s, 2),
        "parse_lines_per_s": round(lines / parse_s),
        "lint_over_parse": round(lint_s / parse_s, 2),
        "python": sys.version.split()[0],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
