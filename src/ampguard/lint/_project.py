"""Project mode: names imported from other files of the linted tree resolve to their ``def``.

``ampguard lint DIR`` lints every file on its own, but a training script rarely keeps its
checkpoint saving, its GradScaler factory or its autocast context in the same file. When a rule
meets a call it cannot read (``utils.save_checkpoint(state, path)``, ``create_grad_scaler(...)``),
it asks the :class:`Project` for the ``def`` behind it. The project follows only files that are part
of the same run (never site-packages or files outside the given paths), parses each lazily at most
once while it stays cached, follows at most :data:`MAX_FOLLOWED` other files per linted file and
none larger than :data:`MAX_FILE_BYTES`, and stops re-export chains after :data:`MAX_HOPS` hops, so
import cycles and huge trees cost a bounded amount of work.
"""

from __future__ import annotations

import ast
import os
from collections import OrderedDict
from collections.abc import Iterable

from ampguard.findings import Finding
from ampguard.lint._calls import argument_for, resolve_def
from ampguard.lint._model import FUNCS, FileModel
from ampguard.lint._source import Parsed, parse, read_source

__all__ = ["MAX_FILE_BYTES", "MAX_FOLLOWED", "MAX_HOPS", "Project", "argument_for", "resolve_def"]

MAX_FOLLOWED = 16  # other files parsed while linting one file
MAX_FILE_BYTES = 1 << 20  # a larger file is not followed (it is still linted on its own)
MAX_HOPS = 4  # re-exports followed (``from .utils import save`` in ``__init__.py``)
_MAX_CACHED = 32  # followed files kept parsed between linted files
_MAX_UP = 6  # folders above the importing file searched for an absolute import
_Resolved = tuple[FileModel, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]


def _key(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


class Project:
    """The files of one lint run, and the ``def``/``class`` their imported names refer to."""

    def __init__(self, files: Iterable[str]) -> None:
        self.files = {_key(f) for f in files}
        self._models: OrderedDict[str, FileModel | None] = OrderedDict()
        self._resolved: dict[tuple[str, str], _Resolved | None] = {}
        self._budget = MAX_FOLLOWED
        self._current: tuple[str, FileModel] | None = None
        self._sources: dict[str, str | bytes] = {}  # what each cached model was parsed from
        self._linted: FileModel | None = None
        self.denied = 0  # files (or names) not followed because the budget ran out, ever

    def begin(self, path: str, model: FileModel) -> None:
        """``model`` (of ``path``) is linted now: a call back into it resolves to this model."""
        # kept apart from the cache: linted files' trees must not pile up (memory, GC time)
        self._current = (_key(path), model)
        self._budget = MAX_FOLLOWED
        self._resolved.clear()  # answers hold models: keep none alive past the file that asked

    @property
    def exhausted(self) -> bool:
        """The file being linted has used up its :data:`MAX_FOLLOWED` followed files."""
        return self._budget <= 0

    def _store(self, key: str, model: FileModel | None, source: str | bytes | None) -> None:
        self._models[key] = model
        self._models.move_to_end(key)
        if source is None:
            self._sources.pop(key, None)
        else:
            self._sources[key] = source
        while len(self._models) > _MAX_CACHED:
            old, _ = self._models.popitem(last=False)
            self._sources.pop(old, None)

    def linted(self, path: str, source: str | bytes) -> Parsed | Finding:
        """``path``'s parse for linting it, reusing the model an importer already built.

        Kept (at most :data:`_MAX_CACHED` files, least recently used out) so that files
        imported later, and the helpers' summaries cached on their ``def`` nodes, are reused."""
        key = _key(path)
        found = self._models.get(key)
        cached = self._sources.get(key)
        if found is not None and cached is not None and cached == source:
            self._models.move_to_end(key)
            self._linted = found
            return (
                Parsed(path, found.tree, data=source)
                if isinstance(source, bytes)
                else Parsed(path, found.tree, _text=source)
            )
        parsed = parse(source, path)
        self._linted = None
        return parsed

    def model_for(self, path: str, parsed: Parsed) -> FileModel:
        """The model to lint ``parsed`` with (the cached one :meth:`linted` found, else new)."""
        found, self._linted = self._linted, None
        if found is not None and found.tree is parsed.tree:
            return found
        model = FileModel(parsed.tree, path, self)
        key = _key(path)
        if key in self.files:
            self._store(key, model, parsed.data if parsed.data is not None else parsed.text)
        return model

    def model(self, path: str) -> FileModel | None:
        """The parsed file (``None``: not part of the run, too large, unreadable or over budget)."""
        key = _key(path)
        if self._current is not None and self._current[0] == key:
            return self._current[1]
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        if key not in self.files:
            return None
        if self._budget <= 0:
            self.denied += 1  # an answer reached now may differ from one with budget left
            return None
        self._budget -= 1
        model = None
        data: bytes | Finding | None = None
        try:
            if os.path.getsize(key) <= MAX_FILE_BYTES:
                data = read_source(key)  # regular files only: a FIFO or device is never read
                parsed = (
                    parse(data, path)
                    if isinstance(data, bytes) and len(data) <= MAX_FILE_BYTES
                    else None
                )
                if isinstance(parsed, Parsed):
                    model = FileModel(parsed.tree, path=path, project=self)
        except (OSError, RecursionError, MemoryError):
            model = None
        self._store(key, model, data if isinstance(data, bytes) and model is not None else None)
        return model

    def resolve(self, qual: str, importer: str, hops: int = 0) -> _Resolved | None:
        """The ``def``/``class`` that dotted ``qual`` (as imported in ``importer``) names."""
        if hops > MAX_HOPS:
            return None
        cache_key = (qual, os.path.dirname(_key(importer)))
        if cache_key in self._resolved:
            return self._resolved[cache_key]
        self._resolved[cache_key] = None  # a cycle back to this name resolves to nothing
        found = self._resolve(qual, importer, hops)
        if found is None and self._budget <= 0:
            self._resolved.pop(cache_key, None)  # over budget here: a later file may resolve it
        else:
            self._resolved[cache_key] = found
        return found

    def _resolve(self, qual: str, importer: str, hops: int) -> _Resolved | None:
        level = len(qual) - len(qual.lstrip("."))
        parts = [p for p in qual[level:].split(".") if p]
        if not parts:
            return None
        here = os.path.dirname(_key(importer))
        if level:
            for _ in range(level - 1):
                here = os.path.dirname(here)
            bases = [here]
        else:
            bases = [here]
            for _ in range(_MAX_UP):
                parent = os.path.dirname(bases[-1])
                if parent == bases[-1]:
                    break
                bases.append(parent)
        for base in bases:
            for count in range(len(parts), 0, -1):
                stem = os.path.join(base, *parts[:count])
                for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
                    if _key(candidate) in self.files:
                        if count == len(parts):
                            return None  # a module, not a def
                        model = self.model(candidate)
                        return None if model is None else self._lookup(model, parts[count:], hops)
        return None

    def _lookup(self, model: FileModel, attrs: list[str], hops: int) -> _Resolved | None:
        scope = model.scopes[model.tree]
        name = attrs[0]
        values = scope.assigns.get(name)
        if not values and name in scope.imports:  # re-exported: follow the import
            return self.resolve(".".join([scope.imports[name], *attrs[1:]]), model.path, hops + 1)
        if not values or not isinstance(values[-1], (*FUNCS, ast.ClassDef)):
            return None
        node = values[-1]
        if len(attrs) == 1:
            return model, node
        if isinstance(node, ast.ClassDef) and len(attrs) == 2:
            for stmt in node.body:
                if isinstance(stmt, FUNCS) and stmt.name == attrs[1]:
                    return model, stmt
        return None
