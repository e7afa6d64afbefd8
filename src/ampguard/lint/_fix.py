"""``ampguard lint --fix`` / ``--diff``: minimal text edits for the mechanical rules.

Each fix is an edit at source offsets taken from the AST (nothing is re-printed, so comments,
quotes, line breaks and the file's newline style stay as they are), fixes only what is certain,
and is idempotent: the fixed file has no finding of that rule at that place, so a second run
changes nothing.

- **AG206** ``torch.cuda.amp.X(...)`` -> ``torch.amp.X("cuda", ...)`` (``torch.cpu.amp``:
  ``"cpu"``; the quote is the one the file uses most), for ``autocast``, ``GradScaler``,
  ``custom_fwd``, ``custom_bwd`` (``device_type="cuda"``). The old autocast's positional
  arguments (``enabled``, ``dtype``, ``cache_enabled``) become keywords, since
  ``torch.amp.autocast`` takes ``dtype`` second. Imports are rewritten with them
  (``from torch.cuda.amp import GradScaler`` -> ``from torch.amp import GradScaler``,
  ``from torch.cuda import amp`` -> ``from torch import amp``) when every use of the imported
  name is a call the fix rewrites; otherwise those calls are left alone.
- **AG201** inserts ``scaler.unscale_(optimizer)`` (the code's own spelling) on its own line
  before the statement that clips.
- **AG204** inserts ``scaler.update()`` on its own line after the ``scaler.step(...)`` statement
  that is never followed by one (not for an ``update()`` on every micro-batch: moving it is a
  decision, not a mechanical edit).
- **AG208** adds ``weights_only=True`` to a ``torch.load`` without it when everything done with
  the result is loading state dicts (``m.load_state_dict(torch.load(p))``, ``sd = torch.load(p)``
  then ``m.load_state_dict(sd)`` / ``m.load_state_dict(sd["model"])``); an explicit
  ``weights_only=False`` is left to the author.

Cost: one lint of the file per round (at most :data:`MAX_ROUNDS`; a round applies every edit
that does not overlap another, the next round picks up the rest).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ampguard.findings import Finding
from ampguard.lint._engine import Options, lint_bytes
from ampguard.lint._model import FileModel
from ampguard.lint._names import CLIPS, DEPRECATED, dotted
from ampguard.lint._source import physical_lines

__all__ = ["FIXABLE", "MAX_ROUNDS", "Fixed", "decode", "fix_text"]

FIXABLE = frozenset({"AG201", "AG204", "AG206", "AG208"})
MAX_ROUNDS = 4
_AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")  # torch.cuda.amp.autocast(...)
_OLD_MODULES = {"torch.cuda.amp": "torch.amp", "torch.cpu.amp": "torch.amp"}


@dataclass(frozen=True)
class _Edit:
    start: int  # character offsets into the text
    end: int
    text: str


@dataclass
class Fixed:
    """The result of fixing one file: the new text and the findings the edits removed.

    ``encoding`` is the file's (``utf-8-sig`` keeps a BOM): :attr:`data` is what ``--fix``
    writes. ``error`` is set, by :func:`~ampguard.lint.fix_paths`, for a file that needs fixing
    but was not written (``"a symlink ..."``, ``"No space left on device"``, ``"it changed
    while --fix ran ..."``): the file on disk is then unchanged.
    """

    path: str
    original: str
    text: str
    fixed: list[Finding] = field(default_factory=list)
    encoding: str = "utf-8"
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.text != self.original

    @property
    def original_data(self) -> bytes:
        """The file's bytes before the fix (``original`` in its own encoding)."""
        return self.original.encode(self.encoding)

    @property
    def data(self) -> bytes:
        """The bytes ``--fix`` writes (``text`` in the file's own encoding)."""
        return self.text.encode(self.encoding)


class _Source:
    """Offsets in a text from AST positions (lines are 1-based, columns count UTF-8 bytes)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = physical_lines(text)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        first = self.lines[0] if self.lines else "\n"
        self.newline = "\r\n" if first.endswith("\r\n") else "\r" if first.endswith("\r") else "\n"

    def offset(self, line: int, col: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        chars = len(text.encode("utf-8")[:col].decode("utf-8", "ignore"))
        return self.starts[line - 1] + chars

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def own_lines(self, stmt: ast.stmt) -> bool:
        """``stmt`` starts its line and ends it (a comment may follow): safe to add a line."""
        head = self.lines[stmt.lineno - 1][
            : self.offset(stmt.lineno, stmt.col_offset) - self.starts[stmt.lineno - 1]
        ]
        if head.strip():
            return False
        end = stmt.end_lineno or stmt.lineno
        tail = self.text[self.end(stmt) : self.starts[end]]
        return not tail.strip() or tail.strip().startswith("#")

    def indent(self, stmt: ast.stmt) -> str:
        """The statement's indentation, as a new line can repeat it: a form feed resets the
        tokenizer's column, so only the blanks after the last one count."""
        line = self.lines[stmt.lineno - 1]
        head = line[: self.offset(stmt.lineno, stmt.col_offset) - self.starts[stmt.lineno - 1]]
        return head.rpartition("\x0c")[2]


def fix_text(
    text: str, path: str, options: Options, lint: Callable[[str], list[Finding]] | None = None
) -> Fixed:
    """Fix the enabled fixable rules in ``text`` (rounds until nothing changes)."""
    run = lint or (lambda t: lint_bytes(t, path, options))
    result = Fixed(path, text, text)
    for _ in range(MAX_ROUNDS):
        findings = [f for f in run(result.text) if f.code in FIXABLE and f.code in options.codes]
        if not findings:
            break
        edits, done = _edits(result.text, findings)
        if not edits:
            break
        text = _apply(result.text, edits)
        if not _parses(text):  # never hand back a file that no longer parses
            break
        result.text = text
        result.fixed.extend(done)
    return result


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _apply(text: str, edits: list[_Edit]) -> str:
    out, last = [], len(text)
    for edit in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        out.append(text[edit.end : last])
        out.append(edit.text)
        last = edit.start
    out.append(text[:last])
    return "".join(reversed(out))


def _edits(text: str, findings: list[Finding]) -> tuple[list[_Edit], list[Finding]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [], []
    model = FileModel(tree)
    src = _Source(text)
    chosen: list[_Edit] = []
    done: list[Finding] = []
    for finding, edits in _proposals(model, src, findings):
        if edits and not any(_overlaps(e, c) for e in edits for c in chosen):
            chosen.extend(edits)
            done.append(finding)
    return chosen, done


def _overlaps(a: _Edit, b: _Edit) -> bool:
    if a.start == a.end and b.start == b.end:
        return a.start == b.start
    return a.start < b.end and b.start < a.end or a.start == b.start


def _proposals(
    model: FileModel, src: _Source, findings: list[Finding]
) -> Iterator[tuple[Finding, list[_Edit]]]:
    # a fallback to the old spelling for old torch is kept: rewriting it would break the old
    # torch that code still supports (AG206 reports it as info, with the fix in words)
    findings = [f for f in findings if not (f.code == "AG206" and f.evidence.get("fallback"))]
    imports = _ImportPlan(model, src, [f for f in findings if f.code == "AG206"])
    for finding in findings:
        if finding.code == "AG206":
            yield finding, imports.call_edits(finding)
        elif finding.code == "AG201":
            yield finding, _unscale_edits(model, src, finding)
        elif finding.code == "AG204":
            yield finding, _update_edits(model, src, finding)
        elif finding.code == "AG208":
            yield finding, _weights_only_edits(model, src, finding)


def _at(
    model: FileModel, src: _Source, finding: Finding, kinds: tuple[type, ...]
) -> ast.AST | None:
    """The node of ``kinds`` a finding points at (its line and column; findings count columns
    in characters, the AST in UTF-8 bytes)."""
    line = finding.line or 1
    text = src.lines[line - 1] if 0 < line <= len(src.lines) else ""
    col = len(text[: (finding.col or 1) - 1].encode("utf-8"))
    for node in ast.walk(model.tree):
        if (
            isinstance(node, kinds)
            and getattr(node, "lineno", None) == line
            and getattr(node, "col_offset", -1) == col
        ):
            return node
    return None


def _statement(model: FileModel, node: ast.AST) -> ast.stmt | None:
    for anc in [node, *model.ancestors(node)]:
        if isinstance(anc, ast.stmt):
            return anc
    return None


# ----------------------------------------------------------------------------------- AG201
def _unscale_edits(model: FileModel, src: _Source, finding: Finding) -> list[_Edit]:
    scaler, opt = finding.evidence.get("scaler"), finding.evidence.get("optimizer")
    call = _at(model, src, finding, (ast.Call,))
    if not scaler or not opt or not isinstance(call, ast.Call):
        return []
    if model.call_name(call) not in CLIPS:
        return []
    stmt = _statement(model, call)
    if stmt is None or not src.own_lines(stmt):
        return []
    at = src.starts[stmt.lineno - 1]
    line = f"{src.indent(stmt)}{scaler}.unscale_({opt}){src.newline}"
    return [_Edit(at, at, line)]


# ----------------------------------------------------------------------------------- AG204
def _update_edits(model: FileModel, src: _Source, finding: Finding) -> list[_Edit]:
    scaler = finding.evidence.get("scaler")
    call = _at(model, src, finding, (ast.Call,))
    if (
        not scaler
        or not isinstance(call, ast.Call)
        or not isinstance(call.func, ast.Attribute)
        or call.func.attr != "step"
        or dotted(call.func.value) != scaler
    ):
        return []  # "update() on every micro-batch" points at the update: not mechanical
    stmt = _statement(model, call)
    if stmt is None or not isinstance(stmt, ast.Expr) or not src.own_lines(stmt):
        return []
    end = stmt.end_lineno or stmt.lineno
    at = src.starts[end]
    before = src.text[:at]
    lead = "" if before.endswith(("\n", "\r")) else src.newline
    return [_Edit(at, at, f"{lead}{src.indent(stmt)}{scaler}.update(){src.newline}")]


# ----------------------------------------------------------------------------------- AG208
def _weights_only_edits(model: FileModel, src: _Source, finding: Finding) -> list[_Edit]:
    if not finding.message.startswith("torch.load without weights_only"):
        return []  # an explicit weights_only=False is the author's decision
    call = _at(model, src, finding, (ast.Call,))
    if not isinstance(call, ast.Call) or not call.args or _keyword(call, "weights_only"):
        return []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return []
    if not _only_state_dicts(model, call):
        return []
    last = max(
        [*call.args, *(k.value for k in call.keywords)],
        key=lambda n: (getattr(n, "end_lineno", 0), getattr(n, "end_col_offset", 0)),
    )
    at = src.end(last)
    return [_Edit(at, at, ", weights_only=True")]


def _keyword(call: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in call.keywords)


def _loads_state(model: FileModel, node: ast.AST) -> bool:
    """``node`` is the argument of ``x.load_state_dict(node)``."""
    parent = model.parent(node)
    return (
        isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Attribute)
        and parent.func.attr == "load_state_dict"
        and bool(parent.args)
        and parent.args[0] is node
    )


def _only_state_dicts(model: FileModel, call: ast.Call) -> bool:
    """Everything done with ``torch.load``'s result is loading state dicts from it."""
    if _loads_state(model, call):
        return True
    parent = model.parent(call)
    if not (
        isinstance(parent, ast.Assign)
        and len(parent.targets) == 1
        and isinstance(parent.targets[0], ast.Name)
    ):
        return False
    name = parent.targets[0].id
    scope = model.scope_of(call)
    uses = [
        n
        for n in ast.walk(model.tree)
        if isinstance(n, ast.Name) and n.id == name and model.scope_of(n) is scope
    ]
    loads = [n for n in uses if isinstance(n.ctx, ast.Load)]
    stores = [n for n in uses if not isinstance(n.ctx, ast.Load)]
    if len(stores) != 1 or not loads:
        return False
    for use in loads:
        holder = model.parent(use)
        if _loads_state(model, use):
            continue
        if (
            isinstance(holder, ast.Subscript)
            and holder.value is use
            and isinstance(holder.slice, ast.Constant)
            and _loads_state(model, holder)
        ):
            continue
        return False
    return True


# ----------------------------------------------------------------------------------- AG206
class _ImportPlan:
    """Which deprecated imports can be rewritten: those whose every use is a fixed call."""

    def __init__(self, model: FileModel, src: _Source, findings: list[Finding]) -> None:
        self.model = model
        self.src = src
        self.targets: dict[int, tuple[ast.AST, Finding]] = {}
        for finding in findings:
            node = _at(model, src, finding, (ast.Call, ast.Name, ast.Attribute))
            if node is not None:
                self.targets[id(node)] = (node, finding)
        self.rewrites: dict[str, _Edit | None] = {}  # bound name -> import edit (None: cannot)
        self._import_used: set[int] = set()
        self._quote_char: str | None = None
        self._plan()

    def _plan(self) -> None:
        fixed_funcs = {
            id(node.func if isinstance(node, ast.Call) else node)
            for node, _ in self.targets.values()
        }
        for stmt in ast.walk(self.model.tree):
            if isinstance(stmt, ast.ImportFrom) and stmt.level == 0:
                edit = self._from_edit(stmt)
                names = [a.asname or a.name for a in stmt.names]
            elif isinstance(stmt, ast.Import):
                edit, names = self._import_edit(stmt)
            else:
                continue
            if edit is None or not names:
                continue
            for name in names:  # tentatively: the calls through it are judged with it
                self.rewrites[name] = edit
            ok = all(self._uses_fixed(name, fixed_funcs) for name in names)
            for name in names:
                self.rewrites[name] = edit if ok else None

    def _from_edit(self, stmt: ast.ImportFrom) -> _Edit | None:
        module = stmt.module or ""
        if module in _OLD_MODULES:
            if not all(
                a.name in ("autocast", "GradScaler", "custom_fwd", "custom_bwd") for a in stmt.names
            ):
                return None
            new = _OLD_MODULES[module]
        elif module in ("torch.cuda", "torch.cpu") and [a.name for a in stmt.names] == ["amp"]:
            new = "torch"
        else:
            return None
        segment = self.src.text[self.src.start(stmt) : self.src.end(stmt)]
        match = re.match(
            r"from\s+(" + re.escape(module).replace(r"\.", r"\s*\.\s*") + r")\b", segment
        )
        if match is None:
            return None
        at = self.src.start(stmt) + match.start(1)
        return _Edit(at, at + len(match.group(1)), new)

    def _import_edit(self, stmt: ast.Import) -> tuple[_Edit | None, list[str]]:
        if (
            len(stmt.names) != 1
            or stmt.names[0].name not in _OLD_MODULES
            or not stmt.names[0].asname
        ):
            return None, []  # ``import torch.cuda.amp`` binds ``torch``: its calls are fixed alone
        alias = stmt.names[0]
        segment = self.src.text[self.src.start(stmt) : self.src.end(stmt)]
        match = re.match(r"import\s+(" + re.escape(alias.name) + r")\b", segment)
        if match is None:
            return None, []
        at = self.src.start(stmt) + match.start(1)
        return _Edit(at, at + len(match.group(1)), _OLD_MODULES[alias.name]), [alias.asname or ""]

    def _uses_fixed(self, name: str, fixed_funcs: set[int]) -> bool:
        for node in ast.walk(self.model.tree):
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
                parent = self.model.parent(node)
                if id(node) in fixed_funcs or (
                    isinstance(parent, ast.Attribute) and id(parent) in fixed_funcs
                ):
                    if self._call_edits(self._target_of(node)) is None:
                        return False
                    continue
                return False
        return True

    def _target_of(self, node: ast.AST) -> tuple[ast.AST, Finding] | None:
        parent = self.model.parent(node)
        for candidate in (node, parent, self.model.parent(parent) if parent else None):
            if candidate is not None and id(candidate) in self.targets:
                return self.targets[id(candidate)]
        return None

    def call_edits(self, finding: Finding) -> list[_Edit]:
        node = _at(self.model, self.src, finding, (ast.Call, ast.Name, ast.Attribute))
        if node is None or id(node) not in self.targets:
            return []
        target = self.targets[id(node)]
        edits = self._call_edits(target)
        if edits is None:
            return []
        func = target[0].func if isinstance(target[0], ast.Call) else target[0]
        head = func
        while isinstance(head, ast.Attribute):
            head = head.value
        if isinstance(head, ast.Name) and head.id in self.rewrites:
            edit = self.rewrites[head.id]
            if edit is None:
                return []
            if id(edit) not in self._import_used:  # the import edit rides with the first call
                self._import_used.add(id(edit))
                edits = [*edits, edit]
        return edits

    def _call_edits(self, target: tuple[ast.AST, Finding] | None) -> list[_Edit] | None:
        if target is None:
            return None
        node, finding = target
        qual = finding.evidence.get("deprecated")
        if qual not in DEPRECATED:
            return None
        _, device, _ = DEPRECATED[qual]
        leaf = qual.rsplit(".", 1)[-1]
        func = node.func if isinstance(node, ast.Call) else node
        edits: list[_Edit] = []
        rename = self._rename_func(func)
        if rename is None:
            return None
        edits.extend(rename)
        quote = self._quote()
        if leaf in ("custom_fwd", "custom_bwd"):
            keyword = f"device_type={quote}{device}{quote}"
            if not isinstance(node, ast.Call):  # bare decorator: @torch.cuda.amp.custom_fwd
                end = self.src.end(node)
                return [*edits, _Edit(end, end, f"({keyword})")]
            if node.args:
                return None  # custom_fwd(fn): not the decorator form
            return [*edits, *self._insert_first(node, keyword)]
        if not isinstance(node, ast.Call):
            return None
        first = f"{quote}{device}{quote}"
        if leaf == "autocast":
            if any(isinstance(a, ast.Starred) for a in node.args) or len(node.args) > len(
                _AUTOCAST_POSITIONAL
            ):
                return None
            for arg, name in zip(node.args, _AUTOCAST_POSITIONAL, strict=False):
                at = self.src.start(arg)
                edits.append(_Edit(at, at, f"{name}="))
        return [*edits, *self._insert_first(node, first)]

    def _rename_func(self, func: ast.AST) -> list[_Edit] | None:
        """``torch.cuda.amp.X`` -> ``torch.amp.X``; ``amp.X`` / ``X`` via an import: unchanged."""
        if isinstance(func, ast.Attribute):
            amp = func.value
            if (
                isinstance(amp, ast.Attribute)
                and amp.attr == "amp"
                and isinstance(amp.value, ast.Attribute)
                and amp.value.attr in ("cuda", "cpu")
            ):
                # drop ``.cuda`` (between the torch name and ``.amp``)
                start = self.src.end(amp.value.value)
                end = self.src.end(amp.value)
                return [_Edit(start, end, "")]
            if isinstance(amp, ast.Name):
                return [] if amp.id in self.rewrites else None
            return None
        if isinstance(func, ast.Name):
            return [] if func.id in self.rewrites else None
        return None

    def _insert_first(self, call: ast.Call, text: str) -> list[_Edit]:
        """Insert ``text`` as the call's first argument."""
        if call.args or call.keywords:
            firsts: list[ast.AST] = [*call.args, *call.keywords]
            first = min(
                firsts, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))
            )
            at = self.src.start(first)
            return [_Edit(at, at, f"{text}, ")]
        at = self.src.end(call) - 1  # just inside ``)``
        return [_Edit(at, at, text)]

    def _quote(self) -> str:
        """The file's string quote (what most of its string literals use)."""
        if self._quote_char is None:
            self._quote_char = self._count_quotes()
        return self._quote_char

    def _count_quotes(self) -> str:
        counts = {"'": 0, '"': 0}
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.src.text).readline):
                if tok.type == tokenize.STRING:
                    body = tok.string.lstrip("rbuRBUfF")
                    if body[:1] in counts:
                        counts[body[:1]] += 1
        except (tokenize.TokenError, SyntaxError, IndentationError):
            pass
        return "'" if counts["'"] > counts['"'] else '"'


def decode(data: bytes) -> tuple[str, str]:
    """``(text, encoding)`` of a source file, as Python reads it (a BOM is kept as
    ``utf-8-sig``, so encoding the fixed text back writes it again)."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding
