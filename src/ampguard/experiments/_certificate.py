""":class:`RecipeCertificate`: what :func:`ampguard.recipe_search` found and the evidence for it.

A certificate holds the per-layer recipe (``{layer: format}``, ``"bf16"`` for a layer kept high),
whether it passed (its branch ended within ``tolerance`` of bf16 at the same steps), the loss
gap (``loss_delta``), bf16's own run-to-run spread at those steps (``noise``), the share of matmul
FLOPs in each format (``flop_share``), the branch length (``steps``) and ``seeds``, plus the
search's history (``branches``), the gradient-fidelity meter of the final recipe (``meter``:
per layer ``cosine`` and ``rel_error`` of its weight gradient against bf16's) and
``recheck_every`` (K: ``Guard(precision=certificate)`` re-reads the meter every K steps and moves
a drifting layer one format up; None: never).

``to_dict()`` is JSON-ready; :meth:`RecipeCertificate.save` writes it atomically (temporary file,
fsync, rename) and :meth:`RecipeCertificate.load` reads one back, refusing a file that is not a
certificate with one ``ValueError`` naming the field. ``Guard(precision=certificate)`` trains the
recipe (``ampguard.guard._recipe``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ampguard._util.atomic import write_text

__all__ = ["RecipeCertificate", "SCHEMA"]

SCHEMA = "ampguard.recipe_certificate/1"


@dataclass
class RecipeCertificate:
    """A searched per-layer recipe and its verdict against bf16 (see the module docstring)."""

    recipe: dict[str, str]
    passed: bool
    loss_delta: float
    noise: float
    tolerance: float
    flop_share: dict[str, float]
    steps: int
    seeds: tuple[int, ...]
    formats: tuple[str, ...] = ()
    branches: list[dict[str, Any]] = field(default_factory=list)
    meter: dict[str, dict[str, Any]] = field(default_factory=dict)
    recheck_every: int | None = 100  # Guard(precision=certificate): the meter every K steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite numbers as None), with ``"schema"``."""
        out = asdict(self)
        out["seeds"] = list(self.seeds)
        out["formats"] = list(self.formats)
        return {"schema": SCHEMA, **_finite(out)}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON at ``path``, atomically. Cost: one fsync."""
        write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, data: Any) -> RecipeCertificate:
        """A certificate from :meth:`to_dict`'s output; ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"not a recipe certificate: 'schema' must be {SCHEMA!r}")
        recipe = data.get("recipe")
        if not isinstance(recipe, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in recipe.items()
        ):
            raise ValueError("malformed recipe certificate: 'recipe' must be {layer: format}")
        try:
            return cls(
                recipe=dict(recipe),
                passed=bool(data["passed"]),
                loss_delta=_num(data["loss_delta"]),
                noise=_num(data["noise"]),
                tolerance=_num(data["tolerance"]),
                flop_share={str(k): float(v) for k, v in data["flop_share"].items()},
                steps=int(data["steps"]),
                seeds=tuple(int(s) for s in data["seeds"]),
                formats=tuple(str(f) for f in data.get("formats", ())),
                branches=list(data.get("branches", [])),
                meter=dict(data.get("meter", {})),
                recheck_every=_every(data.get("recheck_every", 100)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed recipe certificate: {e!r}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RecipeCertificate:
        """Read a certificate written by :meth:`save`; ``ValueError`` for anything else."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not JSON: {e}") from None
        return cls.from_dict(data)

    def summary(self) -> str:
        """One paragraph: the verdict, the gap against bf16's noise, the FLOP shares."""
        shares = ", ".join(f"{f} {s:.0%}" for f, s in sorted(self.flop_share.items()))
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"recipe {verdict}: loss {self.loss_delta:+.4g} vs bf16 after {self.steps} steps "
            f"(tolerance {self.tolerance:.3g}, bf16 noise {self.noise:.3g}, seeds "
            f"{list(self.seeds)}); matmul FLOPs: {shares}; {len(self.branches)} branches"
        )


def _every(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"'recheck_every' must be a positive int or null, got {v!r}")
    return v


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


RecipeCertificate.__module__ = (
    "ampguard.experiments"  # its public home: repr and pickles name that path
)
