"""Weights the optimizer does not own: an EMA or teacher model, and how much of its update is lost.

An EMA kept in bf16 moves by ``(1 - decay) * (source - ema)`` per update: at ``decay=0.999``
that is a thousandth of the gap, below half an ulp for almost every element, so the stored EMA
stops following the model (the optimizer's own probe, AG175, never sees it: the optimizer does
not step it). :class:`EmaWatch` measures it, and can carry the lost part:

- ``watch.update(decay)`` runs the EMA update itself (``ema += (1 - decay) * (source - ema)``
  in fp32) and writes it back by Kahan compensation or stochastic rounding when a rescue is on
  (:meth:`EmaWatch.rescue`); measured exactly on sampled calls;
- ``with watch.measure(): ...`` around the user's own update (``lerp_``, ``AveragedModel.
  update_parameters``): the EMA is copied on entry and compared on exit;
- under ``Guard(ema=...)`` with the EMA updated anywhere (a loop line, ``on_applied``, a hook),
  the Guard copies it after a sampled window's step and compares at the next window: at least
  ``every`` windows apart, one update assumed in between (``every=`` the windows between two
  EMA updates).

An element counts as "intended to move" where the EMA differs from its source when the update
starts, and as "lost" where its stored value (plus its Kahan buffer) did not change. AG175 names
the EMA layers with at least half their intended updates lost (:meth:`EmaWatch.findings`).
Cost: nothing on calls that are not sampled (the first, then every ``SAMPLE_EVERY``); a copy and
about four elementwise ops per EMA tensor on a sampled one; no host sync until ``findings``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ampguard.core.rounding import (
    COMP_DTYPE,
    kahan_buffer,
    kahan_read,
    kahan_write,
    stochastic_round,
)
from ampguard.core.stagnation import (
    LOW_PRECISION,
    SAMPLE_EVERY,
    STAGNATION_SHARE,
    LayerShare,
    layer_evidence,
)
from ampguard.findings import Finding, make

__all__ = ["EmaWatch", "watch_ema", "as_watches"]

_METHODS = (None, "auto", "kahan", "stochastic")


def _params(obj: Any, argument: str) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):
        named = list(obj.named_parameters())
        return [n.removeprefix("module.").rpartition(".")[0] for n, _ in named], [
            p for _, p in named
        ]
    raise TypeError(f"{argument} must be a torch.nn.Module, got {type(obj).__name__}")


class EmaWatch:
    """The stagnation of ``ema``'s weights (an EMA or teacher of ``source``), and its rescue.

    ``ema`` and ``source``: modules with the same parameters in the same order and shapes
    (``torch.optim.swa_utils.AveragedModel`` works: its ``module.`` prefix is dropped).
    ``every``: optimizer windows between two EMA updates (for the Guard's measurement).
    ``rescue``: None, ``"auto"`` (Kahan once a sample shows the stagnation), ``"kahan"`` or
    ``"stochastic"`` for :meth:`update`. Raises ``TypeError``/``ValueError`` naming the argument.
    """

    def __init__(
        self,
        ema: torch.nn.Module,
        source: torch.nn.Module,
        *,
        every: int = 1,
        rescue: str | None = None,
    ) -> None:
        names, ema_params = _params(ema, "ema")
        _, src_params = _params(source, "source")
        shapes = [tuple(p.shape) for p in ema_params]
        if shapes != [tuple(p.shape) for p in src_params]:
            raise ValueError(
                "source must have the ema's parameters in the same order and shapes "
                f"({len(ema_params)} in ema, {len(src_params)} in source)"
            )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if rescue not in _METHODS:
            raise ValueError(
                f"rescue must be None, 'auto', 'kahan' or 'stochastic', got {rescue!r}"
            )
        low = [i for i, p in enumerate(ema_params) if p.dtype in LOW_PRECISION]
        self.params = [ema_params[i] for i in low]
        self.sources = [src_params[i] for i in low]
        self.layers = ["ema." + names[i] if names[i] else "ema" for i in low]
        self.every = every
        self.mode = rescue
        self.method: str | None = rescue if rescue in ("kahan", "stochastic") else None
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.comp: list[torch.Tensor] = []
        if self.method == "kahan":
            self.comp = [kahan_buffer(p) for p in self.params]
        self.generator = torch.Generator(device=dev).manual_seed(0xE3A)
        self._counts = torch.zeros(len(self.params), 2, dtype=torch.int64, device=dev)
        self._snap: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.updates = 0  # update() calls
        self.samples = 0
        self.before: float | None = None  # the lost share when "auto" switched the rescue on

    # ------------------------------------------------------------------ the EMA update
    def update(self, decay: float) -> None:
        """``ema = decay * ema + (1 - decay) * source`` in fp32, written back through the rescue
        (nearest rounding without one); fp32 EMA tensors are updated as they are. Cost: a few
        elementwise ops per tensor; a sampled call adds the measurement (no host sync)."""
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        if not self.updates:
            self._snap = None  # the Guard's between-window copy: this call measures exactly
        self.updates += 1
        sampled = self._due(self.updates) and self._snap is None
        if sampled:
            self._take()
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(self.params, self.sources, strict=True)):
                value = kahan_read(p, self.comp[i]) if self.comp else p.float()
                value.lerp_(s.float(), 1.0 - float(decay))
                if self.method == "kahan":
                    kahan_write(value, p, self.comp[i])
                elif self.method == "stochastic":
                    p.copy_(stochastic_round(value, p.dtype, self.generator))
                else:
                    p.copy_(value)
        if sampled:
            self._count()
            if self.mode == "auto" and self.method is None:
                self._auto()

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Measure the user's own EMA update inside the block (copied on entry, compared on
        exit) on sampled calls. Cost: see the module docstring."""
        if not self.updates:
            self._snap = None  # the Guard's between-window copy: this call measures exactly
        self.updates += 1
        sampled = self._due(self.updates) and self._snap is None
        if sampled:
            self._take()
        yield
        if sampled:
            self._count()

    def probe(self, decay: float) -> list[LayerShare]:
        """Per EMA layer: the updates one :meth:`update` at ``decay`` would lose, measured on
        copies (the EMA, its Kahan buffers, generator and counts are left as they are). An
        element is intended to move where the EMA differs from its source. Cost: a copy and a
        few elementwise ops per EMA tensor; one host sync."""
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        gen = torch.Generator(device=self.generator.device)
        gen.set_state(self.generator.get_state())
        rows: dict[str, list] = {}
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(self.params, self.sources, strict=True)):
                stored = p.detach().clone()
                comp = self.comp[i].clone() if self.comp else None
                before = kahan_read(stored, comp) if comp is not None else stored.float()
                value = before.clone().lerp_(s.float(), 1.0 - float(decay))
                if self.method == "kahan" and comp is not None:
                    kahan_write(value, stored, comp)
                elif self.method == "stochastic":
                    stored.copy_(stochastic_round(value, stored.dtype, gen))
                else:
                    stored.copy_(value)
                after = kahan_read(stored, comp) if comp is not None else stored.float()
                moving = p.detach() != s.detach().to(p.dtype)
                lost = int((moving & (after == before)).sum())
                row = rows.setdefault(self.layers[i], [str(p.dtype).replace("torch.", ""), 0, 0])
                row[1] += lost
                row[2] += int(moving.sum())
        return [LayerShare(n, d, lost, mov) for n, (d, lost, mov) in rows.items()]

    def on_window(self, window: int, skipped: bool | torch.Tensor) -> None:
        """The Guard's measurement between windows, for an EMA updated outside :meth:`update`:
        count the pending copy, then copy again on a sampled, applied window. No host sync."""
        if self.updates:  # update()/measure() measure exactly: nothing to do here
            return
        if self._snap is not None and window % self.every == 0:
            self._count()
        if self._snap is None and skipped is not True and self._due(window):
            self._take()

    def _due(self, n: int) -> bool:
        return n == 1 or n % SAMPLE_EVERY == 0

    def _value(self, i: int) -> torch.Tensor:
        return kahan_read(self.params[i], self.comp[i]) if self.comp else self.params[i].detach()

    def _take(self) -> None:
        with torch.no_grad():
            values = [self._value(i).clone() for i in range(len(self.params))]
            moving = [
                v != s.detach().to(v.dtype) for v, s in zip(values, self.sources, strict=True)
            ]
        self._snap = (values, moving)

    def _count(self) -> None:
        assert self._snap is not None
        values, moving = self._snap
        self._snap = None
        rows = []
        with torch.no_grad():
            for i, (v, m) in enumerate(zip(values, moving, strict=True)):
                lost = m & (self._value(i) == v)
                rows.append(torch.stack((lost.sum(), m.sum())))
        if rows:
            self._counts += torch.stack(rows)
        self.samples += 1

    def _auto(self) -> None:
        """Switch Kahan on once the lost share reaches half (one host sync, once)."""
        from ampguard.core.rescue import RESCUE_SHARE

        share = self.share()
        if share >= RESCUE_SHARE:
            self.before = share
            self.rescue("kahan")

    def rescue(self, method: str | None) -> None:
        """Write :meth:`update` through ``method`` (``"kahan"``, ``"stochastic"`` or None)."""
        if method not in (None, "kahan", "stochastic"):
            raise ValueError(f"method must be None, 'kahan' or 'stochastic', got {method!r}")
        if method == "kahan" and not self.comp:
            self.comp = [kahan_buffer(p) for p in self.params]
        elif method != "kahan" and self.comp:
            with torch.no_grad():
                for p, c in zip(self.params, self.comp, strict=True):
                    p.copy_(kahan_read(p, c))
            self.comp = []
        self.method = method

    # ------------------------------------------------------------------ reading
    def shares(self) -> list[LayerShare]:
        """Per EMA layer: lost and intended updates over the samples. Cost: one host sync."""
        out: dict[str, list] = {}
        for layer, p, (lost, moving) in zip(
            self.layers, self.params, self._counts.tolist(), strict=True
        ):
            row = out.setdefault(layer, [str(p.dtype).replace("torch.", ""), 0, 0])
            row[1] += lost
            row[2] += moving
        return [LayerShare(n, d, lost, mov) for n, (d, lost, mov) in out.items()]

    def share(self) -> float:
        """The lost share over every EMA layer. Cost: one host sync."""
        lost, moving = (int(x) for x in self._counts.sum(0).tolist()) if self.params else (0, 0)
        return lost / moving if moving else 0.0

    def persistent_bytes(self) -> int:
        """Bytes of the Kahan buffers (0 without)."""
        return sum(c.numel() * c.element_size() for c in self.comp)

    def findings(self, threshold: float = STAGNATION_SHARE) -> list[Finding]:
        """AG175 naming the EMA layers whose updates round away, or ``[]``. Cost: one sync."""
        rows = sorted(
            (s for s in self.shares() if s.moving and s.share >= threshold), key=lambda s: -s.share
        )
        if not rows:
            return []
        names = ", ".join(f"{r.layer!r} ({r.share:.0%})" for r in rows[:6])
        how = (
            f"the rescue ({self.method}) carries the lost part from now on"
            if self.method
            else "update it with ampguard.watch_ema(...).update(decay) under "
            "stagnation_rescue='auto' (Kahan) to carry the lost part, or keep the EMA in fp32"
        )
        return [
            make(
                "AG175",
                f"On {self.samples} sampled update(s), the EMA/teacher weights the optimizer does "
                f"not own kept their stored value for most elements the update meant to move: "
                f"{names} of the intended updates rounded away (the update is (1 - decay) times "
                "the gap to the model, below half an ulp). The EMA stops following the model.",
                detail=", ".join(repr(r.layer) for r in rows[:3]),
                evidence={
                    "layers": layer_evidence(rows),
                    "module": rows[0].layer,
                    "samples": self.samples,
                    "threshold": threshold,
                    "owner": "ema",
                    "rescue": self.method,
                    "share_before_rescue": self.before,
                },
                fix=how,
            )
        ]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The rescue method, Kahan buffers, generator and counts (resumes bitwise)."""
        return {
            "method": self.method,
            "comp": [c.clone() for c in self.comp],
            "generator": self.generator.get_state(),
            "counts": self._counts.clone(),
            "updates": self.updates,
            "samples": self.samples,
            "before": self.before,
        }

    def check_state(self, state: Any) -> None:
        """``ValueError`` naming the field when ``state`` does not fit this EMA; no change."""
        comp = state.get("comp") if isinstance(state, dict) else None
        if (
            not isinstance(comp, list)
            or (comp and [tuple(c.shape) for c in comp] != [tuple(p.shape) for p in self.params])
            or any(not isinstance(c, torch.Tensor) or c.dtype != COMP_DTYPE for c in comp)
            or state.get("method") not in (None, "kahan", "stochastic")
            or not isinstance(state.get("counts"), torch.Tensor)
            or tuple(state["counts"].shape) != tuple(self._counts.shape)
            or not isinstance(state.get("generator"), torch.Tensor)
        ):
            raise ValueError("malformed EMA state: 'ema.comp'/'ema.method' do not fit this EMA")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; ``ValueError`` naming the field, nothing changed."""
        self.check_state(state)
        comp = state["comp"]
        self.method = state["method"]
        self.comp = [
            c.to(p.device).clone() for c, p in zip(comp, self.params if comp else [], strict=True)
        ]
        self.generator.set_state(state["generator"])
        self._counts.copy_(state["counts"])
        self.updates, self.samples = int(state["updates"]), int(state["samples"])
        self.before = state.get("before")


def watch_ema(
    ema: torch.nn.Module,
    source: torch.nn.Module,
    *,
    every: int = 1,
    rescue: str | None = None,
) -> EmaWatch:
    """Watch an EMA / teacher model the optimizer does not own (see :class:`EmaWatch`).

    >>> import torch, ampguard as ag
    >>> model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    >>> ema = torch.nn.Linear(4, 4).to(torch.bfloat16)
    >>> watch = ag.watch_ema(ema, model, rescue="kahan")
    >>> watch.update(0.999)        # ema += 0.001 * (model - ema), the lost part carried
    """
    return EmaWatch(ema, source, every=every, rescue=rescue)


def as_watches(ema: Any, source: torch.nn.Module, argument: str = "ema") -> list[EmaWatch]:
    """``ema=`` as given to the Guard or ``ag.watch``: None, a module, an :class:`EmaWatch`, or a
    list of them; a module becomes ``EmaWatch(module, source)``. ``TypeError`` naming
    ``argument``."""
    items = [] if ema is None else list(ema) if isinstance(ema, (list, tuple)) else [ema]
    out = []
    for item in items:
        if isinstance(item, EmaWatch):
            out.append(item)
        elif isinstance(item, torch.nn.Module):
            out.append(EmaWatch(item, source))
        else:
            raise TypeError(
                f"{argument} must be a torch.nn.Module, an ampguard.watch_ema(...) object or a "
                f"list of them, got {type(item).__name__}"
            )
    return out
