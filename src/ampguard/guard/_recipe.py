"""``Guard(precision=<a {layer: format} dict or an ampguard.RecipeCertificate>)``: the Guard side
of a per-layer recipe.

:func:`split` turns such a ``precision=`` into the registry entry ``"recipe"`` and the recipe
itself, which the Guard hands its conversion hook (:class:`ampguard.fp8._layered.LayerRecipe`)
as the plan; every other ``precision=`` passes through unchanged. Nothing touches a device.
"""

from __future__ import annotations

from typing import Any

from ampguard.fp8 import RECIPE_FORMAT

__all__ = ["split", "after_step"]


def split(precision: Any, fp8_plan: Any) -> tuple[Any, Any]:
    """``(precision name, plan)`` for the Guard: ``("recipe", {layer: format})`` for a recipe
    dict or a certificate (anything with a ``.recipe`` dict), else the arguments as given.
    ``ValueError`` when ``fp8_plan`` is given with a recipe (the recipe already says it)."""
    recipe = precision if isinstance(precision, dict) else getattr(precision, "recipe", None)
    if not isinstance(recipe, dict):
        return precision, fp8_plan
    if fp8_plan is not None:
        raise ValueError(
            "fp8_plan is not used with a per-layer precision: the recipe names every layer's "
            "format (make the recipe from the plan: precision=plan.recipe())"
        )
    if isinstance(precision, dict):
        return RECIPE_FORMAT, dict(recipe)
    return RECIPE_FORMAT, precision  # a certificate: its recipe and its recheck_every


def after_step(conversion: Any, steps: int, batch: Any, loss_fn: Any) -> None:
    """``Guard.step(batch=..., loss_fn=...)`` under a per-layer precision: every
    ``recheck_every`` steps, the meter on ``batch`` and a drifting layer one format up
    (:meth:`ampguard.fp8._layered.LayerRecipe.due`). Cost: nothing between re-checks; a
    re-check is two forward+backward passes of ``batch`` and one host sync."""
    due = getattr(conversion, "due", None)
    if due is not None and loss_fn is not None and due(steps):
        conversion.recheck_step(loss_fn, batch, steps)
