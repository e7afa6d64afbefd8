"""The Guard's per-layer precision: ``Guard(precision={layer: format})`` (or a certificate's
recipe) trains each named Linear layer in its own format, by emulation, bf16 around them.

:class:`LayerRecipe` is the conversion hook (an :class:`ampguard.fp8._conversion.Conversion`)
of the registry entry ``recipe``; the Guard hands it the recipe as its ``plan`` argument
(``ampguard.guard._recipe`` turns ``precision=<dict or certificate>`` into that). A recipe maps
Linear layers (their ``named_modules`` names) to a format of :data:`ampguard.fp8._formats.FORMATS`
(``"tensorwise"``, ``"rowwise"``, ``"mxfp8"``, ``"nvfp4"``, ``"fp8_blockwise"``) or ``"bf16"``;
a Linear the recipe does not name stays in bf16. Every converted layer's matmuls run as
:mod:`ampguard.fp8._emulate` runs them (the format's casts of every operand, float32 math): the
numerics of each format, not its speed.

Bad input, each one ``ValueError`` naming it before anything is converted: a recipe that is not
a dict of strings, a layer that is not a Linear of the model, an unknown format, a format the
layer's shape cannot take. Checkpoints: the Guard state (``"fp8"``, version 2) is ``{"format":
"recipe", "version": 2, "recipe": {layer: format}, "strikes": {layer: n}, "moves": [...]}``: the
converted layers' formats, the re-check's pending drift counts and its moves so far; a resumed
Guard converts exactly those, in those formats (a warning when this Guard had a different
recipe), and moves a pending layer at the step an uninterrupted run would (a version-1 state,
formats only, loads with no pending drift). No telemetry of its own and
no per-step rescue (:meth:`LayerRecipe.watch` does nothing); :meth:`LayerRecipe.recheck` reads
the gradient-fidelity meter on shadow micro-batches and moves a drifting layer one format up. The
Guard calls it every ``recheck_every`` windows (a certificate's field; 100 for a dict) on the
batch given to ``Guard.step(batch=..., loss_fn=...)`` (no re-check without them), the RNG and
buffers put back (:meth:`LayerRecipe.recheck_step`); each move is an AG114 finding and in the
saved state, so a resumed Guard trains the moved formats. A moved layer stays up (no demotion:
a move down would need a reading of the lower format too, and a layer at a limit would flip
between formats on noise; search again to bring it down).
Cost: none at construction.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampguard._util.stack import user_stacklevel
from ampguard.fp8._emulate import EmulatedLinear, restore
from ampguard.fp8._fidelity import converted as emulate_recipe
from ampguard.fp8._fidelity import failing, gradient_fidelity
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._recipe import HIGH

if TYPE_CHECKING:
    from ampguard.findings import Finding
    from ampguard.fp8._conversion import Conversion
    from ampguard.fp8._stats import Fp8Log, WindowClock

__all__ = ["LayerRecipe", "check_recipe", "RECIPE_FORMAT"]

RECIPE_FORMAT = "recipe"  # the registry entry's name and the saved state's "format"


def check_recipe(recipe: Any, model: nn.Module, *, argument: str = "precision") -> dict[str, str]:
    """``recipe`` as ``{layer: format}`` after checking it against ``model``: ``TypeError`` /
    ``ValueError`` naming ``argument`` and the first bad layer or format. Nothing changes."""
    if not isinstance(recipe, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in recipe.items()
    ):
        raise TypeError(
            f"{argument} must be a precision name, a {{layer: format}} dict of strings or an "
            f"ampguard.RecipeCertificate, got {type(recipe).__name__}"
        )
    if not recipe:
        raise ValueError(f"{argument}: the recipe names no layer")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    allowed = (*FORMATS, HIGH)
    for name, fmt in recipe.items():
        if name not in linears:
            near = sorted(linears)[:5]
            raise ValueError(
                f"{argument}: the recipe names {name!r}, which is not a Linear layer of this "
                f"model (its Linear layers: {near}{'...' if len(linears) > 5 else ''})"
            )
        if fmt not in allowed:
            raise ValueError(
                f"{argument}: layer {name!r} has unknown format {fmt!r}; allowed: {allowed}"
            )
        m = linears[name]
        if fmt != HIGH and not FORMATS[fmt].shape_ok(m.in_features, m.out_features):
            raise ValueError(
                f"{argument}: layer {name!r} ({m.in_features}x{m.out_features}) cannot train in "
                f"{fmt!r}: it needs in and out features that are multiples of "
                f"{FORMATS[fmt].multiple}"
            )
    return dict(recipe)


class LayerRecipe:
    """A Guard's Linear layers, each in the format its recipe names (emulated)."""

    emulated = True
    rescue: _Moves | None = None
    format = RECIPE_FORMAT

    def __init__(self, model: nn.Module, device: torch.device, plan: Any = None) -> None:
        if plan is None:
            raise ValueError(
                "precision='recipe' needs the recipe itself: Guard(..., precision={layer: "
                "format}) or precision=<an ampguard.RecipeCertificate>"
            )
        self.model = model
        self.device = device
        self.every = _every(plan)
        self.recipe = check_recipe(getattr(plan, "recipe", plan), model)
        self._all = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        self._chosen = {n: f for n, f in self.recipe.items() if f != HIGH}
        self.layers: list[str] = []
        self.kept: list[str] = list(self._all)
        self._strikes: dict[str, int] = {}  # re-checks in a row that flagged each layer

    @property
    def chosen(self) -> bool:
        """True when at least one layer trains in a low-precision format."""
        return bool(self._chosen)

    def convert(self) -> None:
        """Each chosen layer emulated in its format; all or nothing."""
        converted = emulate_recipe(self.model, self._chosen)
        self.layers = [n for n in self._all if n in set(converted)]
        self.kept = [n for n in self._all if n not in set(converted)]

    def revert(self) -> None:
        """Every converted layer a plain ``nn.Linear`` again. Cost: no device op."""
        for name in self.layers:
            module = self.model.get_submodule(name)
            if isinstance(module, EmulatedLinear):
                restore(module)
        self.layers = []
        self.kept = list(self._all)

    def formats(self) -> dict[str, str]:
        """``{layer: format}`` of the converted layers now."""
        return {n: str(self.model.get_submodule(n).__dict__["lowp_format"]) for n in self.layers}

    def recheck(
        self, loss_fn: Any, batches: Any, *, step: int | None = None, strikes: int = 1
    ) -> list[dict[str, Any]]:
        """Read the gradient-fidelity meter (:mod:`ampguard.fp8._fidelity`) on ``batches`` (a
        list of shadow micro-batches, ``loss_fn(model, batch)``) with the current weights, and
        move every converted layer outside its limits one format up (the lowest-bits format
        above its own that its shape takes, block-scaled first; else bf16). Returns the moves
        (``module``, ``step``, ``from``, ``to``, ``reason``), also listed in :attr:`rescue` and
        so in the Guard's fallbacks; ``strikes``: the re-checks in a row a layer must fail
        (counted across calls) before it moves. Call it every K steps, between steps. Cost: two
        forward+backward passes per micro-batch and one host sync.
        """
        current = self.formats()
        for name in self.layers:  # the meter converts by itself: start from plain Linear
            restore(self.model.get_submodule(name))
        try:
            meter = gradient_fidelity(self.model, loss_fn, list(batches), current)
        finally:
            emulate_recipe(self.model, current)
        flagged = set(failing(meter))
        self._strikes = {n: self._strikes.get(n, 0) + 1 for n in flagged}
        moves: list[dict[str, Any]] = []
        for name in [n for n in meter if self._strikes.get(n, 0) >= strikes]:
            self._strikes.pop(name)
            module = self.model.get_submodule(name)
            assert isinstance(module, nn.Linear)
            up = _higher(current[name], module.in_features, module.out_features)
            m = meter[name]
            moves.append({"module": name, "step": step, "from": current[name], "to": up,
                          "reason": f"gradient cosine {m['cosine']:.3f}, relative error "
                                    f"{m['rel_error']:.3f} against bf16"})  # fmt: skip
        if moves:
            self.revert()
            for mv in moves:
                current[mv["module"]] = mv["to"]
            self._chosen = {n: f for n, f in current.items() if f != HIGH}
            self.convert()
            if self.rescue is None:
                self.rescue = _Moves()
            self.rescue.changes.extend(moves)
        return moves

    def due(self, steps: int) -> bool:
        """True when window ``steps`` ends a re-check interval (``recheck_every``)."""
        return self.every is not None and steps > 0 and steps % self.every == 0

    def recheck_step(self, loss_fn: Any, batch: Any, steps: int) -> list[dict[str, Any]]:
        """The Guard's re-check on the step's ``batch``: a layer moves one format up when the
        meter flags it on ``RECHECK_AFTER`` re-checks in a row (one batch's figures swing
        across the limits; a verdict on one would flip on noise). Training is left as it was:
        the RNG state (dropout) and the buffers (BatchNorm statistics) of the meter's passes
        are put back. Cost: as :meth:`recheck`, plus one copy of the buffers."""
        buffers = [b.detach().clone() for b in self.model.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            moves = self.recheck(loss_fn, [batch], step=steps, strikes=RECHECK_AFTER)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), buffers, strict=True):
                b.copy_(saved)
        return moves

    def watch(self, telemetry: Fp8Log | None, clock: WindowClock, *, rescue: bool = False) -> None:
        """Nothing: no per-layer telemetry or rescue of its own."""

    def state(self) -> dict[str, Any]:
        """Guard state ``"fp8"`` (version :data:`STATE_VERSION`): ``{"format": "recipe",
        "version": 2, "recipe": {layer: format}, "strikes": {layer: n}, "moves": [...]}``: the
        converted layers' formats, the re-checks in a row that flagged each layer not moved yet
        (a pending drift) and the moves so far (AG114), so a resumed Guard moves a layer at the
        step an uninterrupted run would. Cost: no device op."""
        moves = self.rescue.changes if self.rescue is not None else []
        return {"format": RECIPE_FORMAT, "version": STATE_VERSION, "recipe": self.formats(),
                "strikes": dict(self._strikes), "moves": [dict(m) for m in moves]}  # fmt: skip

    def check_state(self, value: Any) -> list[dict[str, Any]]:
        """Validate a saved state (``ValueError`` naming the field, nothing changed);
        ``[{"module": name, "format": fmt, "strikes": n, "moves": [...]}, ...]`` to load, a
        layer the re-check moved to bf16 included (``"bf16"``). A version-1 state (formats
        only) loads with no pending drift and no moves."""
        if value is None:
            return []
        recipe = value.get("recipe") if isinstance(value, dict) else None
        if not isinstance(value, dict) or value.get("format") != RECIPE_FORMAT:
            raise ValueError(
                f"malformed Guard state: 'fp8' must be {{'format': 'recipe', 'recipe': "
                f"{{layer: format}}}} under a per-layer precision, got {value!r:.80}"
            )
        version = value.get("version", 1)
        if version not in (1, STATE_VERSION) or isinstance(version, bool):
            raise ValueError(
                f"malformed Guard state: 'fp8' is a per-layer recipe state of version "
                f"{version!r}; this ampguard reads versions 1 and {STATE_VERSION}"
            )
        v2 = version == STATE_VERSION
        moves = _check_moves(value.get("moves"), self._all) if v2 else []
        full = dict(recipe) if isinstance(recipe, dict) else recipe
        if isinstance(full, dict):
            for m in moves:
                if m["module"] not in full:
                    full[m["module"]] = HIGH  # moved up to bf16: no longer converted
        try:
            checked = check_recipe(full, self.model, argument="Guard state 'fp8.recipe'")
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed Guard state: {e}") from None
        strikes = _check_strikes(value.get("strikes"), checked) if v2 else {}
        return [{"module": n, "format": f, "strikes": strikes.get(n, 0),
                 "moves": [m for m in moves if m["module"] == n]}
                for n, f in checked.items()]  # fmt: skip

    def load(self, changes: list[dict[str, Any]], telemetry: Fp8Log | None) -> None:
        """Convert exactly the saved layers in their saved formats (warns when they differ from
        this Guard's), and take the saved drift counts and moves. Cost: no device op."""
        self._strikes = {c["module"]: c["strikes"] for c in changes if c.get("strikes")}
        moves = [m for c in changes for m in c.get("moves", ())]
        moves.sort(key=lambda m: (-1 if m["step"] is None else m["step"],
                                  self._all.index(m["module"])))  # fmt: skip
        self.rescue = None
        if moves:
            self.rescue = _Moves()
            self.rescue.changes.extend(dict(m) for m in moves)
        wanted = {c["module"]: c["format"] for c in changes if c["format"] != HIGH}
        if wanted == self.formats():
            return
        warnings.warn(
            f"precision=<recipe>: the Guard state trained {wanted}, this Guard's recipe is "
            f"{self.formats()}; resuming with the saved formats",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        self.revert()
        self._chosen = dict(wanted)
        self.convert()

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the per-layer formats, emulated, converted and kept layers."""
        return {
            "format": RECIPE_FORMAT,
            "emulated": True,
            "recipe": self.formats(),
            "converted": list(self.layers),
            "kept_bf16": list(self.kept),
        }

    def findings(self) -> list[Finding]:
        """One AG114 per layer the re-check moved up."""
        from ampguard.findings import make

        changes = self.rescue.changes if self.rescue is not None else []
        return [
            make(
                "AG114",
                f"{c['module']}: moved from {c['from']} to {c['to']} at step {c['step']}: "
                f"{c['reason']}",
                step=c["step"],
                evidence=dict(c),
                fix=f"start {c['module']!r} in {c['to']!r}: search again with "
                "ag.recipe_search on batches from this point of training",
            )
            for c in changes
        ]


DEFAULT_RECHECK_EVERY = 100  # a {layer: format} dict's K (a certificate says its own)
RECHECK_AFTER = 2  # the Guard moves a layer the meter flags on this many re-checks in a row


def _every(plan: Any) -> int | None:
    """The re-check interval: the certificate's ``recheck_every``, a dict's default."""
    every = getattr(plan, "recheck_every", DEFAULT_RECHECK_EVERY)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"precision: recheck_every must be a positive int or None, got {every!r}")
    return every


STATE_VERSION = 2  # of the Guard state "fp8" (1: the formats only; 2: + strikes and moves)
_MOVE_KEYS = {"module", "step", "from", "to", "reason"}


def _check_strikes(value: Any, recipe: dict[str, str]) -> dict[str, int]:
    """A saved ``strikes`` map: ``{converted layer: positive int}`` (``ValueError`` naming it)."""
    if not isinstance(value, dict):
        raise ValueError(
            f"malformed Guard state: 'fp8.strikes' must be a {{layer: count}} dict, got "
            f"{value!r:.80}"
        )
    for name, n in value.items():
        if recipe.get(name, HIGH) == HIGH:
            raise ValueError(
                f"malformed Guard state: 'fp8.strikes' names {name!r}, which the saved recipe "
                "does not train in a low-precision format"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"malformed Guard state: 'fp8.strikes' of {name!r} must be a positive int, "
                f"got {n!r}"
            )
    return dict(value)


def _check_moves(value: Any, linears: list[str]) -> list[dict[str, Any]]:
    """A saved ``moves`` list (``ValueError`` naming the first bad entry)."""
    allowed = (*FORMATS, HIGH)
    if not isinstance(value, list):
        raise ValueError(f"malformed Guard state: 'fp8.moves' must be a list, got {value!r:.80}")
    for m in value:
        ok = isinstance(m, dict) and set(m) == _MOVE_KEYS
        if ok and m["module"] not in linears:
            raise ValueError(
                f"malformed Guard state: 'fp8.moves' names {m['module']!r}, which is not a "
                "Linear layer of this model"
            )
        step = m.get("step") if ok else None
        if not (
            ok
            and (step is None or (isinstance(step, int) and not isinstance(step, bool)))
            and m["from"] in allowed
            and m["to"] in allowed
            and isinstance(m["reason"], str)
        ):
            raise ValueError(
                f"malformed Guard state: an entry of 'fp8.moves' must be {{'module', 'step', "
                f"'from', 'to', 'reason'}}, got {m!r:.80}"
            )
    return [dict(m) for m in value]


class _Moves:
    """The layers :meth:`LayerRecipe.recheck` moved up (the Guard lists them as fallbacks)."""

    def __init__(self) -> None:
        self.changes: list[dict[str, Any]] = []


def _higher(fmt: str, fin: int, fout: int) -> str:
    """The next format up from ``fmt`` that a ``fin x fout`` layer takes (bf16 when none)."""
    bits = FORMATS[fmt].bits
    order = list(FORMATS)
    up = [f for f, spec in FORMATS.items() if spec.bits > bits and spec.shape_ok(fin, fout)]
    up.sort(key=lambda f: (FORMATS[f].bits, FORMATS[f].block <= 0, order.index(f)))
    return up[0] if up else HIGH


if TYPE_CHECKING:

    def _is_conversion(hook: LayerRecipe) -> Conversion:
        return hook
