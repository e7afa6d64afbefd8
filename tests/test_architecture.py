"""The package's import graph: dependencies point one way, no cycles, lint stays torch-free.

Every ``import`` / ``from ... import`` of every module is read with ``ast`` (imports inside
functions and ``if TYPE_CHECKING:`` blocks included, and ``importlib.import_module("ampguard.x")``
strings), then checked against :data:`LAYERS`: a module may import only from a lower layer (or
its own package). The checks run on a synthetic graph first, so an injected bad import is proven
to fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ampguard"

# Lowest first. A unit is a subpackage (``ampguard.core``) or a top-level module (``guard``).
# The README's architecture section draws the same picture; the order differs from the first
# proposal where the code demands it: ``runlog`` (the run-folder format) sits next to ``core``
# because rules, telemetry, reporting and integrations all read or write it; ``fp8`` (the
# readiness plan and the Guard's fp8 path) needs only core and findings; ``rules`` sits below
# ``telemetry`` (telemetry evaluates rules when it closes); ``reporting`` only reads a run folder
# and applies rules, so it sits next to telemetry, below ``integrations`` (``watch`` writes a
# report when it closes) and ``demo``.
LAYERS: list[set[str]] = [
    {"_util", "_version", "findings", "precisions", "testing"},
    {"core", "runlog", "lint"},
    {"rules", "fp8", "replay"},
    {"telemetry", "forensics", "distributed", "reporting"},
    {"guard"},
    {"checkpoint", "experiments"},
    {"integrations"},
    {"demo"},
    {"cli"},
    {"__main__"},  # and the old-path shims (see is_shim)
]
SHIM_DOC = "Deprecated old import path"  # the first words of an old-path shim's docstring
# Units that must not import torch, directly or through anything they import.
TORCH_FREE = {"_util", "_version", "findings", "precisions", "runlog", "lint", "rules", "reporting"}
LINT_MAY_IMPORT = {"_util", "_version", "findings", "lint"}
# Cycles between modules of one package, each hidden behind an import inside a function.
# Known debt: break them, then delete the line. A cycle that contains none of these
# fails (one that grows a known cycle is the same debt, and passes).
KNOWN_MODULE_CYCLES: list[set[str]] = []

Graph = dict[str, set[str]]  # module -> modules it imports (ampguard modules, and "torch")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules one file imports: ampguard modules it names, plus ``torch`` if it imports torch."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_top_or_ours(alias.name))
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, is_package)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if sub in known else _top_or_ours(module))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.add(_top_or_ours(node.args[0].value))
    out.discard(name)
    return {m for m in out if m == "torch" or m.startswith("ampguard")}


def _top_or_ours(module: str) -> str:
    return module if module.startswith("ampguard") else module.split(".")[0]


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_shim(path: Path) -> bool:
    return SHIM_DOC in path.read_text(encoding="utf-8")


def package_graph(root: Path = SRC) -> Graph:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    for name, path in files.items():
        if path.parent == root and is_shim(path):
            LAYERS[-1].add(name.split(".")[-1])
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imports_of(tree, name, path.name == "__init__.py", known)
    return graph


def unit(module: str) -> str | None:
    """``ampguard.core.scaler`` -> ``core``; the facade ``ampguard`` itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def rank(u: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if u in layer), None)


def arrows_against(graph: Graph) -> list[str]:
    """Every import that points up or sideways in LAYERS, or touches an unplaced unit."""
    bad = []
    for src, targets in sorted(graph.items()):
        a = unit(src)
        for dst in sorted(targets - {"torch"}):
            b = unit(dst)
            if a is None or a == b:
                continue  # the facade's TYPE_CHECKING imports; a package's own modules
            if b is None:
                bad.append(f"{src} imports the ampguard facade: import from the defining module")
                continue
            ra, rb = rank(a), rank(b)
            if ra is None or rb is None:
                bad.append(f"{src} -> {dst}: unit {a if ra is None else b!r} is not in LAYERS")
            elif rb >= ra:
                bad.append(f"{src} -> {dst}: {a} (layer {ra}) may not import {b} (layer {rb})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def unit_edges(graph: Graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        a = unit(src)
        for dst in targets - {"torch"}:
            b = unit(dst)
            if a and b and a != b:
                out.setdefault(a, set()).add(b)
    return out


def reaches_torch(graph: Graph, start: Iterable[str]) -> dict[str, list[str]]:
    """module -> an import chain ending in torch, for each start module that reaches torch."""
    out = {}
    for s in start:
        seen, todo = {s: [s]}, [s]
        while todo:
            m = todo.pop()
            for t in graph.get(m, ()):
                if t not in seen:
                    seen[t] = [*seen[m], t]
                    todo.append(t)
        if "torch" in seen:
            out[s] = seen["torch"]
    return out


def lint_violations(graph: Graph) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        if unit(src) == "lint":
            bad += [
                f"{src} -> {t}"
                for t in sorted(targets - {"torch"})
                if unit(t) not in LINT_MAY_IMPORT
            ]
    return bad


# ---- the checks, proven on a synthetic graph --------------------------------------------------

SYNTHETIC: Graph = {
    "ampguard.findings": set(),
    "ampguard.core.scaler": {"torch"},
    "ampguard.rules": {"ampguard.findings"},
    "ampguard.telemetry": {"ampguard.rules", "ampguard.core.scaler", "torch"},
    "ampguard.guard": {"ampguard.telemetry", "ampguard.core.scaler"},
    "ampguard.cli": {"ampguard.guard"},
    "ampguard.lint": {"ampguard.findings"},
}


def test_a_clean_synthetic_graph_passes_every_check():
    assert arrows_against(SYNTHETIC) == []
    assert cycles(unit_edges(SYNTHETIC)) == []
    assert lint_violations(SYNTHETIC) == []
    assert reaches_torch(SYNTHETIC, ["ampguard.lint", "ampguard.rules"]) == {}


def test_an_injected_upward_import_fails():
    graph = {**SYNTHETIC, "ampguard.core.scaler": {"torch", "ampguard.guard"}}
    assert arrows_against(graph) == [
        "ampguard.core.scaler -> ampguard.guard: core (layer 1) may not import guard (layer 4)"
    ]
    assert cycles(unit_edges(graph)) == [{"core", "guard", "telemetry"}]


def test_a_sideways_import_and_an_unplaced_unit_fail():
    graph = {
        **SYNTHETIC,
        "ampguard.telemetry": {"ampguard.forensics"},
        "ampguard.newthing": {"ampguard.findings"},
    }
    bad = arrows_against(graph)
    assert (
        "ampguard.telemetry -> ampguard.forensics: telemetry (layer 3) may not import "
        "forensics (layer 3)" in bad
    )
    assert "ampguard.newthing -> ampguard.findings: unit 'newthing' is not in LAYERS" in bad


def test_lint_reaching_torch_or_core_fails():
    graph = {**SYNTHETIC, "ampguard.lint": {"ampguard.findings", "ampguard.core.scaler"}}
    assert lint_violations(graph) == ["ampguard.lint -> ampguard.core.scaler"]
    assert reaches_torch(graph, ["ampguard.lint"]) == {
        "ampguard.lint": ["ampguard.lint", "ampguard.core.scaler", "torch"]
    }


def test_imports_inside_functions_type_checking_and_import_module_are_read():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n    from ampguard.guard import Guard\n"
        "def f():\n    from ampguard import runlog\n    import torch\n"
        "    return importlib.import_module('ampguard.forensics')\n"
        "from . import _x\n"
        "from ampguard._version import __version__\n"
    )
    known = {"ampguard.runlog", "ampguard.core._x", "ampguard._version"}
    found = imports_of(ast.parse(source), "ampguard.core.y", False, known)
    assert found == {
        "ampguard.guard",
        "ampguard.runlog",
        "torch",
        "ampguard.forensics",
        "ampguard.core._x",
        "ampguard._version",
    }


def test_a_subpackage_reading_the_version_from_the_facade_fails():
    """``from ampguard import __version__`` is an import of the top package like any other:
    a subpackage reads the version from the ground-floor ``ampguard._version``."""
    source = "from ampguard import __version__\n"
    found = imports_of(ast.parse(source), "ampguard.lint._output", False, set())
    assert found == {"ampguard"}
    assert arrows_against({"ampguard.lint._output": found}) == [
        "ampguard.lint._output imports the ampguard facade: import from the defining module"
    ]
    ground = imports_of(
        ast.parse("from ampguard._version import __version__\n"),
        "ampguard.lint._output",
        False,
        {"ampguard._version"},
    )
    assert arrows_against({"ampguard.lint._output": ground}) == []


# ---- the real package --------------------------------------------------------------------------


def test_every_import_points_down_the_layers():
    assert arrows_against(package_graph()) == []


def test_no_cycle_between_packages():
    assert cycles(unit_edges(package_graph())) == []


def test_no_new_cycle_between_modules():
    graph = {m: {t for t in ts if t != "torch"} for m, ts in package_graph().items()}
    new = [c for c in cycles(graph) if not any(k <= c for k in KNOWN_MODULE_CYCLES)]
    assert new == []


def test_no_public_name_is_also_a_subpackage_or_top_module():
    # ``import ampguard.x`` sets the attribute ``x`` on ampguard: it must not hide ``ag.x``
    import ampguard

    top = {p.stem for p in SRC.glob("*.py")} | {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert set(ampguard._EXPORTS) & top == set()


def test_top_level_holds_a_handful_of_modules():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 8, top


def test_lint_imports_only_findings_and_util_and_never_torch():
    graph = package_graph()
    assert lint_violations(graph) == []
    lint = [m for m in graph if unit(m) == "lint"]
    assert reaches_torch(graph, lint) == {}


def test_torch_free_packages_stay_torch_free():
    graph = package_graph()
    assert reaches_torch(graph, [m for m in graph if unit(m) in TORCH_FREE]) == {}


def test_type_checking_block_names_every_export():
    import ampguard

    tree = ast.parse((SRC / "__init__.py").read_text(encoding="utf-8"))
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                seen.update({a.name: imp.module for a in imp.names})
    assert seen == ampguard._EXPORTS


@pytest.mark.parametrize(
    "path, name",
    [
        ("ampguard.fp32_islands", "keep_fp32"),  # README: Forensics
        ("ampguard.distributed_hooks", "register_nonfinite_safe_hook"),  # README: Distributed
        ("ampguard.distributed", "PeerFailureError"),
        ("ampguard.rules", "RuleConfig"),
        ("ampguard.integrations.transformers", "AmpGuardCallback"),
        ("ampguard.integrations.lightning", "AmpGuardCallback"),
        ("ampguard.integrations.accelerate", "watch_accelerator"),
        ("ampguard.integrations.sinks", "WandbSink"),
        ("ampguard.integrations", "grad_scaler"),
    ],
)
def test_import_paths_the_readme_documents_still_work(path, name):
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():  # the old-path shims warn (tests/test_old_paths.py)
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(path)
    except ImportError as exc:  # an optional framework (the extra) is not installed
        pytest.skip(str(exc))
    assert callable(getattr(module, name))


def test_every_precision_hook_is_importable_by_the_guard():
    # a registry entry names its conversion hook as "module:attribute" (the registry sits in the
    # lowest layer); the Guard loads it, so the hook must live below the Guard and resolve
    from ampguard import precisions

    guard_rank = rank("guard")
    assert guard_rank is not None
    for entry in precisions.REGISTRY.values():
        if entry.hook is None:
            continue
        module = entry.hook.partition(":")[0]
        assert module.startswith("ampguard."), entry.hook
        hook_rank = rank(unit(module) or "")
        assert hook_rank is not None and hook_rank < guard_rank, f"{entry.name}: {entry.hook}"
        assert callable(entry.load_hook()), entry.hook


# ---- package __init__ files hold imports only -------------------------------------------------

# Package __init__ files that still hold code, with who moves it; delete the line when it moved.
PENDING_INIT: dict[str, str] = {}


def init_violations(source: str, *, facade: bool = False) -> list[str]:
    """Statements of an ``__init__.py`` other than its docstring, imports and ``__all__``.

    The top ``ampguard/__init__.py`` (``facade``) may also hold ``if TYPE_CHECKING:`` import
    blocks, the lazy ``__getattr__`` / ``__dir__`` and the ``_EXPORTS`` / ``__version__`` they read.
    """
    facade_names = {"_EXPORTS", "__version__"}
    bad = []
    for i, node in enumerate(ast.parse(source).body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if targets and names == {"__all__"}:
            continue
        if facade and targets and names <= facade_names:
            continue
        if (
            facade
            and isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING"
            and all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body)
            and not node.orelse
        ):
            continue
        if facade and isinstance(node, ast.FunctionDef) and node.name in {"__getattr__", "__dir__"}:
            continue
        bad.append(f"line {node.lineno}: {type(node).__name__}")
    return bad


def test_a_synthetic_init_with_code_fails():
    clean = '"""Doc."""\nfrom a import b\nimport c\n__all__ = ["b"]\n__all__ += ["c"]\n'
    assert init_violations(clean) == []
    assert init_violations(clean + "X = 1\n") == ["line 6: Assign"]
    assert init_violations(clean + "def f():\n    pass\n") == ["line 6: FunctionDef"]
    assert init_violations(clean + "class C:\n    pass\n") == ["line 6: ClassDef"]
    lazy = (
        "from typing import TYPE_CHECKING\n_EXPORTS = {}\n"
        "if TYPE_CHECKING:\n    from a import b as b\n"
        "def __getattr__(name):\n    return name\n"
    )
    assert init_violations(lazy, facade=True) == []
    # only the top facade may be lazy, and its TYPE_CHECKING block holds imports only
    assert init_violations(lazy) == ["line 2: Assign", "line 3: If", "line 5: FunctionDef"]
    assert init_violations("if TYPE_CHECKING:\n    X = 1\n", facade=True) == ["line 1: If"]


def test_every_package_init_holds_only_imports():
    found = {}
    for path in sorted(SRC.rglob("__init__.py")):
        package = ".".join(path.parent.relative_to(SRC).parts)
        bad = init_violations(path.read_text(encoding="utf-8"), facade=package == "")
        if bad:
            found[package or "ampguard"] = bad
    assert {p: b for p, b in found.items() if p not in PENDING_INIT} == {}
    # a package that was moved leaves the pending list
    assert sorted(set(PENDING_INIT) - set(found)) == []


# Rooms with a size budget (lines), so that what was split out does not grow back.
SIZE_BUDGET = {
    "telemetry/_telemetry.py": 600,
    "telemetry/_run_writer.py": 400,
    "guard/_guard.py": 600,
}


def test_split_rooms_stay_within_their_size_budget():
    over = {
        name: lines
        for name, limit in SIZE_BUDGET.items()
        if (lines := len((SRC / name).read_text(encoding="utf-8").splitlines())) > limit
    }
    assert not over, f"over their line budget {SIZE_BUDGET}: {over}"


# Functions with a length budget (lines, signature included, as ``ast`` counts them).
FUNCTION_BUDGET = {("guard/_guard.py", "Guard", "__init__"): 70}


def test_long_functions_stay_within_their_length_budget():
    over = {}
    for (name, cls, func), limit in FUNCTION_BUDGET.items():
        tree = ast.parse((SRC / name).read_text(encoding="utf-8"))
        (node,) = [
            f
            for c in tree.body
            if isinstance(c, ast.ClassDef) and c.name == cls
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == func
        ]
        assert node.end_lineno is not None
        if (lines := node.end_lineno - node.lineno + 1) > limit:
            over[f"{name}:{cls}.{func}"] = lines
    assert not over, f"over their length budget {FUNCTION_BUDGET}: {over}"


def test_the_guard_config_checks_exactly_the_guard_s_arguments():
    """``guard._config.check`` takes the Guard's arguments by their names (the Guard passes its
    ``locals()``): same names, order and kinds, so neither can drift from the other."""
    import inspect

    from ampguard import Guard
    from ampguard.guard import _config

    guard = list(inspect.signature(Guard.__init__).parameters.values())[1:]
    check = list(inspect.signature(_config.check).parameters.values())
    assert [(p.name, p.kind) for p in guard] == [(p.name, p.kind) for p in check]
