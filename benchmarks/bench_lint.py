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
    python benchmarks/bench_lint.py TREE1 TREE2 --generated   # several trees: one row each

With several trees (or one tree and ``--generated``, which adds the generated tree), one line per
tree is printed (``--json``: a list of objects), and the run's exit status is 1 when a tree's
project-mode figure is under ``--goal`` lines/s (default 15,000), so the check can gate a CI job.
Real trees are not part of the repository: fetch them yourself (``git clone --depth 1``).
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
    parser.add_argument("path", nargs="*", help="folders (default: the detection repository tree)")
    parser.add_argument("--torch", action="store_true", help="lint the installed torch package")
    parser.add_argument(
        "--generated", action="store_true", help="also the generated tree, next to the folders"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs; the best is reported")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--goal", type=int, default=15_000, help="project-mode lines/s each tree must reach"
    )
    args = parser.parse_args(argv)
    for path in args.path:
        if not os.path.isdir(path):
            parser.error(f"path must be a folder, got {path!r}")
    results = []
    with tempfile.TemporaryDirectory(prefix="ampguard-bench-lint-") as scratch:
        roots = [(p, p) for p in args.path]
        if args.torch:
            roots.append((_torch_dir(), "torch"))
        if args.generated or not roots:
            generated = os.path.join(scratch, "yolo")
            write_tree(generated)
            roots.append((generated, "yolo-style detection tree"))
        for root, name in roots:
            results.append(_bench(root, args.repeat, name))
    if len(results) == 1:
        result = results[0]
        if args.json:
            print(json.dumps(result))
        else:
            for key, value in result.items():
                print(f"{key:>24}: {value}")
        return 0
    if args.json:
        print(json.dumps(results))
    else:
        print(f"{'tree':<44} {'files':>6} {'lines':>8} {'project l/s':>12} {'single l/s':>11}")
        for r in results:
            print(
                f"{r['root'][-44:]:<44} {r['files']:>6} {r['lines']:>8} "
                f"{r['lint_lines_per_s']:>12} {r['single_file_lines_per_s']:>11}"
            )
    slow = [r["root"] for r in results if r["lint_lines_per_s"] < args.goal]
    if slow and not args.json:
        print(f"under {args.goal} lines/s: {', '.join(slow)}")
    return 1 if slow else 0


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
