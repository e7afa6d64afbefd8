"""Update stagnation: parameters stored in bf16/fp16 lose every update below half an ulp.

``model.to(torch.bfloat16)`` (pure-bf16 recipes) or ``.half()`` keeps the weights themselves in 8
or 11 significant bits. An update smaller than half the spacing of representable values at a
weight's magnitude rounds away when the optimizer writes ``p + u`` back: a bf16 weight of 0.1
has a spacing of 2**-11 ~ 4.9e-4, so every Adam step of lr=1e-4 leaves it exactly as it was. The
loss stalls and nothing is non-finite.

The measurement, on a sampling step, per parameter tensor in bf16/fp16::

    before  = copy of p                        # preallocated; taken before optimizer.step
    moving  = p.grad != 0                      # the optimizer intends to move these elements
    lost    = moving & (p == before)           # ... and the stored value did not change
    counts += [lost.sum(), moving.sum()]       # on the device; zero when the window skipped

A nonzero gradient stands for "an intended nonzero update": true for SGD, momentum and the Adam
family (their update is zero only where the whole history is), so ``lost / moving`` is the share
of intended updates that rounded away. fp32 parameters are not watched (their spacing is 2**16
times finer). :class:`StagnationProbe` keeps the counts on the device; :meth:`~StagnationProbe.
shares` reads them (one host sync, where the Guard's findings already sync).

Cost: nothing on steps that are not sampled. On a sampled step (the first window, then every
``every`` windows): one multi-tensor copy of the low-precision parameters before the step and
about four elementwise ops per such tensor after it; no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampguard.findings import Finding, make

__all__ = [
    "LOW_PRECISION",
    "STAGNATION_SHARE",
    "SAMPLE_EVERY",
    "LayerShare",
    "StagnationProbe",
    "lost_updates",
    "stagnation_fix",
    "owner_names",
    "layer_evidence",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)
STAGNATION_SHARE = 0.5  # a layer stagnates when at least this share of its intended updates is lost
SAMPLE_EVERY = 50  # windows between samples (the first window is always sampled)


@dataclass(frozen=True)
class LayerShare:
    """One layer's measured stagnation: ``lost`` of ``moving`` intended updates rounded away."""

    layer: str
    dtype: str
    lost: int
    moving: int

    @property
    def share(self) -> float:
        return self.lost / self.moving if self.moving else 0.0


def lost_updates(
    params: list[torch.Tensor], before: list[torch.Tensor], grads: list[torch.Tensor | None]
) -> torch.Tensor:
    """``[len(params), 2]`` int64 device tensor: per parameter, (updates lost, updates intended).

    ``before`` holds the values before the optimizer step; a parameter without a gradient
    counts (0, 0). Cost: about four elementwise ops per parameter; no host sync.
    """
    rows = []
    for p, b, g in zip(params, before, grads, strict=True):
        if g is None:
            rows.append(torch.zeros(2, dtype=torch.int64, device=p.device))
            continue
        moving = g.detach() != 0
        lost = moving & (p.detach() == b)
        rows.append(torch.stack((lost.sum(), moving.sum())))
    return torch.stack(rows)


def owner_names(model: torch.nn.Module, params: list[torch.Tensor]) -> list[str]:
    """The name of the module that owns each parameter (``""`` the root, ``"(not in model)"``)."""
    names = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
    return [names.get(id(p), "(not in model)") for p in params]


class StagnationProbe:
    """Counts, on sampled windows, the share of intended updates that rounded away per layer.

    ``before(window)`` copies the low-precision parameters when ``window`` is sampled;
    ``after(window, skipped)`` adds the window's counts (``skipped``: a bool, or a 0-dim bool
    device tensor for fused optimizers' lazy flags: a skipped window adds nothing) and must run
    before the gradients are cleared. :meth:`shares` reads the totals per layer (one host sync).
    Cost: see the module docstring.
    """

    def __init__(
        self, model: torch.nn.Module, params: list[torch.Tensor], every: int = SAMPLE_EVERY
    ) -> None:
        self.every = every
        self.params = [p for p in params if p.dtype in LOW_PRECISION]
        self.layers = owner_names(model, self.params)
        self._copies = [torch.empty_like(p) for p in self.params]
        dev = self.params[0].device if self.params else torch.device("cpu")
        self._counts = torch.zeros(len(self.params), 2, dtype=torch.int64, device=dev)
        self._taken: int | None = None
        self.samples = 0

    @classmethod
    def of(cls, model: torch.nn.Module, params: list[torch.Tensor]) -> StagnationProbe | None:
        """A probe over ``params`` in bf16/fp16, or None when all are fp32 (zero cost)."""
        return cls(model, params) if any(p.dtype in LOW_PRECISION for p in params) else None

    def due(self, window: int) -> bool:
        return window == 1 or window % self.every == 0

    def before(self, window: int) -> None:
        """Copy the parameters if ``window`` is sampled. Cost: one multi-tensor copy then."""
        if not self.due(window):
            return
        with torch.no_grad():
            torch._foreach_copy_(self._copies, [p.detach() for p in self.params])
        self._taken = window

    def sampling(self, window: int) -> bool:
        """True when :meth:`before` copied the weights for ``window`` (``after`` is due)."""
        return self._taken == window

    def after(self, window: int, skipped: bool | torch.Tensor) -> None:
        """Add the sampled window's counts unless it was skipped. Cost: no host sync."""
        if self._taken != window:
            return
        self._taken = None
        if skipped is True:
            return
        counts = lost_updates(self.params, self._copies, [p.grad for p in self.params])
        if isinstance(skipped, torch.Tensor):
            counts = counts * (~skipped).to(counts.device, torch.int64)
        self._counts += counts
        self.samples += 1

    def shares(self) -> list[LayerShare]:
        """Per layer (in parameter order): lost and intended updates over all samples.
        Cost: one host sync (a ``[n, 2]`` tensor)."""
        values = self._counts.tolist()
        out: dict[str, list] = {}
        for layer, p, (lost, moving) in zip(self.layers, self.params, values, strict=True):
            row = out.setdefault(layer, [str(p.dtype).replace("torch.", ""), 0, 0])
            row[1] += lost
            row[2] += moving
        return [LayerShare(layer, d, lost, moving) for layer, (d, lost, moving) in out.items()]

    def stagnant(
        self, threshold: float = STAGNATION_SHARE, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[LayerShare]:
        """Layers whose lost share is at least ``threshold``, worst first, but those named in
        ``exclude`` (layers a stagnation rescue covers). Cost: one sync."""
        rows = [
            s for s in self.shares() if s.moving and s.share >= threshold and s.layer not in exclude
        ]
        return sorted(rows, key=lambda s: -s.share)

    def findings(
        self, threshold: float = STAGNATION_SHARE, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[Finding]:
        """AG175 naming the stagnating layers (but ``exclude``), or ``[]``. Cost: one sync."""
        rows = self.stagnant(threshold, exclude)
        if not rows:
            return []
        names = ", ".join(f"{r.layer!r} ({r.share:.0%})" for r in rows[:6])
        more = f" and {len(rows) - 6} more" if len(rows) > 6 else ""
        dtypes = sorted({r.dtype for r in rows})
        return [
            make(
                "AG175",
                f"On {self.samples} sampled step(s), the {'/'.join(dtypes)} weights of "
                f"{len(rows)} layer(s) kept their stored value for most elements the optimizer "
                f"meant to move: {names}{more} of the intended updates rounded away (smaller "
                "than half a unit in the last place of the weight). The loss stalls although "
                "nothing is non-finite.",
                detail=", ".join(repr(r.layer) for r in rows[:3]) + more,
                evidence={
                    "layers": layer_evidence(rows),
                    "module": rows[0].layer,  # the worst layer
                    "samples": self.samples,
                    "threshold": threshold,
                },
                fix=stagnation_fix(dtypes),
            )
        ]


def stagnation_fix(dtypes: list[str]) -> str:
    """The fix for weights whose updates round away (AG175, AG365)."""
    low = "/".join(dtypes) or "bf16"
    return (
        f"Keep fp32 master weights: leave the model in float32 (no .to({low}) / .half()) and "
        "let autocast run the low-precision math (Guard(precision='bf16')); or keep the "
        f"{low} weights and carry the update's lost part (Kahan summation) or round it "
        "stochastically, on the layers that need it: Guard(..., stagnation_rescue='auto'), "
        "any torch.optim optimizer; torchao.optim.AdamW(..., bf16_stochastic_round=True) does "
        "it for AdamW on every layer."
    )


def layer_evidence(rows: list[LayerShare]) -> dict[str, dict[str, object]]:
    """An AG175 finding's per-layer evidence: the lost share, the counts and the dtype."""
    return {
        r.layer: {
            "share": round(r.share, 4),
            "lost": r.lost,
            "intended": r.moving,
            "dtype": r.dtype,
        }
        for r in rows
    }
