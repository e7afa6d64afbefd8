"""Load a ``pkg.module:factory`` (or ``path/to/file.py:factory``) reference for the CLI.

Every failure is a ``ValueError``/``TypeError`` whose message names the reference and says what
to do, so the CLI can print it as a one-line error. An exception raised by the user's own code
(their module while it is imported, their factory when called through :func:`marked`) is a
:class:`UserCodeError` carrying that exception, so the CLI can show the user's traceback as theirs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load_factory", "marked", "UserCodeError", "user_traceback", "raised_in_module_of"]

_FORM = "expected 'pkg.module:factory' or 'path/to/file.py:factory'"


class UserCodeError(ValueError):
    """The user's own code raised; ``original`` is their exception (with its traceback)."""

    def __init__(self, message: str, original: BaseException) -> None:
        super().__init__(message)
        self.original = original


def marked(factory: Callable[[], Any], ref: str) -> Callable[[], Any]:
    """``factory`` whose exceptions become :class:`UserCodeError` (shown as the user's own)."""

    def call() -> Any:
        try:
            return factory()
        except Exception as exc:  # noqa: BLE001 - whatever the user's code raises is theirs
            raise UserCodeError(
                f"the factory {ref!r} raised {type(exc).__name__}: {exc}", exc
            ) from exc

    return call


def raised_in_module_of(exc: BaseException, factory: Callable[[], Any]) -> bool:
    """Whether ``exc`` passed through the file that defines ``factory`` (the user's model or
    loss raised while ampguard ran it)."""
    module = sys.modules.get(getattr(factory, "__module__", "") or "")
    source = getattr(module, "__file__", None)
    if not source:
        return False
    source = os.path.abspath(source)
    return any(
        os.path.abspath(f.filename) == source for f in traceback.extract_tb(exc.__traceback__)
    )


def user_traceback(err: UserCodeError) -> str:
    """The traceback of the user's exception without ampguard's and importlib's frames."""
    exc = err.original
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith((here, "<frozen importlib"))
    ]
    lines = [
        "Traceback (most recent call last):\n",
        *traceback.format_list(frames),
        *traceback.format_exception_only(type(exc), exc),
    ]
    return "".join(lines)


def load_factory(ref: str) -> Callable[[], Any]:
    """The callable named by ``ref`` (``module:attr``, ``attr`` may be dotted).

    The current directory is importable (as with ``python -m``), so ``ampguard compare
    mymodel:make`` works from the folder that holds ``mymodel.py``.
    """
    if not isinstance(ref, str):
        raise TypeError(f"factory reference must be a string ({_FORM}), got {type(ref).__name__}")
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise ValueError(f"invalid factory reference {ref!r}: {_FORM}")
    module = _import(module_ref)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )[:12]
            raise ValueError(
                f"{module_ref!r} has no attribute {attr!r}; callables there: "
                f"{', '.join(names) or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{ref!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def _import(module_ref: str) -> ModuleType:
    if module_ref.endswith(".py") or os.sep in module_ref or "/" in module_ref:
        return _import_file(Path(module_ref))
    if module_ref.startswith(".") or ".." in module_ref:
        raise ValueError(f"invalid module {module_ref!r} in the factory reference: {_FORM}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_ref)
    except ModuleNotFoundError as exc:
        if exc.name and (module_ref == exc.name or module_ref.startswith(exc.name + ".")):
            raise ValueError(
                f"cannot import module {module_ref!r} ({exc}); run from the folder that holds it, "
                "add it to PYTHONPATH, or pass a file path (path/to/file.py:factory)"
            ) from exc
        raise ValueError(f"importing {module_ref!r} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the module's own code raised
        raise UserCodeError(
            f"importing {module_ref!r} raised {type(exc).__name__}: {exc}", exc
        ) from exc


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r} (from the factory reference)")
    name = f"_ampguard_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(path.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)  # so the file can import its neighbours, as a script would
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the file's own code raised
        del sys.modules[name]
        raise UserCodeError(
            f"importing {str(path)!r} raised {type(exc).__name__}: {exc}", exc
        ) from exc
    return module
