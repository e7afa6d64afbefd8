"""No module reads or writes another object's private attributes.

Every attribute access of ``src/ampguard`` is read with ``ast``: ``<expr>._name``, and the
constant names given to ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr``. A name is
*ampguard-private* when one of ampguard's own classes defines it: ``self._name = ...`` (or
``cls._name``) in the class, a ``_name`` method, or a class-level ``_name = ...``. Such a name
may be used on ``self``, ``cls`` or ``super()`` anywhere, and on any other object only inside a
module that defines it (a class and its module-private helpers). Everything else goes through
public methods and properties. Private names of torch and other libraries are not our contract
(``torch._foreach_norm``, DDP's ``_comm_hooks``); where one collides with an ampguard-private
name it is listed in :data:`THIRD_PARTY`. The scanner is first run on synthetic modules, so a
violation is proven to fail.

The same holds between packages: what one package needs from another is public there (in its
``__all__``, imported from the package), so an import of another package's private module
(``from ampguard.fp8._convert import ...`` outside ``fp8/``) is counted; at most
:data:`PRIVATE_IMPORT_LIMIT` remain, each with a comment (on its line or the lines just above)
saying why. ``_util`` and ``_version`` are the shared ground floor, private to ampguard only.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ampguard"
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}

# (module, name): a private of another library that happens to share an ampguard-private name.
THIRD_PARTY = {
    ("core/scaler.py", "_values"): "torch.Tensor._values() of a sparse gradient",
    # the user's torch.amp.GradScaler, seen through attach mode's GradScaler adapter: its scale
    # and growth tracker tensors have no public accessor that does not sync (get_scale() reads
    # the scale to the host)
    ("integrations/_tap.py", "_scale"): "torch.amp.GradScaler._scale",
    ("integrations/_tap.py", "_growth_tracker"): "torch.amp.GradScaler._growth_tracker",
}

# Imports of another package's private module that remain (each says why in a comment); lower
# it when one goes, never raise it.
PRIVATE_IMPORT_LIMIT = 0
SHARED_PRIVATE = {"_util", "_version"}  # the ground floor every package may import

# Names still pending removal, per file (empty: the contract is public everywhere).
PENDING: dict[str, set[str]] = {}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Private name -> the modules whose classes define it."""
    out: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names: set[str] = set()
            for node in cls.body:  # methods and class-level assignments
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            for node in ast.walk(cls):  # self._x = ... anywhere in the class
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                ):
                    names.add(node.attr)
            for name in filter(_is_private, names):
                out.setdefault(name, set()).add(module)
    return out


def _on_own_object(value: ast.expr) -> bool:
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def private_accesses(tree: ast.Module) -> list[tuple[int, str, str]]:
    """``(line, name, source)`` of every private attribute used on an object not self/cls."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _is_private(node.attr)
            and not _on_own_object(node.value)
        ):
            out.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ACCESSORS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not _on_own_object(node.args[0])
        ):
            out.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return out


def violations(
    sources: dict[str, str],
    *,
    third_party: dict[tuple[str, str], str],
    pending: dict[str, set[str]],
) -> list[str]:
    """``module:line: source (name defined in ...)`` for every forbidden access."""
    trees = {module: ast.parse(text, module) for module, text in sources.items()}
    defined = defined_privates(trees)
    out = []
    for module, tree in sorted(trees.items()):
        for line, name, source in sorted(private_accesses(tree)):
            owners = defined.get(name, set())
            if (
                not owners
                or module in owners
                or (module, name) in third_party
                or name in pending.get(module, set())
            ):
                continue
            out.append(
                f"{module}:{line}: {source} (private of a class in {', '.join(sorted(owners))})"
            )
    return out


def _sources() -> dict[str, str]:
    return {
        p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(SRC.rglob("*.py"))
    }


def test_the_scanner_flags_another_objects_private():
    sources = {
        "a.py": "class A:\n"
        "    def __init__(self):\n"
        "        self._x = 1\n"
        "    def _m(self):\n"
        "        return self._x\n"
        "def peek(a):\n"
        "    return a._x\n",  # same module: a module-private helper, allowed
        "b.py": "import torch\n"
        "def f(a):\n"
        "    a._x = 2\n"  # write: flagged
        "    torch._foreach_norm([])\n"  # not an ampguard name: allowed
        "    return getattr(a, '_m')()\n",  # flagged, through getattr
        "c.py": "class C(A):\n"
        "    def g(self):\n"
        "        return super()._m() + self._x\n",  # own object: allowed
        "guard/_guard.py": "class Guard:\n    def __init__(self):\n        self._steps = 0\n",
        # a helper of the same package is another module: it may not reach in either
        "guard/_step.py": "def step(guard):\n    guard._steps += 1\n",
    }
    found = violations(sources, third_party={}, pending={})
    assert found == [
        "b.py:3: a._x (private of a class in a.py)",
        "b.py:5: getattr(a, '_m') (private of a class in a.py)",
        "guard/_step.py:2: guard._steps (private of a class in guard/_guard.py)",
    ]
    assert violations(
        sources,
        third_party={("b.py", "_x"): "why"},
        pending={"b.py": {"_m"}},
    ) == ["guard/_step.py:2: guard._steps (private of a class in guard/_guard.py)"]


def test_no_module_uses_another_objects_privates():
    found = violations(_sources(), third_party=THIRD_PARTY, pending=PENDING)
    assert not found, (
        "private attributes of another ampguard object (add a public method or "
        "property to its class instead):\n" + "\n".join(found)
    )


def test_every_third_party_entry_is_still_needed():
    sources = _sources()
    trees = {m: ast.parse(t, m) for m, t in sources.items()}
    defined = defined_privates(trees)
    used = {(m, name) for m, tree in trees.items() for _, name, _ in private_accesses(tree)}
    stale = [k for k in THIRD_PARTY if k not in used or k[1] not in defined]
    assert not stale, f"THIRD_PARTY entries no longer needed: {stale}"


# ---------------------------------------------------------------------- private modules
def _module_parts(rel: str) -> list[str]:
    parts = ["ampguard", *Path(rel).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def private_module_imports(sources: dict[str, str]) -> list[tuple[str, int, str, bool]]:
    """``(module, line, imported, commented)`` for every import of another package's private
    module (``ampguard.<pkg>._x``, or ``from ampguard.<pkg> import _x``); ``commented``: a ``#``
    comment on the import's first line or in the three lines above it."""
    out = []
    for rel, text in sorted(sources.items()):
        me = _module_parts(rel)
        package = me[1] if len(me) > 1 else None
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = me if rel.endswith("__init__.py") else me[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] != "ampguard" or len(parts) < 3:
                    continue
                if parts[1] in (package, *SHARED_PRIVATE) or not _is_private(parts[2]):
                    continue
                near = lines[max(0, node.lineno - 4) : node.lineno]
                commented = "#" in near[-1] or any(ln.lstrip().startswith("#") for ln in near)
                out.append((rel, node.lineno, target, commented))
                break
    return out


def test_the_counter_finds_imports_of_another_packages_private_modules():
    sources = {
        "guard/_a.py": "from ampguard.fp8._convert import X\n"
        "from ampguard.fp8 import _block\n"
        "# why: it moves\n"
        "from ampguard.forensics._replay import rng_state\n"
        "from ampguard.fp8 import Fp8Plan\n"  # public: not counted
        "from ampguard.guard._step import step\n"  # its own package: not counted
        "from ampguard._util.checks import check_int\n",  # the shared floor: not counted
        "fp8/__init__.py": "from ampguard.fp8._convert import X\nfrom . import _block\n",
        "telemetry/_b.py": "def f():\n    import ampguard.rules._ranges\n",
    }
    assert private_module_imports(sources) == [
        ("guard/_a.py", 1, "ampguard.fp8._convert", False),
        ("guard/_a.py", 2, "ampguard.fp8._block", False),
        ("guard/_a.py", 4, "ampguard.forensics._replay", True),
        ("telemetry/_b.py", 2, "ampguard.rules._ranges", False),
    ]


def test_imports_of_another_packages_private_modules_are_few_and_say_why():
    found = private_module_imports(_sources())
    listed = "\n".join(f"{m}:{line}: {target}" for m, line, target, _ in found)
    assert len(found) <= PRIVATE_IMPORT_LIMIT, (
        f"{len(found)} imports of another package's private module (limit "
        f"{PRIVATE_IMPORT_LIMIT}): make the name public in that package's __all__ and import it "
        f"from the package:\n{listed}"
    )
    silent = [f"{m}:{line}: {target}" for m, line, target, commented in found if not commented]
    assert not silent, "say why in a comment above each: " + ", ".join(silent)
