"""fp32 islands: run chosen modules outside autocast, in fp32.

``keep_fp32(model, ["head", "blocks.*.attn"])`` matches the patterns with :func:`fnmatch.fnmatch`
against the names of ``model.named_modules()``; a module class in the list
(``keep_fp32(model, [torch.nn.BatchNorm2d])``) matches every module that is an instance of it, so
one entry covers all of a model's BatchNorms however many there are. Each matching module then
runs with autocast disabled and its floating low-precision inputs (positional and keyword, nested
in tuples, lists and dicts) cast to fp32; its children run in fp32 too. Outputs are left in
fp32: autocast casts them again where the next op needs it, so a value that only fits fp32 is
not forced back into fp16 at the module boundary. The returned :class:`Fp32Islands` removes
every hook it added.

>>> islands = keep_fp32(model, ["head"])
>>> with torch.autocast("cpu", dtype=torch.float16):
...     out = model(x)          # model.head ran in fp32
>>> islands.remove()
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

import torch

from ampguard._util.tensors import device_type

__all__ = ["Fp32Islands", "Pattern", "keep_fp32", "match_modules"]

_LOW = (torch.float16, torch.bfloat16)


Pattern = str | type[torch.nn.Module]
"""A ``keep_fp32`` entry: an fnmatch pattern over module names, or a module class."""


def match_modules(
    model: torch.nn.Module,
    patterns: Pattern | Iterable[Pattern],
    *,
    argument: str = "keep_fp32",
) -> list[str]:
    """Names in ``model.named_modules()`` matching any pattern, in model order.

    A ``str`` pattern matches names (fnmatch); a module class matches instances of it
    (subclasses too). Raises ``TypeError``, naming ``argument``, for an entry that is neither,
    and ``ValueError`` for an entry that matches no module (with the closest names, or the
    classes the model has, as a hint).
    """
    pats = _patterns(patterns, argument)
    modules = list(model.named_modules())
    for pat in pats:
        if not any(_matches(pat, name, m) for name, m in modules):
            raise ValueError(_no_match(model, pat, modules, argument))
    return [name for name, m in modules if any(_matches(pat, name, m) for pat in pats)]


def _matches(pat: Pattern, name: str, module: torch.nn.Module) -> bool:
    return fnmatch(name, pat) if isinstance(pat, str) else isinstance(module, pat)


def _no_match(
    model: torch.nn.Module, pat: Pattern, modules: list[tuple[str, Any]], argument: str
) -> str:
    if isinstance(pat, str):
        close = difflib.get_close_matches(pat, [n for n, _ in modules if n], n=3)
        hint = f"; did you mean {close}?" if close else ""
        return (
            f"{argument} pattern {pat!r} matches no module of {type(model).__name__} "
            f"(patterns are fnmatch-style over model.named_modules() names, e.g. 'head', "
            f"'blocks.*.attn', or module classes, e.g. torch.nn.BatchNorm2d){hint}"
        )
    kinds = sorted({type(m).__name__ for _, m in modules})
    return (
        f"{argument} class {pat.__qualname__} matches no module of {type(model).__name__} "
        f"(its module classes: {', '.join(kinds[:12])}{', ...' if len(kinds) > 12 else ''})"
    )


def _patterns(patterns: Any, argument: str) -> list[Pattern]:
    if isinstance(patterns, str) or _is_module_class(patterns):
        return [patterns]
    try:
        pats = list(patterns)
    except TypeError:
        raise TypeError(
            f"{argument} must be a list of module-name patterns (str) or module classes "
            f"(e.g. torch.nn.BatchNorm2d), got {type(patterns).__name__}"
        ) from None
    for pat in pats:
        if not (isinstance(pat, str) or _is_module_class(pat)):
            raise TypeError(
                f"{argument} must hold module-name patterns (str) or torch.nn.Module subclasses, "
                f"got {type(pat).__name__} {pat!r}"
            )
    return pats


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, torch.nn.Module)


class Fp32Islands:
    """The modules of ``model`` kept in fp32, and the hooks that do it (removable)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._handles: dict[str, list[Any]] = {}

    @property
    def modules(self) -> tuple[str, ...]:
        """Names of the modules kept in fp32, in the order they were added."""
        return tuple(self._handles)

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def add(self, name: str) -> bool:
        """Keep module ``name`` in fp32; False if it already is. ``ValueError`` if unknown."""
        if name in self._handles:
            return False
        module = dict(self.model.named_modules()).get(name)
        if module is None:
            raise ValueError(f"keep_fp32: {type(self.model).__name__} has no module named {name!r}")
        stack: list[Any] = []

        def enter(mod: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            ctx = torch.autocast(_device_type(mod, (args, kwargs)), enabled=False)
            ctx.__enter__()
            stack.append(ctx)
            return _to_fp32(args), _to_fp32(kwargs)

        def leave(mod: torch.nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        self._handles[name] = [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, always_call=True),
        ]
        return True

    def remove(self) -> None:
        """Remove every hook: the modules run under autocast again."""
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles.clear()

    def __enter__(self) -> Fp32Islands:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Fp32Islands({list(self._handles)})"


def keep_fp32(model: torch.nn.Module, patterns: Pattern | Iterable[Pattern]) -> Fp32Islands:
    """Run the modules matching ``patterns`` (name globs or module classes) outside autocast in
    fp32 (see the module doc).

    Returns the removable :class:`Fp32Islands` handle. Cost: no host sync; one cast per
    low-precision input of an island per call.
    """
    islands = Fp32Islands(model)
    for name in match_modules(model, patterns):
        islands.add(name)
    return islands


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, tuple):
        items = [_to_fp32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _device_type(module: torch.nn.Module, inputs: Any) -> str:
    stack = [inputs]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            return item.device.type
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return device_type(module)
