#!/usr/bin/env python3
"""Move ampguard's flat modules into one subpackage per concern (issue 14), in one commit.

Run from the repository root on a clean git tree (stdlib only)::

    python tools/restructure.py            # plan, check, rewrite, git mv; prints a summary
    python tools/restructure.py --dry-run  # plan and check only: lists the moves and rewrites

What it does, in order (nothing is written until every check passed):

1. Finds every module under ``src/ampguard``; stops (exit 2, listing them) on any module that
   :data:`MAPPING` does not place. A module inside a package listed in :data:`KEPT_PACKAGES`
   stays where it is, so new modules there need no line.
2. Parses every ``.py`` file in ``src/ tests/ benchmarks/ tools/`` with ``ast`` and rewrites each
   ``import``/``from ... import`` that names an ampguard module (top level or inside a function,
   absolute or relative) to the module's new absolute path: the code base uses absolute imports.
   A ``from X import a, b`` whose names now live in different packages is split. Where a module
   bound by ``from ampguard import old`` has a new short name, the uses in that file are renamed
   (``_cli_compare.x`` -> ``_compare.x``), or the import keeps the old name with ``as`` when the new
   one is taken. An import of an ampguard module that does not exist stops the run (exit 2).
3. Rewrites dotted references ``ampguard.old.path`` everywhere else in those files and in
   ``README.md``, ``pyproject.toml`` and ``.pre-commit-hooks.yaml``: strings (``_EXPORTS``,
   ``importlib.import_module``, ``-m ampguard.x``, ``pytest.importorskip``), comments, docstrings.
   Only the longest prefix that is a real old module is replaced (``"ampguard.pt"`` and the
   ``"ampguard.checkpoint"`` format tag are no module path that moves, so they stay).
4. ``git mv`` every file, writes the new packages' ``__init__.py`` (explicit ``__all__``), the
   shims for old paths the README documents, the ``TYPE_CHECKING`` block of ``ampguard/__init__``
   (generated from ``_EXPORTS``), renames the test files in :data:`TEST_RENAMES`, enables the
   layout checks of ``tests/test_architecture.py``, removes ``tests/test_restructure.py`` (the
   move cannot run twice) and puts ``tools/architecture.md`` into the README as its
   architecture section.
   Applies :data:`FIXUPS` (code that derives the package folder from its own ``__file__``) and
   warns about any other moved module that uses ``__file__``.
5. Runs ``ruff check --fix --select I`` (import order only; no formatting) when ruff is present.

Adding a module: put a line ``"flatname.py": "package/newname.py",`` into :data:`MAPPING` (paths
relative to ``src/ampguard``) and commit, or pass ``--map flatname.py=package/newname.py``. The
error for an unplaced module prints a suggested line for each. A new public module of ``core``
also goes into :data:`NEW_PACKAGES` so ``ampguard.core`` re-exports it.

A second run on the restructured tree refuses (exit 3): the marker is ``src/ampguard/core/``.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# old file -> new file, relative to src/ampguard. A package's main module becomes its __init__,
# so ``ampguard.telemetry``, ``ampguard.rules``, ``ampguard.forensics`` ... keep their paths.
MAPPING: dict[str, str] = {
    # top level: the lazy facade, the CLI entry, the composition root, the sync counter
    "__init__.py": "__init__.py",
    "__main__.py": "__main__.py",
    "guard.py": "guard.py",
    "testing.py": "testing.py",
    # runlog: the run folder on disk (torch-free; telemetry writes it, rules/reporting read it)
    "runlog.py": "runlog/__init__.py",
    "_runfiles.py": "runlog/_files.py",  # hostile (issue 13)
    "_runread.py": "runlog/_read.py",  # hostile
    "_runschema.py": "runlog/_schema.py",  # hostile
    # findings: the one shape of every diagnosis (the code catalogue joins it)
    "findings.py": "findings/__init__.py",
    "_dist_counters.py": "distributed/_counters.py",  # dist: per-rank counters
    "codes.py": "findings/codes.py",  # the catalogue of finding codes
    "_report_on_close.py": "reporting/_on_close.py",  # Guard.close writes report.html
    # core: the AMP step's state and arithmetic, no ampguard imports
    "policy.py": "core/policy.py",
    "scaler.py": "core/scaler.py",
    "scale_history.py": "core/scale_history.py",
    "containment.py": "core/containment.py",
    "resume.py": "core/resume.py",
    "results.py": "core/results.py",
    "_guard_args.py": "core/_args.py",
    "_guard_state.py": "core/_state.py",  # ckpt (issue 11): imported by guard and checkpoint
    "_nonfinite.py": "core/_nonfinite.py",  # step (issue 12)
    # rules: AG101-AG108 over a run log (torch-free); fp16 range arithmetic they judge with
    "rules.py": "rules/__init__.py",
    "_rule_base.py": "rules/_base.py",
    "_layer_rules.py": "rules/_layers.py",
    "_ranges.py": "rules/_ranges.py",
    "_nonfinite_rules.py": "rules/_nonfinite.py",  # step: AG109-AG110
    # telemetry: device rows -> records -> run folder
    "telemetry.py": "telemetry/__init__.py",
    "_records.py": "telemetry/_records.py",
    "_layers.py": "telemetry/_layers.py",
    "_tbsink.py": "telemetry/_tensorboard.py",
    "_staging.py": "telemetry/_staging.py",  # perf (issue 16)
    # forensics: which op went non-finite, coverage, fp32 islands, and the Guard's use of them
    "forensics.py": "forensics/__init__.py",
    "_optrace.py": "forensics/_optrace.py",
    "_replay.py": "forensics/_replay.py",
    "_forensics_text.py": "forensics/_text.py",
    "autocast_coverage.py": "forensics/autocast_coverage.py",  # not coverage.py: see its docstring
    "fp32_islands.py": "forensics/islands.py",
    "_guard_forensics.py": "forensics/_guard.py",
    # distributed: consensus, audit, the DDP hook
    "distributed.py": "distributed/__init__.py",
    "_dist_audit.py": "distributed/_audit.py",
    "distributed_hooks.py": "distributed/hooks.py",
    "_dist_peers.py": "distributed/_peers.py",  # dist (issue 13)
    # checkpoint
    "checkpoint.py": "checkpoint/__init__.py",
    "checkpoint_dist.py": "checkpoint/distributed.py",
    "_ckpt_files.py": "checkpoint/_files.py",  # ckpt
    "_ckpt_validate.py": "checkpoint/_validate.py",  # ckpt
    "_ckpt_dist_checks.py": "checkpoint/_dist_checks.py",  # ckpt
    # fp8 (issue 17): the readiness plan and the Guard's fp8 path; imports core and findings only
    "fp8_readiness.py": "fp8/__init__.py",
    "_fp8_cast.py": "fp8/_cast.py",
    "_fp8_text.py": "fp8/_text.py",
    "_fp8_stats.py": "fp8/_stats.py",
    "_fp8_guard.py": "fp8/_guard.py",
    "_fp8_report.py": "reporting/_fp8.py",  # no imports; reporting stays torch-free
    # experiments: compare and the model advisor
    "experiments.py": "experiments/__init__.py",
    "_compare_verdict.py": "experiments/_verdict.py",
    "_compare_timing.py": "experiments/_timing.py",
    "_compare_html.py": "experiments/_html.py",
    "advisor.py": "experiments/advisor.py",
    "_advisor_probe.py": "experiments/_advisor_probe.py",
    "_range_probe.py": "experiments/_range_probe.py",
    "_compare_fp8.py": "experiments/_fp8.py",  # fp8
    # cli: argument parsing and dispatch
    "cli.py": "cli/__init__.py",
    "_cli_compare.py": "cli/_compare.py",
    "_cli_lint.py": "cli/_lint.py",
    "_cli_report.py": "cli/_report.py",
    "_cli_types.py": "cli/_types.py",
    "_loader.py": "cli/_loader.py",
    "_cli_fp8.py": "cli/_fp8.py",  # fp8
}

# Where an unplaced module probably goes, by name prefix (only a suggestion in the error).
HINTS = [
    ("_cli_", "cli/"),
    ("cli_", "cli/"),
    ("_compare_", "experiments/"),
    ("_advisor", "experiments/"),
    ("_dist_", "distributed/"),
    ("distributed_", "distributed/"),
    ("_peer", "distributed/"),
    ("checkpoint", "checkpoint/"),
    ("_ckpt", "checkpoint/"),
    ("_guard_", "core/"),
    ("_rule", "rules/"),
    ("_forensics", "forensics/"),
    ("_layer", "telemetry/"),
    ("_telemetry", "telemetry/"),
    ("_run", "telemetry/"),
    ("fp8", "core/"),
    ("_fp8", "core/"),
]

# Packages that exist today and keep their place (their modules need no MAPPING line).
KEPT_PACKAGES = ("demo", "integrations", "lint", "reporting")

# Packages the move creates without a main module: their __init__ is generated and re-exports
# the public names (``__all__``) of the listed public modules.
NEW_PACKAGES: dict[str, tuple[str, list[str]]] = {
    "core": (
        "The AMP step's state and arithmetic: precision policy, loss scaler, scale history,\n"
        "micro-batch containment, resume warm-up and step results. Imports no other "
        "ampguard package.",
        ["policy", "scaler", "scale_history", "containment", "resume", "results"],
    ),
}

# Code that derives a path from its own __file__ and must follow the move (new path -> edits).
FIXUPS: dict[str, list[tuple[str, str]]] = {
    # hostile's user_traceback drops frames under the package folder: one level up now
    "cli/_loader.py": [
        (
            "here = os.path.dirname(os.path.abspath(__file__))",
            "here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))",
        )
    ],
}

# Test files named after how they were written -> named after what they cover.
TEST_RENAMES: dict[str, str] = {
    "tests/test_review_core.py": "tests/test_guard_step_edges.py",
    "tests/test_review_surface.py": "tests/test_cli_messages.py",
    "tests/test_resume_edges.py": "tests/test_resume.py",
}

SCAN_DIRS = ("src", "tests", "benchmarks", "tools")
TEXT_FILES = ("README.md", "pyproject.toml", ".pre-commit-hooks.yaml")
MARKER = "core"  # src/ampguard/core/ exists once the move is done
SHIM_DOC = "kept because the README documented it"  # tests/test_architecture.py looks for it
PKG = Path("src/ampguard")
SELF = Path("tools/restructure.py")
ARCH_TEST = Path("tests/test_architecture.py")
SELF_TEST = Path("tests/test_restructure.py")
ARCH_DOC = Path("tools/architecture.md")  # goes into the README before this heading
ARCH_DOC_BEFORE = "## Performance"
# tests/test_architecture.py holds its post-move checks behind this block; the move removes it.
ARCH_GATE = re.compile(r"# >>> layout-gate.*?# <<< layout-gate\n", re.S)
TC_BEGIN = "# >>> TYPE_CHECKING (generated by tools/restructure.py from _EXPORTS)\n"
TC_END = "# <<< TYPE_CHECKING\n"
DOTTED = re.compile(r"\bampguard(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


class Failure(Exception):
    """A check failed: the message lists what to fix; nothing was written."""


def module_of(rel: str) -> str:
    """``telemetry/__init__.py`` -> ``ampguard.telemetry``; ``core/x.py`` -> ``ampguard.core.x``."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["ampguard", *parts])


@dataclass
class Plan:
    """Everything the move will do, computed before anything is written."""

    moves: dict[str, str] = field(default_factory=dict)  # old rel path -> new rel path
    modmap: dict[str, str] = field(default_factory=dict)  # old module -> new module
    edits: dict[Path, str] = field(default_factory=dict)  # file -> new text
    # names used as an attribute (``ag.guard._fp8_guard``) or in a string anywhere: a module
    # bound under such a name keeps it (``import x as old``), so outside references still work
    outside_names: set[str] = field(default_factory=set)
    shims: dict[str, str] = field(default_factory=dict)  # old module -> new module
    log: list[str] = field(default_factory=list)


def discover(root: Path) -> list[str]:
    """Every module file under src/ampguard, relative to it (posix)."""
    return sorted(p.relative_to(root / PKG).as_posix() for p in (root / PKG).rglob("*.py"))


def suggestion(rel: str) -> str:
    for prefix, package in HINTS:
        if rel.startswith(prefix):
            private = prefix.startswith("_") and prefix.endswith("_")
            rest = "_" + rel[len(prefix) :] if private else rel
            return f'"{rel}": "{package}{rest}",'
    return f'"{rel}": "<package>/{rel}",'


def build_plan_moves(files: list[str], extra: dict[str, str]) -> Plan:
    plan = Plan()
    mapping = {**MAPPING, **extra}
    unmapped = []
    for rel in files:
        if rel in mapping:
            new = mapping[rel]
        elif rel.split("/")[0] in KEPT_PACKAGES:
            new = rel
        else:
            unmapped.append(rel)
            continue
        plan.moves[rel] = new
        plan.modmap[module_of(rel)] = module_of(new)
    stale = sorted(set(mapping) - set(files))
    if unmapped:
        raise Failure(
            "modules under src/ampguard that MAPPING does not place; add lines like "
            "these to MAPPING in tools/restructure.py (and commit), or pass "
            "--map old.py=package/new.py:\n  " + "\n  ".join(map(suggestion, unmapped))
        )
    if stale:  # lines for modules of branches not merged yet, or renamed there
        plan.log.append("note: MAPPING lines for files that do not exist: " + ", ".join(stale))
    targets: dict[str, str] = {}
    for old, new in plan.moves.items():
        if new in targets:
            raise Failure(f"MAPPING sends both {targets[new]} and {old} to {new}")
        targets[new] = old
    return plan


# ---- import rewriting -------------------------------------------------------------------------


def _offsets(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _span(node: ast.AST, starts: list[int]) -> tuple[int, int]:
    return (
        starts[node.lineno - 1] + node.col_offset,  # type: ignore[attr-defined]
        starts[node.end_lineno - 1] + node.end_col_offset,
    )  # type: ignore[attr-defined]


def _own_module(path: Path, root: Path) -> tuple[str, bool] | None:
    """(module name, is package) of a file under src/ampguard, else None."""
    try:
        rel = path.relative_to(root / PKG).as_posix()
    except ValueError:
        return None
    return module_of(rel), rel.endswith("__init__.py")


def _absolute(node: ast.ImportFrom, own: tuple[str, bool] | None, where: str) -> str | None:
    if not node.level:
        return node.module
    if own is None:
        raise Failure(f"{where}: relative import outside the package")
    name, is_pkg = own
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_ours(module: str | None) -> bool:
    return module is not None and (module == "ampguard" or module.startswith("ampguard."))


def _from_text(module: str, names: list[str], indent: str) -> str:
    line = f"from {module} import {', '.join(names)}"
    if len(indent) + len(line) <= 100:
        return line
    body = "".join(f"{indent}    {n},\n" for n in names)
    return f"from {module} import (\n{body}{indent})"


def _names_used(tree: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            used.add(n.name)
        elif isinstance(n, ast.arg):
            used.add(n.arg)
        elif isinstance(n, ast.alias):
            used.add((n.asname or n.name).split(".")[0])
    return used


def rewrite_python(path: Path, text: str, plan: Plan, root: Path) -> str:
    """The file with its ampguard imports and dotted module references moved."""
    tree = ast.parse(text, filename=str(path))
    starts = _offsets(text)
    own = _own_module(path, root)
    used = _names_used(tree)
    renames: dict[str, str] = {}  # bound name -> new bound name, for the whole file
    repl: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, own, where)
            if not _is_ours(module):
                continue
            assert module is not None
            new = _rewrite_from(node, module, plan, where, used, renames)
            indent = " " * node.col_offset
            text_new = f"\n{indent}".join(_from_text(m, ns, indent) for m, ns in new)
            repl.append((*_span(node, starts), text_new))
        elif isinstance(node, ast.Import):
            parts = []
            changed = False
            for alias in node.names:
                if not _is_ours(alias.name) or alias.name == "ampguard":
                    parts.append(_alias_text(alias.name, alias.asname))
                    continue
                if alias.name not in plan.modmap:
                    raise Failure(f"{where}: import of unknown module {alias.name}")
                target = plan.modmap[alias.name]
                changed |= target != alias.name
                parts.append(_alias_text(target, alias.asname))
                if alias.asname is None and target != alias.name:
                    plan.log.append(
                        f"{where}: 'import {alias.name}' without 'as': its dotted "
                        "uses are rewritten as text"
                    )
            if changed:
                repl.append((*_span(node, starts), "import " + ", ".join(parts)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in renames:
            repl.append((*_span(node, starts), renames[node.id]))
    return wrap_docstrings(_apply(text, sorted(repl), plan), text, path, plan)


def wrap_docstrings(new: str, old: str, path: Path, plan: Plan) -> str:
    """Break docstring and comment lines that a longer module path pushed past 100 columns."""
    if new == old:
        return new
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(new)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    was_long = {line for line in old.splitlines() if len(line) > 100}
    out = []
    for number, line in enumerate(new.splitlines(keepends=True), start=1):
        body = line.rstrip("\n")
        if len(body) <= 100 or body in was_long:
            out.append(line)
            continue
        cut = body.rfind(" ", 0, 101)
        indent = body[: len(body) - len(body.lstrip())]
        comment = body.lstrip().startswith("#")
        if (number in doc_lines or comment) and cut > len(indent):
            lead = indent + ("# " if comment else "")
            out.append(body[:cut] + "\n" + lead + body[cut + 1 :] + line[len(body) :])
        else:
            out.append(line)
            plan.log.append(f"warning: {path}:{number} is over 100 columns after the rewrite")
    return "".join(out)


def _alias_text(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname else name


def _rewrite_from(
    node: ast.ImportFrom,
    module: str,
    plan: Plan,
    where: str,
    used: set[str],
    renames: dict[str, str],
) -> list[tuple[str, list[str]]]:
    """The ``from M import ...`` statements (module, names) that replace one node."""
    if module != "ampguard" and module not in plan.modmap:
        raise Failure(f"{where}: import from unknown module {module}")
    groups: dict[str, list[str]] = {}
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        if sub in plan.modmap:  # `from pkg import submodule`
            parent, _, name = plan.modmap[sub].rpartition(".")
            if alias.asname is None and name != alias.name:
                if renames.get(alias.name) == name:
                    text = name
                elif name in used or name in renames.values() or alias.name in plan.outside_names:
                    text = f"{name} as {alias.name}"
                else:
                    renames[alias.name] = name
                    used.add(name)
                    text = name
            else:
                text = _alias_text(name, alias.asname)
        else:
            parent = plan.modmap.get(module, module)
            text = _alias_text(alias.name, alias.asname)
        groups.setdefault(parent, []).append(text)
    return list(groups.items())


def _apply(text: str, repl: list[tuple[int, int, str]], plan: Plan) -> str:
    """Apply span replacements, and the dotted-reference rewrite to the text between them."""
    out, pos = [], 0
    for start, end, new in repl:
        if start < pos:  # a Name inside an import statement already replaced
            continue
        out.append(rewrite_dotted(text[pos:start], plan))
        out.append(new)
        pos = end
    out.append(rewrite_dotted(text[pos:], plan))
    return "".join(out)


def rewrite_dotted(text: str, plan: Plan) -> str:
    """``ampguard.old.mod.attr`` -> ``ampguard.new.mod.attr`` (longest old-module prefix)."""

    def one(m: re.Match[str]) -> str:
        parts = m.group(0).split(".")
        for k in range(len(parts), 1, -1):
            prefix = ".".join(parts[:k])
            if prefix in plan.modmap:
                return ".".join([plan.modmap[prefix], *parts[k:]])
        return m.group(0)

    return DOTTED.sub(one, text)


# ---- generated files --------------------------------------------------------------------------


def exports_of(init_text: str) -> dict[str, str]:
    """``_EXPORTS`` of ampguard/__init__.py: public name -> module."""
    for node in ast.parse(init_text).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "_EXPORTS"
            and node.value is not None
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise Failure("src/ampguard/__init__.py: no _EXPORTS table")


def type_checking_block(exports: dict[str, str]) -> str:
    """The ``if TYPE_CHECKING:`` imports that make ``ag.Guard`` the class to a type checker."""
    by_module: dict[str, list[str]] = {}
    for name, module in exports.items():
        by_module.setdefault(module, []).append(name)
    lines = [TC_BEGIN, "if TYPE_CHECKING:  # a checker sees the real names; runtime stays lazy\n"]
    for module in sorted(by_module):
        names = [f"{n} as {n}" for n in sorted(by_module[module])]
        lines.append("    " + _from_text(module, names, "    ").replace("\n", "\n") + "\n")
    lines.append(TC_END)
    return "".join(lines)


def with_type_checking(init_text: str) -> str:
    """ampguard/__init__.py with its TYPE_CHECKING block (re)generated after ``_EXPORTS``."""
    text = re.sub(
        re.escape(TC_BEGIN) + ".*?" + re.escape(TC_END) + r"\n?", "", init_text, flags=re.S
    )
    text = text.replace("from typing import Any\n", "from typing import TYPE_CHECKING, Any\n")
    if "TYPE_CHECKING" not in text:
        raise Failure("src/ampguard/__init__.py: could not add TYPE_CHECKING to its typing import")
    block = type_checking_block(exports_of(text))
    anchor = "\n__all__ = "
    if anchor not in text:
        raise Failure("src/ampguard/__init__.py: no '__all__ = ' line to put the block before")
    return text.replace(anchor, "\n" + block + anchor, 1)


def public_names(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return [str(v) for v in value]
    raise Failure(f"{path}: no literal __all__ to re-export")


def new_package_init(root: Path, package: str) -> str:
    doc, modules = NEW_PACKAGES[package]
    lines = [f'"""{doc}\n"""\n\n']
    names: list[str] = []
    for mod in modules:
        exported = public_names(root / PKG / package / f"{mod}.py")
        names += exported
        lines.append(_from_text(f"ampguard.{package}.{mod}", exported, "") + "\n")
    lines.append("\n__all__ = [\n" + "".join(f'    "{n}",\n' for n in names) + "]\n")
    return "".join(lines)


def shim_text(old: str, new: str) -> str:
    return (
        f'"""Old import path of :mod:`{new}`, {SHIM_DOC}."""\n\n'
        f"from {new} import *  # noqa: F403\n"
        f"from {new} import __all__ as __all__\n"
    )


def documented_modules(readme: str, plan: Plan) -> dict[str, str]:
    """Old module paths the README names (``ampguard.x``, ``from ampguard.x import``) that move."""
    found = {}
    for m in DOTTED.finditer(readme):
        parts = m.group(0).split(".")
        for k in range(len(parts), 1, -1):
            prefix = ".".join(parts[:k])
            if prefix in plan.modmap:
                private = parts[k - 1].startswith("_")  # named for contributors, no import path
                if plan.modmap[prefix] != prefix and not private:
                    found[prefix] = plan.modmap[prefix]
                break
    return found


# ---- driver -----------------------------------------------------------------------------------


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def preflight(root: Path) -> None:
    if not (root / PKG / "__init__.py").is_file() or not (root / ".git").exists():
        raise Failure("run from the ampguard repository root (src/ampguard and .git not found)")
    if (root / PKG / MARKER).is_dir():
        raise AlreadyApplied("already restructured (src/ampguard/core/ exists): nothing to do")
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    if dirty.strip():
        raise Failure("the git tree has uncommitted changes; commit or stash them first:\n" + dirty)


class AlreadyApplied(Exception):
    """The tree is already in the new layout."""


def outside_names(paths: list[Path]) -> set[str]:
    """Every attribute name and every dotted part of every string constant in these files."""
    names: set[str] = set()
    for path in paths:
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return names


def make_plan(root: Path, extra: dict[str, str]) -> Plan:
    plan = build_plan_moves(discover(root), extra)
    files = [
        p
        for d in SCAN_DIRS
        if (root / d).is_dir()
        for p in sorted((root / d).rglob("*.py"))
        if p.relative_to(root) not in (SELF, ARCH_TEST, SELF_TEST) and "corpus" not in p.parts
    ]  # these three are written for both layouts
    plan.outside_names = outside_names(files)
    errors = []
    for path in files:
        text = path.read_text()
        try:
            new = (
                rewrite_python(path.relative_to(root), text, plan, root) if _touches(text) else text
            )
        except Failure as e:
            errors.append(str(e))
            continue
        except SyntaxError as e:
            errors.append(f"{path}: does not parse: {e}")
            continue
        if new != text:
            plan.edits[path] = new
    if errors:
        raise Failure("imports that cannot be resolved:\n  " + "\n  ".join(errors))
    file_relative(root, plan)
    readme = root / "README.md"
    if (root / ARCH_DOC).exists() and ARCH_DOC_BEFORE not in readme.read_text():
        raise Failure(f"README.md: no '{ARCH_DOC_BEFORE}' heading to put {ARCH_DOC} before")
    for name in TEXT_FILES:
        path = root / name
        if path.is_file():
            text = path.read_text()
            if name == "README.md":
                plan.shims = documented_modules(text, plan)
            new = rewrite_dotted(text, plan)
            if new != text:
                plan.edits[path] = new
    return plan


def file_relative(root: Path, plan: Plan) -> None:
    """Warn about moved modules that find things relative to their own ``__file__``."""
    for old, new in plan.moves.items():
        text = (root / PKG / old).read_text()
        fixed = all(a in text for a, _ in FIXUPS.get(new, [("-", "")]))
        if old.count("/") != new.count("/") and "__file__" in text and not fixed:
            plan.log.append(
                f"warning: src/ampguard/{old} uses __file__ and moves to {new}: "
                "check any path it derives from it (e.g. the package folder)"
            )


def _touches(text: str) -> bool:
    return "ampguard" in text or "from ." in text


def execute(root: Path, plan: Plan) -> None:
    for path, text in plan.edits.items():
        path.write_text(text)
    for old, new in plan.moves.items():
        if old == new:
            continue
        dest = root / PKG / new
        dest.parent.mkdir(parents=True, exist_ok=True)
        git(root, "mv", str(PKG / old), str(PKG / new))
    for rel, fixes in FIXUPS.items():
        path = root / PKG / rel
        if path.exists():
            text = path.read_text()
            for before, after in fixes:
                if before in text:
                    text = text.replace(before, after)
                    plan.log.append(f"fixup: src/ampguard/{rel}: {after.strip()}")
            path.write_text(text)
    for package in NEW_PACKAGES:
        init = root / PKG / package / "__init__.py"
        init.write_text(new_package_init(root, package))
        git(root, "add", str(init.relative_to(root)))
    for old, new in sorted(plan.shims.items()):
        rel = old.removeprefix("ampguard.").replace(".", "/") + ".py"
        shim = root / PKG / rel
        if shim.exists():
            raise Failure(f"{shim}: a shim would overwrite a module")
        shim.write_text(shim_text(old, new))
        git(root, "add", str(shim.relative_to(root)))
        plan.log.append(f"shim: {old} -> {new}")
    init = root / PKG / "__init__.py"
    init.write_text(with_type_checking(init.read_text()))
    for old, new in TEST_RENAMES.items():
        if (root / old).exists():
            git(root, "mv", old, new)
    arch = root / ARCH_TEST
    if arch.exists():
        lines = ARCH_GATE.sub("", arch.read_text()).splitlines(keepends=True)
        arch.write_text("".join(x for x in lines if not x.rstrip().endswith("# layout-gate")))
    readme, doc = root / "README.md", root / ARCH_DOC
    if doc.exists() and readme.exists():
        text = readme.read_text()
        readme.write_text(text.replace(ARCH_DOC_BEFORE, doc.read_text() + ARCH_DOC_BEFORE, 1))
        git(root, "rm", "-qf", str(ARCH_DOC))
    if (root / SELF_TEST).exists():  # it tests the move, which cannot run again
        git(root, "rm", "-qf", str(SELF_TEST))
    ruff = shutil.which("ruff")
    if ruff:
        subprocess.run(
            [ruff, "check", "--fix", "--select", "I", "--quiet", *SCAN_DIRS], cwd=root, check=False
        )
    else:
        plan.log.append(
            "ruff not found: run `ruff check --fix --select I src tests benchmarks "
            "tools` to sort the rewritten imports"
        )


def _map_arg(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old.endswith(".py") or not new.endswith(".py"):
        raise Failure(f"--map takes OLD.py=package/NEW.py (paths under src/ampguard), got {text!r}")
    return old.strip(), new.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="plan and check; write nothing")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root")
    parser.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="an extra MAPPING line, e.g. fp8.py=core/fp8.py (repeatable)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        extra = dict(_map_arg(m) for m in args.map)
        preflight(root)
        plan = make_plan(root, extra)
        moved = {o: n for o, n in plan.moves.items() if o != n}
        print(
            f"restructure: {len(moved)} modules move, {len(plan.edits)} files rewritten, "
            f"{len(plan.shims)} shims, {len(TEST_RENAMES)} test renames"
        )
        if args.dry_run:
            for old, new in sorted(moved.items()):
                print(f"  {old:28} -> {new}")
            for path in sorted(plan.edits):
                print(f"  rewrite {path.relative_to(root)}")
            for old, new in sorted(plan.shims.items()):
                print(f"  shim {old} -> {new}")
        else:
            execute(root, plan)
        for line in plan.log:
            print(line)
    except AlreadyApplied as e:
        print(f"restructure: {e}", file=sys.stderr)
        return 3
    except Failure as e:
        print(f"restructure: {e}", file=sys.stderr)
        return 2
    if not args.dry_run:
        print(
            "done. Next: ruff check src tests benchmarks tools && mypy && python -m pytest -q, "
            "then commit: git add -A && git commit -m 'Layout: one package per concern'"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
