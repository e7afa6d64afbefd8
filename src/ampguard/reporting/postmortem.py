"""``ampguard postmortem RUN_DIR``: the ranks' flight-recorder dumps merged into one timeline.

Each rank of a ``Guard(flight_recorder=N, telemetry=RUN_DIR)`` writes
``RUN_DIR/flight_recorder/rank<R>.json`` on a trigger (``ampguard.guard._recorder``). This module
reads them back (schema-checked: a missing, unreadable or malformed dump is one
:class:`PostmortemError` naming the file and the field), finds the first window where something
went wrong on any rank (a loss spike, non-finite loss or gradients, a skipped window) and the
layer whose gradient norm jumped most there, and renders the windows around it, one column per
rank, with the largest per-module output amax of the sampled windows nearest it (the same
as a panel of ``report.html``: :mod:`ampguard.reporting._spikes`). :func:`signal_read` is the
autopsy's reading of the recorded signals (also the one ``ampguard.autopsy`` falls back to
when it cannot replay). Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampguard.runlog import (
    FLIGHT_RECORDER_DIR,
    FLIGHT_RECORDER_KIND,
    FLIGHT_RECORDER_VERSION,
    TRIAGE_DIR,
    TRIAGE_KIND,
    TRIAGE_VERSION,
    RunFolderError,
    read_json,
)

__all__ = [
    "PostmortemError",
    "Postmortem",
    "amax_around",
    "layer_kind",
    "layer_of",
    "load",
    "signal_read",
    "text",
    "timeline",
]

_ATTENTION = ("q_proj", "k_proj", "qkv", "query", "key", "c_attn", "attn", "attention")
_NOT_LOGITS = ("v_proj", "value", "o_proj", "out_proj", "c_proj", "dense", "proj", "wo")
_OUTPUT = ("lm_head", "head", "output", "classifier", "logits", "unembed")
_ROW_FIELDS: dict[str, Any] = {"step": int, "loss": (int, float, type(None)), "grad_norm": list}
# optional row fields: numbers (or null) and lists of them; a dump of an older ampguard may
# lack them, never hold them in another shape
_ROW_NUMBERS = ("bound", "level", "spike", "status", "scale")
_ROW_LISTS = ("grad_norm", "lr", "update_ratio", "amax")


class PostmortemError(ValueError):
    """A run folder without usable flight-recorder dumps (the message names the file)."""


@dataclass
class Postmortem:
    """The merged dumps: ``ranks`` (rank -> dump), the first bad window and its layer."""

    run_dir: Path
    ranks: dict[int, dict[str, Any]]
    first_step: int | None = None
    first_rank: int | None = None
    what: str = ""
    layer: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    triage: list[dict[str, Any]] = field(default_factory=list)  # ag.triage's events, all ranks


def _check(path: Path, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("kind") != FLIGHT_RECORDER_KIND:
        raise PostmortemError(f"{path}: not an ampguard flight-recorder dump (no kind field)")
    if data.get("version") != FLIGHT_RECORDER_VERSION:
        raise PostmortemError(
            f"{path}: dump version {data.get('version')!r}, this ampguard reads "
            f"{FLIGHT_RECORDER_VERSION}"
        )
    top: tuple[tuple[str, type], ...] = (
        ("rank", int),
        ("step", int),
        ("names", list),
        ("rows", list),
    )
    for key, kind in top:
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            raise PostmortemError(f"{path}: field {key!r} must be a {kind.__name__}")
    modules = data.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise PostmortemError(f"{path}: field 'modules' must be a list of module names")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            raise PostmortemError(f"{path}: rows[{i}] must be an object")
        for key, kind in _ROW_FIELDS.items():
            if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
                raise PostmortemError(f"{path}: rows[{i}].{key} is missing or malformed")
        for key in _ROW_NUMBERS:
            if not _number_or_none(row.get(key)):
                raise PostmortemError(f"{path}: rows[{i}].{key} must be a number or null")
        for key in _ROW_LISTS:
            v = row.get(key, [])
            if not isinstance(v, list) or not all(_number_or_none(x) for x in v):
                raise PostmortemError(f"{path}: rows[{i}].{key} must be a list of numbers or null")
    spikes = data.get("spikes", [])
    if not isinstance(spikes, list) or not all(
        isinstance(e, dict) and isinstance(e.get("step"), int) for e in spikes
    ):
        raise PostmortemError(f"{path}: field 'spikes' must be a list of objects with an int step")
    return data


def _number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def load(run_dir: str | Path) -> Postmortem:
    """Read and merge the dumps of ``run_dir``. ``PostmortemError`` naming what is missing or
    malformed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PostmortemError(f"{run_dir}: no such run folder")
    folder = run_dir / FLIGHT_RECORDER_DIR
    paths = sorted(folder.glob("rank*.json")) if folder.is_dir() else []
    if not paths:
        raise PostmortemError(
            f"{folder}: no flight-recorder dumps (a Guard(flight_recorder=N, telemetry=RUN_DIR) "
            "writes them on a spike, a non-finite step or an error)"
        )
    ranks: dict[int, dict[str, Any]] = {}
    for path in paths:
        try:
            data = read_json(path)  # regular files only: a FIFO in its place never blocks
        except RunFolderError as err:
            raise PostmortemError(f"{path}: unreadable dump ({err})") from None
        data = _check(path, data)
        ranks[data["rank"]] = data
    pm = Postmortem(run_dir, dict(sorted(ranks.items())))
    _first(pm)
    pm.triage = _triage(run_dir / TRIAGE_DIR)
    return pm


def _triage(folder: Path) -> list[dict[str, Any]]:
    """The events ``ag.triage`` wrote (``triage/rank<R>.json``), one per step (the ranks agree)."""
    by_step: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            data = read_json(path)
        except RunFolderError as err:
            raise PostmortemError(f"{path}: unreadable triage file ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != TRIAGE_KIND:
            raise PostmortemError(f"{path}: not an ampguard triage file (no kind field)")
        if data.get("version") != TRIAGE_VERSION or not isinstance(data.get("events"), list):
            raise PostmortemError(f"{path}: field 'version' or 'events' is malformed")
        for e in data["events"]:
            if not isinstance(e, dict) or not isinstance(e.get("step"), int):
                raise PostmortemError(f"{path}: an event without an int 'step'")
            by_step.setdefault(e["step"], e)
    return [by_step[s] for s in sorted(by_step)]


def _bad(row: dict[str, Any]) -> tuple[int, str] | None:
    """``(priority, what)`` for a window that went wrong on this rank: its own signal (0) before
    a skip it only agreed to (1: another rank's spike or non-finite gradients)."""
    if row.get("spike") == 1.0:
        return 0, "loss spike"
    if row.get("loss") is None:
        return 0, "non-finite loss"
    if row.get("status") not in (0.0, None):
        return 1, "skipped (grads or a peer)"
    return None


def _first(pm: Postmortem) -> None:
    best: tuple[int, int, int, str] | None = None
    for rank, dump in pm.ranks.items():
        for row in dump["rows"]:
            bad = _bad(row)
            if bad is None:
                continue
            key = (row["step"], bad[0], rank, bad[1])
            if best is None or key < best:
                best = key
    if best is None:
        return
    pm.first_step, _, pm.first_rank, pm.what = best
    dump = pm.ranks[pm.first_rank]
    rows = {r["step"]: r for r in dump["rows"]}
    _, layer, evidence = signal_read(rows, dump["names"], best[0], None)
    pm.layer, pm.evidence = layer, evidence


def amax_around(pm: Postmortem, top: int = 3) -> list[tuple[int, list[tuple[str, float]]]]:
    """The first bad rank's sampled per-module output amax nearest the first bad window: the
    last sampled window at or before it and the first after it, each as ``(step, [(module,
    amax)...])`` with its ``top`` largest modules (largest first); [] when none was sampled."""
    if pm.first_rank is None or pm.first_step is None:
        return []
    dump = pm.ranks[pm.first_rank]
    modules = dump.get("modules") or []
    sampled = [r for r in dump["rows"] if any(v is not None for v in r.get("amax") or [])]
    before = [r for r in sampled if r["step"] <= pm.first_step][-1:]
    after = [r for r in sampled if r["step"] > pm.first_step][:1]
    out = []
    for row in before + after:
        vals = [(m, v) for m, v in zip(modules, row["amax"], strict=False) if v is not None]
        vals.sort(key=lambda mv: -mv[1])
        out.append((row["step"], vals[:top]))
    return out


def layer_of(name: str) -> str:
    """The module name of parameter ``name`` (``"blocks.0.attn.weight"`` -> ``"blocks.0.attn"``)."""
    return name.rsplit(".", 1)[0] if "." in name else name


def layer_kind(layer: str | None, last: str | None) -> str:
    """The mechanism a layer's own outlier update points to, by the layer's name."""
    if layer is None:
        return "update_outlier"
    leaf = layer.lower().split(".")[-1]
    attention = any(k in leaf for k in _ATTENTION) or ".attn" in layer.lower()
    if attention and leaf not in _NOT_LOGITS:  # the value/output projections make no logits
        return "attention_logit_growth"
    if layer == last or leaf in _OUTPUT:
        return "output_logit_divergence"
    return "update_outlier"


def signal_read(
    rows: dict[int, dict[str, Any]], names: list[str], step: int, last_layer: str | None
) -> tuple[str, str | None, dict[str, Any]]:
    """``(mechanism, layer, evidence)`` read from the recorded rows alone: the parameter whose
    gradient norm at ``step`` jumped most over its median of the 32 windows before; when every
    layer jumped alike (the largest jump under 4x the median jump) the batch is the suspect."""
    row = rows.get(step)
    if row is None:
        return "unknown", None, {"signals": "the spike's window is no longer recorded"}
    earlier = [rows[s]["grad_norm"] for s in sorted(rows) if s < step][-32:]
    ratios = []
    for j, g in enumerate(row["grad_norm"]):
        hist = sorted(v[j] for v in earlier if j < len(v) and v[j] is not None)
        base = hist[len(hist) // 2] if hist else None
        ratios.append(g / base if g is not None and base else (math.inf if g is None else 0.0))
    if not ratios or not names:
        return "unknown", None, {"signals": "no gradient norms recorded"}
    j = max(range(len(ratios)), key=lambda i: ratios[i])
    median = sorted(ratios)[len(ratios) // 2]
    evidence = {
        "grad_norm_jump": {names[j]: _round(ratios[j]), "median": _round(median)},
    }
    if math.isfinite(ratios[j]) and median > 0 and ratios[j] < 4 * median:
        return "outlier_batch", None, evidence
    layer = layer_of(names[j])
    return layer_kind(layer, last_layer), layer, evidence


def _round(v: float) -> float | None:
    return round(v, 3) if math.isfinite(v) else None


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"


def timeline(pm: Postmortem, around: int = 5) -> list[tuple[int, list[tuple[Any, str]]]]:
    """The windows within ``around`` of the first bad one, each as ``(step, [(loss, flag)
    per rank])`` (flag "" for a clean window, loss None where not recorded or non-finite);
    [] when nothing went wrong."""
    if pm.first_step is None:
        return []
    steps = sorted({r["step"] for d in pm.ranks.values() for r in d["rows"]})
    by_rank = {r: {row["step"]: row for row in d["rows"]} for r, d in pm.ranks.items()}
    out = []
    for s in (s for s in steps if abs(s - pm.first_step) <= around):
        cells = []
        for r in pm.ranks:
            row = by_rank[r].get(s)
            bad = None if row is None else _bad(row)
            cells.append((None if row is None else row.get("loss"), "" if bad is None else bad[1]))
        out.append((s, cells))
    return out


def text(pm: Postmortem, *, around: int = 5, autopsy: bool = False) -> str:
    """The timeline as text: the first bad window and its layer, then ``around`` windows either
    side with every rank's loss and flags."""
    steps = sorted({r["step"] for d in pm.ranks.values() for r in d["rows"]})
    lines = [
        f"ampguard postmortem {pm.run_dir}: {len(pm.ranks)} rank(s), windows "
        f"{steps[0] if steps else '-'}..{steps[-1] if steps else '-'}; dumped on "
        + ", ".join(
            f"rank {r}: {d.get('trigger')} at step {d['step']}" for r, d in pm.ranks.items()
        )
    ]
    if pm.first_step is None:
        lines.append("nothing went wrong in the recorded windows")
        return "\n".join(lines)
    where = f" in layer {pm.layer!r}" if pm.layer else ""
    jump = pm.evidence.get("grad_norm_jump")
    lines.append(
        f"first: rank {pm.first_rank}, step {pm.first_step}: {pm.what}{where}"
        + (f" (gradient norm jump {jump})" if jump else "")
    )
    header = "  step " + "".join(f"  {f'rank{r} loss':>10}  {'flags':<24}" for r in pm.ranks)
    lines.append(header)
    for s, cells in timeline(pm, around):
        mark = ">" if s == pm.first_step else " "
        lines.append(
            f"{mark}{s:>5} "
            + "".join(f"  {_num(loss):>10}  {flag[:24]:<24}" for loss, flag in cells)
        )
    for step, vals in amax_around(pm):
        lines.append(
            f"output amax (rank {pm.first_rank}, sampled step {step}): "
            + ", ".join(f"{m} {v:.4g}" for m, v in vals)
        )
    for e in pm.triage:
        where = " ".join(
            p
            for p in (
                f"module {e.get('module')!r}" if e.get("module") is not None else "",
                f"op {e.get('op')}" if e.get("op") else "",
                f"in {e.get('phase')}" if e.get("phase") else "",
            )
            if p
        )
        lines.append(
            f"triage (step {e['step']}, rank {e.get('rank')}): {e.get('cause')}"
            + (f" at {where}" if where else "")
            + f" [{e.get('code')}]"
        )
    if autopsy:
        for r, d in pm.ranks.items():
            rows = {row["step"]: row for row in d["rows"]}
            for spike in d.get("spikes") or []:
                mech, layer, ev = signal_read(rows, d["names"], spike["step"], None)
                lines.append(
                    f"autopsy (rank {r}, step {spike['step']}): {mech}"
                    + (f" in {layer!r}" if layer else "")
                    + f" {ev.get('grad_norm_jump', '')} -- read from the recorded signals, "
                    "not verified (a counterfactual replay needs the live Guard: "
                    "ampguard.autopsy(guard))"
                )
    return "\n".join(lines)
