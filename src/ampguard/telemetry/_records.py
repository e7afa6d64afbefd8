"""Turn one flush worth of recorded steps (their device values now on the host) into run-log lines.

A flush hands over columns, one value per recorded step, and the JSON lines are formatted from
them directly: no dict and no ``json.dumps`` per step, so a step record costs about a microsecond
of host time. What a line holds is the run-log schema (:mod:`ampguard.runlog._schema`); the
values are those :func:`ampguard.runlog.num` gives (7 significant digits, null when non-finite).
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ampguard.core import results
from ampguard.core.results import Decoded
from ampguard.rules import RANGE_BINS, summarize_ranges
from ampguard.runlog import number_texts

__all__ = [
    "Facts",
    "Values",
    "Shape",
    "Outcome",
    "RunTally",
    "build_lines",
    "nonfinite_name",
    "SCALE",
    "STATUS",
    "LOSS",
    "NORM",
    "FIXED",
]

# the fixed device columns, one value per recorded step; the losses end where the gradient
# samples begin, so the flush writes both with one stack
SCALE, NORM, STATUS, LOSS = range(4)
FIXED = 4


class Facts(NamedTuple):
    """Host-side facts of a flush's steps, one entry per step (their values are on the device)."""

    step: Sequence[int]
    micro: Sequence[int]  # losses recorded in the window (0: the record's loss is null)
    scaled: Sequence[bool]  # a loss scaler was in use
    scale: Sequence[float | None]  # the scale after the step, None: in the device column
    stats_slot: Sequence[int]  # row of per-tensor gradient norms in Values.norms; -1: none
    range_slot: Sequence[int]  # row in Values.ranges; -1: no range sample
    grads_scaled: Sequence[bool]  # sampled gradients still carried the loss scale
    precision: Sequence[str]
    status: Sequence[int | None]  # the packed flags; None: in the device column
    guard_norm: Sequence[bool]  # column NORM holds the producer's own (clipping) grad norm


class Values(NamedTuple):
    """A flush's device values, copied to the host."""

    fixed: np.ndarray  # (FIXED, >= steps): scale after the step, norm, packed flags, loss sum
    norms: np.ndarray  # (samples, tensors): per-tensor gradient norms
    ranges: np.ndarray  # (samples, layers * (1 + BINS)): per-layer amax, then histograms


class Shape(NamedTuple):
    """What the records of a run look like (fixed at attach)."""

    n_optimizers: int
    layers: tuple[tuple[int, int], ...]  # each layer's tensors [start, end) (in layer order)
    layer_stats: bool  # per-layer gradient norms (else only the total)


class Outcome(NamedTuple):
    """A flush's steps as written (the running tallies read them)."""

    step: Sequence[int]
    keys: list[tuple[int, bool]]  # each step's (packed flags, scaled)
    decoded: dict[tuple[int, bool], Decoded]  # the flags of each key
    scale_before: list[str]  # JSON texts, as in the lines
    scale: list[str]


_LINE = '{"step":%d,"scale_before":%s,"scale":%s,%s,"loss":%s,"precision":%s%s}\n'
_BOOL = ("false", "true")


def build_lines(
    facts: Facts, values: Values, *, carry: float, shape: Shape
) -> tuple[list[str], Outcome, float]:
    """The run-log lines of ``facts`` (newline-terminated); ``carry`` is the scale before the
    first step. Returns the lines, the outcomes for the running tallies, and the scale after
    the last step (the next flush's carry). Cost: host only, about 1 us per step."""
    n = len(facts.step)
    fixed = values.fixed[:, :n].tolist()
    scale_col, status_col, loss_col = fixed[SCALE], fixed[STATUS], fixed[LOSS]
    after, before = [], []
    for scaled, host, device in zip(facts.scaled, facts.scale, scale_col, strict=True):
        before.append(carry if scaled else 1.0)
        if scaled:
            carry = device if host is None else host
        after.append(carry if scaled else 1.0)
    keys = [
        (int(device) if host is None else host, scaled)
        for host, device, scaled in zip(facts.status, status_col, facts.scaled, strict=True)
    ]
    decoded = {k: results.decode(k[0], shape.n_optimizers, k[1]) for k in set(keys)}
    flags = [decoded[k] for k in keys]
    flags_text = {k: _flags_text(d) for k, d in decoded.items()}
    precision_text = {p: json.dumps(p) for p in set(facts.precision)}
    loss = [v / m if m else math.nan for v, m in zip(loss_col, facts.micro, strict=True)]
    extras = _extras(facts, values, loss, flags, before, shape)
    scale_texts = number_texts(before + after)  # mostly one value: formatted once
    before_texts, after_texts = scale_texts[:n], scale_texts[n:]
    lines = [
        _LINE % (step, b, a, flags_text[k], loss_text, precision_text[p], extra)
        for step, b, a, k, loss_text, p, extra in zip(
            facts.step,
            before_texts,
            after_texts,
            keys,
            number_texts(loss),
            facts.precision,
            extras,
            strict=True,
        )
    ]
    return lines, Outcome(facts.step, keys, decoded, before_texts, after_texts), carry


def _flags_text(d: Decoded) -> str:
    return (
        f'"applied":{_BOOL[d.applied]},"overflow":{_BOOL[d.overflow]},'
        f'"collapse":{_BOOL[d.collapse]},"nonfinite":{_BOOL[d.nonfinite]},"dropped":{d.dropped}'
    )


def _extras(
    facts: Facts,
    values: Values,
    loss: list[float],
    flags: list[Decoded],
    before: list[float],
    shape: Shape,
) -> list[str]:
    """The optional fields of each step's line (``loss_nonfinite``, ``overflowed``,
    ``grad_norm``, ``layers``, ``range``), as text starting with a comma, or ""."""
    out = [""] * len(loss)
    for i, (value, micro) in enumerate(zip(loss, facts.micro, strict=True)):
        if micro and value - value != 0.0:  # NaN/inf/-inf stay distinct from "no loss"
            out[i] += ',"loss_nonfinite":' + json.dumps(nonfinite_name(value))
    if shape.n_optimizers > 1:
        for i, d in enumerate(flags):
            if d.overflow:
                bad = [k for k, ok in enumerate(d.applied_per_optimizer) if not ok]
                out[i] += ',"overflowed":' + json.dumps(bad)
    _grad_norms(facts, values, before, shape, out)
    for i, slot in enumerate(facts.range_slot):
        if slot >= 0:
            out[i] += ',"range":' + _range_text(values.ranges[slot], len(shape.layers), before[i])
    return out


def _grad_norms(
    facts: Facts, values: Values, before: list[float], shape: Shape, out: list[str]
) -> None:
    """Add ``grad_norm`` (and per-layer norms) to the steps that have them: the producer's own
    total norm where it computed one (a Guard's clip, a DeepSpeed engine's
    ``get_global_grad_norm()``: exactly that value), else the gradient sample's (per-tensor
    norms, unscaled here when the sample carried the loss scale); per-layer norms come from the
    sample."""
    rows = [(i, slot) for i, slot in enumerate(facts.stats_slot) if slot >= 0]
    if rows:
        # plain Python: a few values per sample, where each numpy call costs more than the
        # arithmetic (the device's per-tensor norm dominates however many tensors there are)
        samples = values.norms.tolist()
        squares = []  # per sample: the total, then each layer's sum of squares
        for i, slot in rows:
            sq = [v * v for v in samples[slot]]
            per_layer = [sum(sq[a:b]) for a, b in shape.layers]
            if facts.grads_scaled[i]:  # the sample carried the loss scale
                unscale = 1.0 / (before[i] * before[i])
                per_layer = [x * unscale for x in per_layer]
            squares.append(sum(per_layer))
            squares.extend(per_layer)
        texts = number_texts([math.sqrt(x) for x in squares])
        width = 1 + len(shape.layers)
        mine = [i for i, _ in rows if facts.guard_norm[i]]
        own_text = dict(zip(mine, number_texts(values.fixed[NORM, mine]), strict=True))
        for k, (i, _) in enumerate(rows):
            out[i] += ',"grad_norm":' + own_text.get(i, texts[k * width])
            if shape.layer_stats:
                layers = ",".join(texts[k * width + 1 : (k + 1) * width])
                out[i] += ',"layers":{"grad_norm":[' + layers + "]}"
    own = [i for i, s in enumerate(facts.stats_slot) if s < 0 and facts.guard_norm[i]]
    if own:
        for i, text in zip(own, number_texts(values.fixed[NORM, own]), strict=True):
            out[i] += ',"grad_norm":' + text


def nonfinite_name(value: float) -> str:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite loss (the record's ``loss`` is null)."""
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


_RANGE_FIELDS = ("zero_frac", "amax", "headroom_bits", "underflow", "safe_lo", "safe_hi")


def _range_text(row: np.ndarray, n_layers: int, scale: float) -> str:
    """The ``range`` object of a step's line from its device row (per-layer amax, then the
    exponent histograms): the per-layer figures of :func:`ampguard.rules.summarize_ranges`
    and the share of exact zeros, all formatted in one pass."""
    values = row.tolist()
    bins = RANGE_BINS
    hist = [values[n_layers + k * bins : n_layers + (k + 1) * bins] for k in range(n_layers)]
    s = summarize_ranges(hist, values[:n_layers], scale)
    zero_frac = [counts[0] / max(sum(counts), 1.0) for counts in hist]
    texts = number_texts(
        [x for column in (zero_frac, *(s[k] for k in _RANGE_FIELDS[1:])) for x in column]
        + list(s["window"])
    )
    fields = [
        f'"{name}":[{",".join(texts[k * n_layers : (k + 1) * n_layers])}]'
        for k, name in enumerate(_RANGE_FIELDS)
    ]
    return "{" + ",".join(fields) + f',"window":[{texts[-2]},{texts[-1]}]}}'


class RunTally:
    """Running host-side totals over flushed steps (the cheap accessors of Telemetry)."""

    def __init__(self, accumulation_steps: int, recent: int = 256) -> None:
        self.accumulation_steps = accumulation_steps
        self.recent: deque[tuple[int, float | None]] = deque(maxlen=recent)
        self.skips = {"overflow": 0, "dropped_microbatches": 0, "collapse": 0, "nonfinite": 0}
        self.totals = {
            "steps": 0,
            "scale_changes": 0,
            "consecutive_skips": 0,
            "microbatches_dropped": 0,
            "last_step": 0,
        }

    def add(self, o: Outcome, rates: bool = False) -> list[float]:
        """Count a flush's steps; with ``rates``, returns the running skip rate after each
        (what the sinks plot), else an empty list."""
        t, skips = self.totals, self.skips
        before = sum(skips.values())
        for key, count in Counter(o.keys).items():
            d = o.decoded[key]
            t["microbatches_dropped"] += d.dropped * count
            if not d.applied:
                skips[self._cause(d)] += count
        t["scale_changes"] += sum(a != b for a, b in zip(o.scale, o.scale_before, strict=True))
        applied = {key: d.applied for key, d in o.decoded.items()}
        trailing = 0  # skipped steps since the last applied one
        for key in reversed(o.keys):
            if applied[key]:
                break
            trailing += 1
        n = len(o.keys)
        t["consecutive_skips"] = trailing if trailing < n else t["consecutive_skips"] + n
        out = []
        if rates:
            skipped = before
            for k, key in enumerate(o.keys, start=t["steps"] + 1):
                skipped += not applied[key]
                out.append(skipped / k)
        t["steps"] += n
        if o.step:
            t["last_step"] = o.step[-1]
        value = {text: None if text == "null" else float(text) for text in set(o.scale)}
        self.recent.extend((step, value[text]) for step, text in zip(o.step, o.scale, strict=True))
        return out

    def _cause(self, d: Decoded) -> str:
        if d.collapse:
            return "collapse"
        if d.dropped >= self.accumulation_steps:
            return "dropped_microbatches"
        return "nonfinite" if d.nonfinite else "overflow"

    def recent_scales(self, k: int) -> list[tuple[int, float | None]]:
        return list(self.recent)[-k:] if k > 0 else []

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "skips": dict(self.skips), "recent_scales": self.recent_scales(32)}
