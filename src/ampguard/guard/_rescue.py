"""The Guard's stagnation rescue: ``stagnation_rescue=``, ``fp32_optimizer_states=``, ``ema=``.

- ``"kahan"`` / ``"stochastic"``: every bf16/fp16 parameter of the optimizers steps in fp32 and is
  written back by that method (:mod:`ampguard.core.rescue`).
- ``"auto"``: nothing at first; on each window the stagnation probe sampled (the first, then
  every 50), the layers with at least :data:`~ampguard.core.rescue.RESCUE_SHARE` of their
  intended updates lost, or whose weight decay alone rounds away, and not yet rescued are
  switched on, the worst first: Kahan while the
  Kahan buffers stay within :data:`~ampguard.core.rescue.KAHAN_BUDGET` of what fp32 master
  weights would cost, stochastic rounding for the rest. The share before and the applied share
  measured after (on the rescue's own sampled steps) are reported in AG177; the probe's AG175
  leaves rescued layers out.
- ``fp32_optimizer_states=True``: the low-precision parameters' optimizer states are kept in fp32
  (the parameters step through the rescue's hooks, rounded to nearest unless rescued).
- ``ema=``: EMA / teacher modules (or :class:`~ampguard.core.ema.EmaWatch` objects): measured
  between windows (AG175 naming ``ema.*`` layers); ``EmaWatch.update`` is rescued under the mode.

AG176 names optimizer states held in bf16/fp16. Cost: the rescue's (see ``ampguard.core.rescue``);
under ``"auto"`` one host sync on each window the probe sampled.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ampguard._util.stack import user_stacklevel
from ampguard.core.ema import EmaWatch, as_watches
from ampguard.core.rescue import KAHAN_BUDGET, RESCUE_SHARE, Rescue, closure_only
from ampguard.core.stagnation import LOW_PRECISION, StagnationProbe, owner_names
from ampguard.findings import Finding, make

__all__ = ["MODES", "GuardRescue", "check", "attach", "stagnation_findings"]

MODES = ("auto", "kahan", "stochastic")
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10}  # stored significand bits


def check(
    mode: Any, fp32_states: Any, ema: Any, model: torch.nn.Module, optimizers: list[Any]
) -> tuple[str | None, bool, list[EmaWatch]]:
    """The checked ``stagnation_rescue``, ``fp32_optimizer_states`` and ``ema`` arguments.
    ``TypeError``/``ValueError`` naming the argument; nothing is touched."""
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise ValueError(
            f"stagnation_rescue must be None, 'auto', 'kahan' or 'stochastic', got {mode!r}"
        )
    if not isinstance(fp32_states, bool):
        raise TypeError(f"fp32_optimizer_states must be a bool, got {type(fp32_states).__name__}")
    watches = as_watches(ema, model)
    if mode is not None or fp32_states:
        for opt in optimizers:
            if closure_only(opt):
                argument = "stagnation_rescue" if mode is not None else "fp32_optimizer_states"
                raise ValueError(
                    f"{argument} cannot wrap {type(opt).__name__}.step: it needs a closure and "
                    "re-evaluates the loss itself; use an optimizer that steps once per call "
                    f"or {argument}={None if mode is not None else False}"
                )
    return mode, fp32_states, watches


class GuardRescue:
    """What the Guard attached for the rescue (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        params: list[torch.Tensor],
        mode: str | None,
        fp32_states: bool,
        emas: list[EmaWatch],
    ) -> None:
        self.mode = mode
        self.rescue = Rescue(optimizers, params, fp32_states=fp32_states)
        self.layers = owner_names(model, self.rescue.params)
        self.emas = emas
        self.decisions: dict[str, dict[str, Any]] = {}  # layer -> window, share, method
        self._seen = 0
        every = list(range(len(self.rescue.params)))
        if mode in ("kahan", "stochastic"):
            self.rescue.cover(every, mode)
            for layer in dict.fromkeys(self.layers):
                self.decisions[layer] = {"window": 0, "share": None, "method": mode}
        elif fp32_states:
            self.rescue.cover(every, "nearest")
        for w in emas:
            if w.mode is None and mode is not None:
                w.mode = mode
                if mode != "auto":
                    w.rescue(mode)

    def close(self) -> None:
        self.rescue.close()

    # ------------------------------------------------------------------ the step
    def after_window(
        self, window: int, skipped: bool | torch.Tensor, probe: StagnationProbe | None
    ) -> None:
        """After a window's step, before the gradients are cleared: the EMA measurement, and
        under ``"auto"`` the decision on a window the probe sampled (one host sync then)."""
        for w in self.emas:
            w.on_window(window, skipped)
        if self.mode == "auto" and probe is not None and probe.samples > self._seen:
            self._seen = probe.samples
            self.decide(probe, window)

    def decide(self, probe: StagnationProbe, window: int) -> None:
        """Switch the rescue on for the stagnating layers (see the module docstring): those
        whose measured lost share reaches :data:`RESCUE_SHARE`, and those whose weight decay
        alone rounds away (:meth:`decay_lost`), the worst first."""
        shares = {s.layer: s for s in probe.shares()}
        decay = self.decay_lost()
        rows = sorted(
            (
                (s.share if s.moving else 0.0, layer)
                for layer, s in shares.items()
                if layer not in self.decisions
                and ((s.moving and s.share >= RESCUE_SHARE) or layer in decay)
            ),
            key=lambda r: -r[0],
        )
        total = sum(p.numel() for p in self.rescue.params)
        budget = KAHAN_BUDGET * 4 * total
        for share, layer in rows:
            idx = [i for i, name in enumerate(self.layers) if name == layer]
            size = sum(
                self.rescue.params[i].numel() * self.rescue.params[i].element_size() for i in idx
            )
            method = "kahan" if self.rescue.persistent_bytes() + size <= budget else "stochastic"
            self.rescue.cover(idx, method)
            self.decisions[layer] = {
                "window": window,
                "share": share,
                "method": method,
                "reason": "updates" if share >= RESCUE_SHARE else "weight decay",
            }

    def decay_lost(self) -> set[str]:
        """Layers whose weight decay per step (``lr * weight_decay``, relative to the weight)
        is below half the relative spacing of their dtype (2**-9 bf16, 2**-12 fp16): alone, it
        rounds away for every element (gradient updates the probe counts hide it; a zero or
        small gradient shows it: "weight decay never applied"). Cost: none (reads floats)."""
        out: set[str] = set()
        for opt in self.rescue.optimizers:
            for group in opt.param_groups:
                lr, wd = group.get("lr"), group.get("weight_decay")
                if not isinstance(lr, (int, float)) or not isinstance(wd, (int, float)):
                    continue
                decay = float(lr) * float(wd)
                for p in group["params"]:
                    i = self.rescue.index_of(p)
                    if i is None or decay <= 0:
                        continue
                    half = 2.0 ** -(_MANTISSA[p.dtype] + 2)
                    if decay < half:
                        out.add(self.layers[i])
        return out

    def abort(self) -> None:
        self.rescue.abort()

    # ------------------------------------------------------------------ reading
    def applied(self) -> dict[str, float]:
        """Per rescued layer: the share of the intended update that reached the stored weight
        on the rescue's sampled steps. Cost: one host sync."""
        sums: dict[str, list[float]] = {}
        for i, (num, den) in enumerate(self.rescue.sums()):
            if den:
                row = sums.setdefault(self.layers[i], [0.0, 0.0])
                row[0] += num
                row[1] += den
        return {layer: n / d for layer, (n, d) in sums.items()}

    def bytes_per_param(self) -> float:
        """Persistent bytes the rescue (Kahan buffers, fp32 states, EMA buffers) adds per
        low-precision parameter element."""
        total = sum(p.numel() for p in self.rescue.params) or 1
        extra = self.rescue.persistent_bytes() + self.rescue.state_bytes()
        return (extra + sum(w.persistent_bytes() for w in self.emas)) / total

    def findings(self) -> list[Finding]:
        """AG177 (the rescue: layers, methods, before/after) and the EMAs' AG175. One sync."""
        out = [f for w in self.emas for f in w.findings()]
        if not self.decisions:
            return out
        applied = self.applied()
        layers = {
            layer: {
                "method": d["method"],
                "since_window": d["window"],
                "lost_share_before": None if d["share"] is None else round(d["share"], 4),
                "applied_share_after": (round(applied[layer], 4) if layer in applied else None),
            }
            for layer, d in self.decisions.items()
        }
        text = ", ".join(
            f"{layer!r} ({v['method']}: "
            + (f"{v['lost_share_before']:.0%} lost before, " if v["lost_share_before"] else "")
            + (
                f"{v['applied_share_after']:.0%} applied after)"
                if v["applied_share_after"] is not None
                else "not measured yet)"
            )
            for layer, v in list(layers.items())[:6]
        )
        more = f" and {len(layers) - 6} more" if len(layers) > 6 else ""
        out.append(
            make(
                "AG177",
                f"stagnation_rescue={self.mode!r} writes the fp32 update of {len(layers)} "
                f"layer(s) back without losing the part below half an ulp: {text}{more}. "
                f"Extra persistent memory: {self.bytes_per_param():.2f} bytes per low-precision "
                "parameter (fp32 master weights: 4).",
                detail=", ".join(repr(k) for k in list(layers)[:3]) + more,
                evidence={
                    "mode": self.mode,
                    "layers": layers,
                    "bytes_per_param": round(self.bytes_per_param(), 4),
                    "samples": self.rescue.samples,
                },
            )
        )
        return out

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """The Guard state's ``"rescue"`` entry (tensors: the Kahan buffers, generators)."""
        return {
            "mode": self.mode,
            "rescue": self.rescue.state_dict(),
            "decisions": {k: dict(v) for k, v in self.decisions.items()},
            "seen": self._seen,
            "ema": [w.state_dict() for w in self.emas],
        }

    def check_state(self, state: Any) -> dict[str, Any] | None:
        """``ValueError`` naming the field when a saved entry does not fit; None: no entry."""
        if state is None:
            return None
        if not isinstance(state, dict) or not isinstance(state.get("decisions"), dict):
            raise ValueError("malformed Guard state: 'rescue' must be a dict with 'decisions'")
        self.rescue.check_state(state.get("rescue"))
        emas = state.get("ema")
        if not isinstance(emas, list) or len(emas) != len(self.emas):
            raise ValueError(
                f"malformed Guard state: 'rescue.ema' must list {len(self.emas)} EMA state(s)"
            )
        for w, saved in zip(self.emas, emas, strict=True):
            w.check_state(saved)
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Carry out a checked state (see :meth:`check_state`)."""
        self.rescue.load_state_dict(state["rescue"])
        self.decisions = {k: dict(v) for k, v in state["decisions"].items()}
        self._seen = int(state.get("seen", 0))
        for w, s in zip(self.emas, state["ema"], strict=True):
            w.load_state_dict(s)


def attach(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    params: list[torch.Tensor],
    checked: tuple[str | None, bool, list[EmaWatch]],
) -> GuardRescue | None:
    """A :class:`GuardRescue`, or None when nothing was asked for. fp32 parameters alone under
    a rescue mode: a warning (nothing to rescue), and None unless an EMA is watched."""
    mode, fp32_states, emas = checked
    if mode is None and not fp32_states and not emas:
        return None
    if not any(p.dtype in LOW_PRECISION for p in params):
        if mode is not None or fp32_states:
            warnings.warn(
                f"stagnation_rescue={mode!r}: every trained parameter is fp32, nothing to rescue "
                "(their spacing is fine enough; autocast runs the low-precision math)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        if not emas:
            return None
        mode, fp32_states = None, False
    return GuardRescue(model, optimizers, params, mode, fp32_states, emas)


def stagnation_findings(
    rescue: GuardRescue | None,
    probe: StagnationProbe | None,
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[Finding]:
    """AG175 (the layers not rescued), AG176 (low-precision optimizer states), AG177 and the
    EMAs' AG175. Cost: one host sync."""
    out: list[Finding] = []
    if probe is not None:
        out += probe.findings(exclude=set(rescue.decisions) if rescue is not None else set())
        out += state_findings(optimizers)
    if rescue is not None:
        out += rescue.findings()
    return out


def state_findings(optimizers: Sequence[torch.optim.Optimizer]) -> list[Finding]:
    """AG176 naming optimizer states (``exp_avg_sq``...) held in bf16/fp16. Cost: none (reads
    dtypes)."""
    found: dict[str, dict[str, Any]] = {}
    for opt in optimizers:
        for state in opt.state.values():
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.dtype in LOW_PRECISION:
                    row = found.setdefault(
                        str(key),
                        {"dtype": str(v.dtype).replace("torch.", ""), "tensors": 0, "elements": 0},
                    )
                    row["tensors"] += 1
                    row["elements"] += v.numel()
    if not found:
        return []
    names = ", ".join(f"{k} ({v['dtype']}, {v['tensors']} tensor(s))" for k, v in found.items())
    return [
        make(
            "AG176",
            f"The optimizer keeps its states in low precision: {names}. Their own running "
            "averages (exp_avg_sq += (1 - beta2) * (g*g - exp_avg_sq)) move by less than half an "
            "ulp and round away as the weights do, so the step size drifts.",
            detail=", ".join(found),
            evidence={"states": found},
            fix="Guard(..., fp32_optimizer_states=True) keeps them in fp32 (4 bytes per element "
            "instead of 2); or leave the model in fp32 and let autocast run the math",
        )
    ]
