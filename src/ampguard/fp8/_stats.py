"""fp8 telemetry: per converted layer, every ``range_every`` steps, the amax and flushed shares
of its input, weight and output gradient under the recipe's scaling; AG111/AG112 when a layer
drifts out of fp8's window while training (the fp8 analogues of AG105/AG106).

Samples are taken on the first micro-batch of every ``range_every``-th window by hooks on the
converted layers (a forward hook and a hook on the output's gradient), kept on the device, and
written to the run log as ``{"kind": "fp8", "step", "layers": {name: {...}}}`` events once 8 are
pending and at ``findings``/``close``.

AG111 warning   on at least half of its samples, more than the plan's ``max_input_flushed``
                (or ``max_weight_flushed``) of a layer's input (weight) flushed to zero in e4m3
AG112 warning   on at least half of its samples, more than ``max_grad_flushed`` of a layer's
                output gradient flushed to zero in the gradient dtype
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ampguard._util.jsonnum import finite_or_none
from ampguard.findings import Finding, make
from ampguard.fp8._cast import E4M3, RECIPES, flushed_share, quantize
from ampguard.runlog import FP8_FIELDS

__all__ = ["Fp8Monitor", "Fp8Log", "WindowClock", "FIELDS"]

FIELDS = FP8_FIELDS  # one source: the run-folder schema reads the same figures
_WRITE_EVERY = 8  # pending samples before one host sync writes them out


class WindowClock(Protocol):
    """Where the training loop is: ``steps`` windows done, ``micro`` micro-batches into the next
    one (the Guard's step state has both)."""

    steps: int
    micro: int


class Fp8Log(Protocol):
    """The part of :class:`ampguard.Telemetry` the fp8 monitor and rescue write to."""

    @property
    def range_every(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def append_events(self, records: list[dict[str, Any]]) -> None: ...

    def annotate(self, key: str, value: Any) -> None: ...


def _stats(x: torch.Tensor, dtype: torch.dtype, recipe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return x2.float().abs().amax(), flushed_share(x2, quantize(x2, dtype, recipe))


class Fp8Monitor:
    """Samples the fp8 layers of a Guard. Cost: on sample windows about 10 small kernels per
    converted layer and tensor; one host sync per 8 samples (none in between)."""

    def __init__(
        self,
        model: nn.Module,
        telemetry: Fp8Log,
        clock: WindowClock,
        layers: list[str],
        recipe: str,
        thresholds: Any,
    ) -> None:
        from ampguard.fp8._plan import Fp8Thresholds

        self.clock = clock
        self.telemetry = telemetry
        self.recipe = RECIPES[recipe]
        self.thresholds = thresholds or Fp8Thresholds()
        self.layers = list(layers)
        self.samples: list[dict[str, Any]] = []  # host records, oldest first
        self._pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._current: tuple[int, dict[str, torch.Tensor]] | None = None
        self.on_records: Any = None  # called with each batch of written records (fp8 rescue)
        self.max_samples: int | None = None  # keep only the last N host records (None: all)
        modules = dict(model.named_modules())
        self._handles = {n: modules[n].register_forward_hook(self._hook(n)) for n in self.layers}

    def drop(self, name: str) -> None:
        """Stop sampling ``name`` (it left fp8); its samples so far stay."""
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.remove()

    def _sampling(self) -> int | None:
        step = self.clock.steps + 1
        if (
            self.clock.micro
            or step % self.telemetry.range_every
            or not torch.is_grad_enabled()
            or self.telemetry.closed
        ):
            return None
        return step

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            step = self._sampling()
            if step is None or not args or not isinstance(args[0], torch.Tensor):
                return
            if self._current is None or self._current[0] != step:
                self._flush_current()
                self._current = (step, {})
            row = torch.full((len(FIELDS),), float("nan"), device=args[0].device)
            row[0], row[1] = _stats(args[0], E4M3, self.recipe)
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            row[2], row[3] = _stats(weight, E4M3, self.recipe)
            self._current[1][name] = row
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._on_grad(row, g))

        return hook

    def _on_grad(self, row: torch.Tensor, grad: torch.Tensor) -> None:
        amax, flushed = _stats(grad, self.recipe.grad_dtype, self.recipe)
        row[4], row[5] = amax, flushed

    def _flush_current(self) -> None:
        if self._current is not None and self._current[1]:
            self._pending.append(self._current)
        self._current = None
        if len(self._pending) >= _WRITE_EVERY:
            self.collect()

    def collect(self) -> None:
        """Write pending samples to the run log. Cost: one host sync."""
        if self._current is not None and self._current[0] <= self.clock.steps:
            self._flush_current()  # that window is complete: its gradients were recorded
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        names = [list(rows) for _, rows in pending]
        values = torch.stack([r for _, rows in pending for r in rows.values()]).tolist()
        records, k = [], 0
        for (step, _), layer_names in zip(pending, names, strict=True):
            layers = {}
            for n in layer_names:
                layers[n] = {
                    f: finite_or_none(v)  # JSON: no NaN/inf
                    for f, v in zip(FIELDS, values[k], strict=True)
                }
                k += 1
            records.append({"kind": "fp8", "step": step, "layers": layers})
        self.samples.extend(records)
        if self.max_samples is not None:
            del self.samples[: -self.max_samples]
        self.telemetry.append_events(records)
        if self.on_records is not None:
            self.on_records(records)

    def last(self) -> dict[str, Any]:
        """The latest sample of each layer (step and figures)."""
        out: dict[str, Any] = {}
        for rec in self.samples:
            for n, v in rec["layers"].items():
                out[n] = {"step": rec["step"], **v}
        return out

    def findings(self) -> list[Finding]:
        """AG111/AG112 over all samples so far. Cost: one host sync (collect)."""
        self.collect()
        th = self.thresholds
        out = []
        for name in self.layers:
            rows = [(r["step"], r["layers"][name]) for r in self.samples if name in r["layers"]]
            for key, limit, code in (
                ("input_flushed", th.max_input_flushed, "AG111"),
                ("weight_flushed", th.max_weight_flushed, "AG111"),
                ("grad_flushed", th.max_grad_flushed, "AG112"),
            ):
                f = _drift(name, rows, key, limit, code, self.recipe)
                if f is not None:
                    out.append(f)
        return out

    def remove(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles.clear()


def _drift(
    name: str,
    rows: list[tuple[int, dict[str, Any]]],
    key: str,
    limit: float,
    code: str,
    recipe: Any,
) -> Finding | None:
    seen = [(s, v[key]) for s, v in rows if v.get(key) is not None]
    bad = [(s, x) for s, x in seen if x > limit]
    if not seen or 2 * len(bad) < len(seen):
        return None
    worst = max(x for _, x in bad)
    what = key.split("_")[0]
    dtype = "e5m2" if key == "grad_flushed" and recipe.grad_dtype == torch.float8_e5m2 else "e4m3"
    return make(
        code,
        f"{name}: on {len(bad)} of {len(seen)} samples more than {limit:.2%} of its {what}'s "
        f"nonzero values flushed to zero in {dtype} (worst {worst:.2%}, first at step "
        f"{bad[0][0]}); its {'updates' if code == 'AG112' else 'outputs'} lose that signal",
        detail=None if code == "AG112" else what,
        step=bad[0][0],
        evidence={
            "layer": name,
            "field": key,
            "samples": len(seen),
            "over_limit": len(bad),
            "worst": worst,
            "limit": limit,
            "recipe": recipe.name,
        },
        fix=(
            f"keep {name!r} in bf16 (make a plan with ag.fp8_plan and pass fp8_plan=, or "
            f"leave it out of module_filter_fn)"
            + (
                ", or rescale the loss terms feeding it"
                if code == "AG112"
                else ", or use recipe='rowwise'"
            )
        ),
    )
