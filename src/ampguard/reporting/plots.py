"""The report's figures: matplotlib (Agg, no display) rendered to PNG bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np

from ampguard.runlog import RunLog

__all__ = ["scale_plot", "loss_plot", "heatmap_plot", "range_plot", "FIGURES"]

_MAX_LABELS = 40


def _figure(width: float = 9.0, height: float = 3.2):  # noqa: ANN202 - matplotlib types
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig) -> bytes:  # noqa: ANN001
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _markers(ax, run: RunLog) -> None:  # noqa: ANN001
    for r in run.resumes:
        ax.axvline(int(r["step"]), color="#7b2cbf", ls="--", lw=1.2)
        ax.annotate("resume", (int(r["step"]), 1.0), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", color="#7b2cbf", fontsize=8)
    for f in run.fallbacks:
        ax.axvline(int(f["step"]), color="#d00000", ls=":", lw=1.2)
        ax.annotate(f"{f.get('from')}->{f.get('to')}", (int(f["step"]), 1.0),
                    xycoords=("data", "axes fraction"), xytext=(3, -24),
                    textcoords="offset points", color="#d00000", fontsize=8)


def scale_plot(run: RunLog) -> bytes | None:
    """Loss scale per step on a log2 axis, skipped steps, resumes and the safe fp16 window."""
    if not len(run.steps):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.step(run.steps, run.scale, where="post", color="#1d3557", lw=1.4, label="loss scale")
    skipped = ~run.applied
    if skipped.any():
        ax.scatter(run.steps[skipped], run.scale_before[skipped], marker="x", color="#e63946",
                   s=22, zorder=3, label=f"skipped step ({int(skipped.sum())})")
    lo, hi = run.window[:, 0], run.window[:, 1]
    finite = np.isfinite(lo) & np.isfinite(hi) & (lo <= hi) & run.range_applied
    if finite.sum() >= 8:
        ax.fill_between(run.range_steps[finite], lo[finite], hi[finite], step="mid",
                        color="#2a9d8f", alpha=0.18, label="safe fp16 scale window")
    elif finite.any():  # few samples: one bar each
        ax.vlines(run.range_steps[finite], lo[finite], hi[finite], color="#2a9d8f", alpha=0.45,
                  lw=5, label="safe fp16 scale window")
    positive = run.scale[np.isfinite(run.scale) & (run.scale > 0)]
    if len(positive):
        ax.set_ylim(positive.min() / 16, positive.max() * 16)
    ax.set_yscale("log", base=2)
    _markers(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def loss_plot(run: RunLog) -> bytes | None:
    """Loss per step (log axis when positive), skipped steps marked."""
    finite = np.isfinite(run.loss)
    if not finite.any():
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(run.steps[finite], run.loss[finite], color="#457b9d", lw=1.0, label="loss")
    skipped = ~run.applied & finite
    if skipped.any():
        ax.scatter(run.steps[skipped], run.loss[skipped], marker="x", color="#e63946", s=18,
                   zorder=3, label="skipped step")
    if (run.loss[finite] > 0).all():
        ax.set_yscale("log")
    _markers(ax, run)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def _layer_ticks(ax, names: list[str], axis: str = "y") -> None:  # noqa: ANN001
    every = max(1, math.ceil(len(names) / _MAX_LABELS))
    ticks = list(range(0, len(names), every))
    labels = [names[i] for i in ticks]
    if axis == "y":
        ax.set_yticks(ticks, labels, fontsize=7)
    else:
        ax.set_xticks(ticks, labels, fontsize=7, rotation=60, ha="right")


def heatmap_plot(run: RunLog) -> bytes | None:
    """log10 of each layer's unscaled gradient norm over the sampled steps."""
    if not len(run.layer_steps) or not run.layers:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        data = np.log10(run.layer_norm.T)
    data = np.ma.masked_invalid(data)
    height = min(10.0, 1.6 + 0.22 * min(len(run.layers), _MAX_LABELS))
    fig = _figure(9.0, height)
    ax = fig.add_subplot()
    first, last = int(run.layer_steps[0]), int(run.layer_steps[-1])
    img = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis",
                    extent=(first - 0.5, last + 0.5, len(run.layers) - 0.5, -0.5))
    _layer_ticks(ax, run.layers)
    ax.set_xlabel("step")
    fig.colorbar(img, ax=ax, label="log10 grad norm (unscaled)")
    return _png(fig)


def range_plot(run: RunLog) -> bytes | None:
    """Per layer at the latest clean range sample: safe scale window vs the scale in use,
    underflow share and fp16 headroom."""
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
    ax.barh(y[good], (top / bottom)[good], left=bottom[good], color="#2a9d8f", alpha=0.6,
            label="safe scale window")
    if (~good).any():
        ax.scatter(np.sqrt(top * bottom)[~good], y[~good], marker="s", color="#e63946",
                   label="empty window")
    ax.axvline(scale, color="#1d3557", lw=1.5, label=f"scale in use ({scale:g})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("loss scale")
    ax.legend(loc="lower right", fontsize=7)
    ax.invert_yaxis()
    _layer_ticks(ax, run.layers)
    ax.set_title(f"step {int(run.range_steps[k])}", fontsize=9)
    under = np.nan_to_num(run.underflow[k], nan=0.0)
    ax2.barh(y, under * 100, color="#f4a261", label="underflow % (nonzero grads)")
    for i, bits in enumerate(run.headroom_bits[k]):
        if np.isfinite(bits):
            ax2.annotate(f"{bits:.1f} bits", (0, i), xytext=(2, -3), textcoords="offset points",
                         fontsize=7, color="#333")
    ax2.set_xlim(0, max(5.0, float(under.max()) * 110))
    ax2.set_xlabel("% below fp16 normal  /  headroom to 65504")
    ax2.legend(loc="lower right", fontsize=7)
    return _png(fig)


FIGURES: list[tuple[str, str, Callable[[RunLog], bytes | None]]] = [
    ("scale", "Loss scale", scale_plot),
    ("loss", "Loss", loss_plot),
    ("heatmap", "Per-layer gradient norm", heatmap_plot),
    ("ranges", "fp16 range per layer: safe scale window, underflow, headroom", range_plot),
]
