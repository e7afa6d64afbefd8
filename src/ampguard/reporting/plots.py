"""The report's figures: matplotlib (Agg, no display) rendered to PNG bytes.

Long runs are thinned first (:mod:`ampguard.reporting._thin`: at most a few thousand points per
series, spikes kept by min/max envelopes); user text (layer names, precisions) is shown verbatim,
never parsed as math text.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ampguard.reporting._thin import (
    MAX_MARKERS,
    MAX_POINTS,
    bucket_columns,
    changes,
    envelope,
    pick,
    plain_text,
)
from ampguard.runlog import RunLog

if TYPE_CHECKING:  # matplotlib is imported lazily (the ``plots`` extra)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "scale_plot",
    "loss_plot",
    "heatmap_plot",
    "range_plot",
    "scale_figure",
    "loss_figure",
    "heatmap_figure",
    "range_figure",
    "HEATMAP_NOTE",
    "FIGURES",
]

_MAX_LABELS = 40
HEATMAP_NOTE = "white: zero, non-finite or not recorded"
"""What an empty heatmap cell means (said on the figure itself)."""
_MAX_STEP_TICKS = 30


def _figure(width: float = 9.0, height: float = 3.2) -> Figure:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_MAX_EVENTS = 50  # resume / fallback markers drawn (a log with more is not a training run)


def _step_axis(ax: Axes) -> None:
    """Steps are whole numbers: integer ticks only (no "2.5" on a 5-step run)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _markers(ax: Axes, run: RunLog) -> None:
    for r in run.resumes[:_MAX_EVENTS]:
        ax.axvline(int(r["step"]), color="#7b2cbf", ls="--", lw=1.2)
        ax.annotate(
            "resume",
            (int(r["step"]), 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            color="#7b2cbf",
            fontsize=8,
        )
    for f in run.fallbacks[:_MAX_EVENTS]:
        ax.axvline(int(f["step"]), color="#d00000", ls=":", lw=1.2)
        ax.annotate(
            plain_text(f"{f.get('from')}->{f.get('to')}"),
            (int(f["step"]), 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -24),
            textcoords="offset points",
            color="#d00000",
            fontsize=8,
        )


def scale_plot(run: RunLog) -> bytes | None:
    """Loss scale per step on a log2 axis, skipped steps, resumes and the safe fp16 window
    (PNG bytes of :func:`scale_figure`)."""
    fig = scale_figure(run)
    return None if fig is None else _png(fig)


def scale_figure(run: RunLog) -> Figure | None:
    """Loss scale per step on a log2 axis, skipped steps, resumes and the safe fp16 window."""
    if not len(run.steps):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    _scale_line(ax, run.steps, run.scale)
    skipped = np.flatnonzero(~run.applied)
    if len(skipped):
        shown = pick(skipped)
        label = f"skipped step ({len(skipped)}" + (
            f", {len(shown)} drawn)" if len(shown) < len(skipped) else ")"
        )
        _mark_skipped(ax, run.steps[shown], run.scale_before[shown], 22, label)
    keep = pick(np.arange(len(run.range_steps)), MAX_POINTS)
    lo, hi = run.window[keep, 0], run.window[keep, 1]
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(lo) & np.isfinite(hi) & (lo <= hi) & run.range_applied[keep]
    if finite.sum() >= 8:
        ax.fill_between(
            run.range_steps[keep][finite],
            lo[finite],
            hi[finite],
            step="mid",
            color="#2a9d8f",
            alpha=0.18,
            label="safe fp16 scale window",
        )
    elif finite.any():  # few samples: one bar each
        ax.vlines(
            run.range_steps[keep][finite],
            lo[finite],
            hi[finite],
            color="#2a9d8f",
            alpha=0.45,
            lw=5,
            label="safe fp16 scale window",
        )
    positive = run.scale[np.isfinite(run.scale) & (run.scale > 0)]
    if len(positive):
        ax.set_ylim(positive.min() / 16, positive.max() * 16)
    ax.set_yscale("log", base=2)
    _markers(ax, run)
    _step_axis(ax)
    ax.set_ylabel("loss scale")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _scale_line(ax: Axes, steps: np.ndarray, scale: np.ndarray) -> None:
    """The scale as a step line through its change points (exact), or, when even those are too
    many, the min-max band per bucket with the bucket's highest scale as the line."""
    keep = changes(scale)
    if len(keep) <= MAX_POINTS:
        ax.step(steps[keep], scale[keep], where="post", color="#1d3557", lw=1.4, label="loss scale")
        return
    env = envelope(steps, scale)
    ax.fill_between(
        env.x,
        env.lo,
        env.hi,
        step="post",
        color="#1d3557",
        alpha=0.25,
        lw=0,
        label=f"loss scale range per {len(steps) // len(env.x):,} steps",
    )
    ax.step(env.x, env.hi, where="post", color="#1d3557", lw=1.0, label="loss scale (highest)")


def loss_plot(run: RunLog) -> bytes | None:
    """Loss per step (log axis when positive), skipped steps marked
    (PNG bytes of :func:`loss_figure`)."""
    fig = loss_figure(run)
    return None if fig is None else _png(fig)


def loss_figure(run: RunLog) -> Figure | None:
    """Loss per step (log axis when positive), skipped steps marked."""
    finite = np.isfinite(run.loss)
    if not finite.any():
        return None
    fig = _figure()
    ax = fig.add_subplot()
    steps, loss = run.steps[finite], run.loss[finite]
    if len(loss) <= MAX_POINTS:
        ax.plot(steps, loss, color="#457b9d", lw=1.0, label="loss")
    else:
        env = envelope(steps, loss)
        ax.fill_between(
            env.x,
            env.lo,
            env.hi,
            color="#457b9d",
            alpha=0.3,
            lw=0,
            label=f"loss min-max per {len(loss) // len(env.x):,} steps",
        )
        ax.plot(env.x, env.mean, color="#457b9d", lw=1.0, label="loss (mean)")
    skipped = pick(np.flatnonzero(~run.applied & finite), MAX_MARKERS)
    if len(skipped):
        _mark_skipped(ax, run.steps[skipped], run.loss[skipped], 18, "skipped step")
    bad = run.loss_nonfinite  # NaN/inf losses: no point on the line, a mark along the top
    if bad.any():
        ax.scatter(
            run.steps[bad],
            np.full(int(bad.sum()), run.loss[finite].max()),
            marker="v",
            color="#9b2226",
            s=22,
            zorder=3,
            label=f"non-finite loss ({int(bad.sum())})",
        )
    if (run.loss[finite] > 0).all():
        ax.set_yscale("log")
        _plain_log_labels(ax)
    _markers(ax, run)
    _step_axis(ax)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _plain_log_labels(ax: Axes) -> None:
    """Tick labels on a log axis as plain numbers ("7", "6.9", "1e+04"), not "6.94x10^0"."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # matplotlib decides which ticks get a label; we say how
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:.{_digits(x, vmin, vmax)}g}"

    ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.4)))


def _digits(x: float, vmin: float, vmax: float) -> int:
    """Significant digits that tell ticks apart on a narrow range (10.95, 11, 11.05: not
    "11, 11, 11"): three, plus one per decade the value stands above the axis span."""
    span = abs(vmax - vmin)
    if not (span > 0 and x) or not math.isfinite(span):
        return 3
    return max(3, min(8, math.ceil(math.log10(abs(x) / span)) + 2))


def _mark_skipped(ax: Axes, x: np.ndarray, y: np.ndarray, size: float, label: str) -> None:
    """Red crosses on the skipped steps (one style in every plot)."""
    ax.scatter(x, y, marker="x", color="#e63946", s=size, zorder=3, label=label)


def _column_edges(steps: np.ndarray) -> np.ndarray:
    """Column edges halfway between sampled steps: one column per sample, even when the
    sampling is irregular (a resume, a short run sampled at steps 1..5 and 10)."""
    s = steps.astype(np.float64)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[:-1] + s[1:]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def _layer_ticks(ax: Axes, names: list[str], axis: str = "y") -> None:
    every = max(1, math.ceil(len(names) / _MAX_LABELS))
    ticks = list(range(0, len(names), every))
    labels = [plain_text(names[i]) for i in ticks]
    if axis == "y":
        ax.set_yticks(ticks, labels, fontsize=7)
    else:
        ax.set_xticks(ticks, labels, fontsize=7, rotation=60, ha="right")


def heatmap_plot(run: RunLog) -> bytes | None:
    """log10 of each layer's unscaled gradient norm over the sampled steps
    (PNG bytes of :func:`heatmap_figure`)."""
    fig = heatmap_figure(run)
    return None if fig is None else _png(fig)


def heatmap_figure(run: RunLog) -> Figure | None:
    """log10 of each layer's unscaled gradient norm over the sampled steps."""
    if not len(run.layer_steps) or not run.layers:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        data = np.log10(run.layer_norm.T)
    data[~np.isfinite(data)] = np.nan  # log10(0) = -inf: no colour, like a missing sample
    cols, data = bucket_columns(run.layer_steps, data)  # long runs: at most MAX_POINTS/2
    data = np.ma.masked_invalid(data)
    height = min(10.0, 1.6 + 0.22 * min(len(run.layers), _MAX_LABELS))
    fig = _figure(9.0, height)
    ax = fig.add_subplot()
    rows = np.arange(len(run.layers) + 1) - 0.5
    img = ax.pcolormesh(_column_edges(cols), rows, data, cmap="viridis")
    ax.set_ylim(len(run.layers) - 0.5, -0.5)  # the first layer on top
    _step_axis(ax)
    if len(run.layer_steps) <= _MAX_STEP_TICKS:  # a short run: label every sampled step
        ax.set_xticks(run.layer_steps, [str(int(s)) for s in run.layer_steps], fontsize=7)
    _layer_ticks(ax, run.layers)
    ax.set_title(HEATMAP_NOTE, fontsize=8, loc="right")
    fig.colorbar(img, ax=ax, label="log10 grad norm (unscaled)")
    return fig


def range_plot(run: RunLog) -> bytes | None:
    """Per layer at the latest clean range sample: safe scale window vs the scale in use,
    underflow share and fp16 headroom (PNG bytes of :func:`range_figure`)."""
    fig = range_figure(run)
    return None if fig is None else _png(fig)


def range_figure(run: RunLog) -> Figure | None:
    """The figure :func:`range_plot` renders, for a caller that reads its geometry: in the left
    axes, one bar per layer spanning ``[safe_lo, safe_hi]`` of the latest clean range sample
    (an open end drawn to 1 or to 256x the highest bound), the scale in use as a vertical line."""
    ok = np.flatnonzero(run.range_applied)
    if not len(ok) or not run.layers:
        return None
    k = int(ok[-1])
    n = len(run.layers)
    lo, hi = run.safe_lo[k], run.safe_hi[k]
    scale = float(run.range_scale[k])
    fig = _figure(9.0, min(10.0, 1.8 + 0.25 * min(n, _MAX_LABELS)))
    ax, ax2 = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    y = np.arange(n)
    top = np.where(np.isfinite(hi), hi, np.nanmax(np.r_[hi[np.isfinite(hi)], scale]) * 256)
    bottom = np.where(np.isfinite(lo), lo, 1.0)
    good = bottom <= top
    ax.barh(
        y[good],
        (top - bottom)[good],  # barh's width is an extent: the bar ends at left + width
        left=bottom[good],
        color="#2a9d8f",
        alpha=0.6,
        label="safe scale window",
    )
    if (~good).any():
        ax.scatter(
            np.sqrt(top * bottom)[~good],
            y[~good],
            marker="s",
            color="#e63946",
            label="empty window",
        )
    ax.axvline(scale, color="#1d3557", lw=1.5, label=f"scale in use ({scale:g})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("loss scale")
    ax.legend(loc="lower right", fontsize=7)
    ax.invert_yaxis()
    _layer_ticks(ax, run.layers)
    ax.set_title(f"step {int(run.range_steps[k])}", fontsize=9)
    under = np.nan_to_num(run.underflow[k], nan=0.0)
    ax2.barh(y, under * 100, color="#f4a261", label="underflow % (nonzero grads)")
    for i, bits in enumerate(run.headroom_bits[k][: 2 * _MAX_LABELS]):
        if np.isfinite(bits):
            ax2.annotate(
                f"{bits:.1f} bits",
                (0, i),
                xytext=(2, -3),
                textcoords="offset points",
                fontsize=7,
                color="#333",
            )
    ax2.set_xlim(0, max(5.0, float(under.max()) * 110))
    ax2.set_xlabel("% below fp16 normal  /  headroom to 65504")
    ax2.legend(loc="lower right", fontsize=7)
    return fig


FIGURES: list[tuple[str, str, Callable[[RunLog], bytes | None]]] = [
    ("scale", "Loss scale", scale_plot),
    ("loss", "Loss", loss_plot),
    ("heatmap", "Per-layer gradient norm", heatmap_plot),
    ("ranges", "fp16 range per layer: safe scale window, underflow, headroom", range_plot),
]
