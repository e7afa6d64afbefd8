"""What the Guard asks of a precision's conversion: the :class:`Conversion` protocol.

A registry entry with a conversion hook (:attr:`ampguard.precisions.Precision.hook`) names a
class the Guard builds as ``hook(model, device, plan)`` (``plan``: the Guard's ``fp8_plan=``).
The object it gets back is a :class:`Conversion`; the Guard and its helpers use nothing else
of it (``ampguard.guard._fp8`` builds it, ``_guard`` converts and reverts it and reads its
findings and fallbacks, ``_state`` saves and resumes it, ``guard.fp8`` hands it to the user).

Two implementations: :class:`ampguard.fp8._convert.Fp8State` (torchao float8, with telemetry
and rescues) and :class:`ampguard.fp8._block.BlockScaled` (MXFP8 / NVFP4 by emulation).

The life of a conversion, in the Guard:

1. built (the constructor): checks the plan and chooses the layers without touching the model;
   :attr:`~Conversion.chosen` False means nothing would compute in the format, and the Guard
   trains in bf16 with a warning;
2. :meth:`~Conversion.convert` changes the chosen layers (all or nothing), then
   :meth:`~Conversion.watch` attaches what samples them while training (may do nothing); a
   later failure of the constructor calls :meth:`~Conversion.revert`;
3. ``Guard.state_dict`` saves :meth:`~Conversion.state` under ``"fp8"``;
   ``Guard.load_state_dict`` checks a saved one with :meth:`~Conversion.check_state` (raise
   ``ValueError``, change nothing) and, when that returned changes, redoes them with
   :meth:`~Conversion.load`;
4. ``Guard.findings`` adds :meth:`~Conversion.findings`; the Guard's fallbacks list the
   ``changes`` of :attr:`~Conversion.rescue`.

Every member is read-only here (properties), so an implementation may keep them as plain
attributes of narrower types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ampguard.findings import Finding
    from ampguard.fp8._stats import Fp8Log, WindowClock

__all__ = ["Conversion", "Rescues"]


class Rescues(Protocol):
    """Layers a conversion moved back to bf16 while training: one dict per move (``module``,
    ``step``, ``from``, ``to``, ``reason``), in the Guard's fallbacks."""

    @property
    def changes(self) -> list[dict[str, Any]]: ...


class Conversion(Protocol):
    """A precision's conversion of the model, as the Guard uses it (see the module docstring)."""

    @property
    def chosen(self) -> bool:
        """True when at least one layer will be converted (else the Guard trains in bf16)."""
        ...

    @property
    def layers(self) -> list[str]:
        """The converted layers now (empty before :meth:`convert`)."""
        ...

    @property
    def kept(self) -> list[str]:
        """The Linear layers left in bf16."""
        ...

    @property
    def emulated(self) -> bool:
        """True where the format's matmul is emulated (real casts, high-precision math)."""
        ...

    @property
    def rescue(self) -> Rescues | None:
        """The moves back to bf16 made while training (None: none can happen or none did)."""
        ...

    def convert(self) -> None:
        """Convert the chosen layers; all or nothing (on failure the model is as it was)."""

    def revert(self) -> None:
        """Undo :meth:`convert` exactly (parameters and optimizer state untouched)."""

    def watch(self, telemetry: Fp8Log | None, clock: WindowClock, *, rescue: bool = False) -> None:
        """Sample the converted layers while training (``rescue``: may move one back to bf16);
        a conversion without telemetry of its own does nothing."""

    def state(self) -> dict[str, Any] | None:
        """What a resumed Guard needs (saved as Guard state ``"fp8"``), or None."""

    def check_state(self, value: Any) -> list[dict[str, Any]]:
        """Validate a saved :meth:`state` (``ValueError``, nothing changed); the changes to
        redo (an empty list: nothing to do)."""
        ...

    def load(self, changes: list[dict[str, Any]], telemetry: Fp8Log | None) -> None:
        """Redo checked changes (:meth:`check_state`) on this Guard's model."""

    def summary(self) -> dict[str, Any]:
        """JSON-ready: what is converted, what is kept, and why."""
        ...

    def findings(self) -> list[Finding]:
        """Findings of the conversion so far (may be empty)."""
        ...


if TYPE_CHECKING:  # mypy proves that fp8's hook is a Conversion (BlockScaled: in its module)
    from ampguard.fp8._convert import Fp8State

    def _is_conversion(hook: Fp8State) -> Conversion:
        return hook
