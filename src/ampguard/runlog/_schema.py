"""The run folder's schema: every record kind of ``events.jsonl``, every field, its type.

This module owns the shape of what :class:`ampguard.Telemetry` writes; every reader goes through
it (``runlog.load_run``, the rules, the report, the summary, attach mode). The rule:

- ``events.jsonl``: one JSON object per line. A line that is not one, or whose known field has
  the wrong type, is skipped with one ``RuntimeWarning`` naming the file, the line and the field
  (at most :data:`MAX_WARNINGS` such warnings per file, then one with the count). Unknown fields
  and unknown event kinds are kept and ignored (newer writers may add them).
- ``meta.json`` / ``findings.json``: a file that cannot be used (bad JSON, not a JSON object /
  list, a folder in place of the file, unreadable) raises :class:`RunFolderError` naming it. A
  ``meta.json`` field of the wrong type is dropped with a warning (its default is used).

Record kinds (``kind`` absent means ``"step"``):

========  ==================================================================================
step      ``step`` int (required); ``scale_before``, ``scale``, ``loss``, ``grad_norm``: number
          or null; ``loss_nonfinite``: "nan" | "inf" | "-inf" (why ``loss`` is null);
          ``applied``, ``overflow``, ``collapse``: bool; ``dropped``: int >= 0; ``precision``:
          str; ``overflowed``: list of int; ``layers``: {``grad_norm``: list of number|null, one
          per layer}; ``range``: {``zero_frac``, ``amax``, ``headroom_bits``, ``underflow``,
          ``safe_lo``, ``safe_hi``: list of number|null, one per layer; ``window``: [lo, hi]}
resume    ``step`` int (required); ``scale``, ``previous_scale``: number or null;
          ``scale_reset``: bool; ``time``: str
fallback  ``step`` int (required); ``from``, ``to``: str
finding   ``step`` int or null; ``finding``: a :class:`ampguard.Finding` as a dict (required)
unrecorded  steps a failed write kept out of the log: ``step`` (the first) and ``last`` int
          (required), ``records``: int, ``reason`` (e.g. "disk full"), ``error``, ``file``: str
fp8_res.. ``fp8_rescue``: ``step`` int, ``module``, ``field``: str (required); ``value``,
          ``limit``: number or null (a layer moved from fp8 back to bf16, AG113)
absorbed  ``step`` int (required); ``modules``: {module name: ops that made inf/NaN from finite
          inputs in fp16/bf16 on that range-sampled window} (required)
fp8       ``step`` int (required); ``layers`` (required): {layer name: {``input_amax``,
          ``input_flushed``, ``weight_amax``, ``weight_flushed``, ``grad_amax``,
          ``grad_flushed``: number or null}} (:data:`FP8_FIELDS`)
========  ==================================================================================

``meta.json["fp8"]`` (precision="fp8" runs): ``recipe`` str, ``emulated`` bool, ``converted`` and
``kept_bf16`` lists of str, ``plan`` {layer: JSON object}, ``layers`` {layer: a sample as in an
``fp8`` record, plus its ``step``}; a field of the wrong shape is dropped with a warning.

Reading the files themselves (regular files only, errors naming them) is
:mod:`ampguard.runlog._files`. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

from ampguard._util.stack import user_stacklevel
from ampguard.findings import SEVERITIES
from ampguard.findings.codes import CATALOGUE

__all__ = [
    "RunFolderError",
    "MAX_WARNINGS",
    "LineWarnings",
    "STEP_FIELDS",
    "EVENT_FIELDS",
    "RANGE_FIELDS",
    "FP8_FIELDS",
    "META_FIELDS",
    "NONFINITE",
    "check_record",
    "check_meta",
    "check_finding",
    "coverage_ok",
    "parse_line",
]

MAX_WARNINGS = 10
NONFINITE = ("nan", "inf", "-inf")
_MAX_LINE = 64 * 2**20  # a longer line is not a record ampguard wrote
_decode = json.JSONDecoder().decode


class RunFolderError(ValueError):
    """A run-folder file that cannot be used; the message names the file and what is wrong."""


# ---------------------------------------------------------------------- field types
_BIG = 2**53  # larger integers are not something ampguard writes (and may not fit a float)


def _int(v: Any) -> bool:
    return type(v) is int and -_BIG <= v <= _BIG


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _BIG


def _num(v: Any) -> bool:
    return v is None or type(v) is float or (type(v) is int and -_BIG <= v <= _BIG)


def _number(v: Any) -> bool:
    return type(v) is float or (type(v) is int and -_BIG <= v <= _BIG)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _str(v: Any) -> bool:
    return type(v) is str


def _opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _nums(v: Any) -> bool:
    return type(v) is list and all(x is None or type(x) is float or _int(x) for x in v)


def _ints(v: Any) -> bool:
    return type(v) is list and all(_int(x) for x in v)


def _nonfinite(v: Any) -> bool:
    return v in NONFINITE if type(v) is str else False


def _dict(v: Any) -> bool:
    return type(v) is dict


def _list(v: Any) -> bool:
    return type(v) is list


_Check = Callable[[Any], bool]
_WHAT: dict[_Check, str] = {
    _int: "an integer",
    _count: "an integer >= 0",
    _num: "a number or null",
    _number: "a number",
    _bool: "true or false",
    _str: "a string",
    _opt_str: "a string or null",
    _opt_int: "an integer or null",
    _nums: "a list of numbers or nulls",
    _ints: "a list of integers",
    _nonfinite: 'one of "nan", "inf", "-inf"',
    _dict: "a JSON object",
    _list: "a list",
}

# field -> (check, required)
STEP_FIELDS: dict[str, tuple[_Check, bool]] = {
    "step": (_int, True),
    "scale_before": (_num, False),
    "scale": (_num, False),
    "applied": (_bool, False),
    "overflow": (_bool, False),
    "collapse": (_bool, False),
    "dropped": (_count, False),
    "nonfinite": (_bool, False),
    "loss": (_num, False),
    "loss_nonfinite": (_nonfinite, False),
    "grad_norm": (_num, False),
    "precision": (_str, False),
    "overflowed": (_ints, False),
    "layers": (_dict, False),
    "range": (_dict, False),
}
RANGE_FIELDS = ("zero_frac", "amax", "headroom_bits", "underflow", "safe_lo", "safe_hi")
# the figures of one fp8 layer sample (ampguard.fp8._stats.FIELDS; this module imports no torch)
FP8_FIELDS = (
    "input_amax",
    "input_flushed",
    "weight_amax",
    "weight_flushed",
    "grad_amax",
    "grad_flushed",
)
_FINDING_FIELDS: dict[str, tuple[_Check, bool]] = {
    "code": (_str, True),
    "severity": (_str, True),
    "title": (_str, True),
    "message": (_str, True),
    "step": (_opt_int, False),
    "evidence": (_dict, False),
    "fix": (_str, False),
    "path": (_opt_str, False),
    "line": (_opt_int, False),
    "col": (_opt_int, False),
}
EVENT_FIELDS: dict[str, dict[str, tuple[_Check, bool]]] = {
    "resume": {
        "step": (_int, True),
        "scale": (_num, False),
        "previous_scale": (_num, False),
        "scale_reset": (_bool, False),
        "time": (_str, False),
    },
    "fallback": {"step": (_int, True), "from": (_str, False), "to": (_str, False)},
    "finding": {"step": (_opt_int, False), "finding": (_dict, True)},
    "unrecorded": {
        "step": (_int, True),
        "last": (_int, True),
        "records": (_int, False),
        "reason": (_str, False),
        "error": (_str, False),
        "file": (_str, False),
    },
    "fp8_rescue": {
        "step": (_int, True),
        "module": (_str, True),
        "field": (_str, True),
        "value": (_num, False),
        "limit": (_num, False),
    },
    # fp16 ops that made inf/NaN inside a module on a range-sampled window (AG170)
    "absorbed": {"step": (_int, True), "modules": (_dict, True)},
    "fp8": {"step": (_int, True), "layers": (_dict, True)},
}
# meta.json: dotted field -> check (a wrong one is dropped with a warning)
META_FIELDS: dict[str, _Check] = {
    "format": _int,
    "ampguard_version": _str,
    "torch_version": _str,
    "python": _str,
    "platform": _str,
    "start_time": _str,
    "end_time": _str,
    "device": _str,
    "model": _dict,
    "model.class": _str,
    "model.parameters": _int,
    "model.trainable_tensors": _int,
    "model.layers": _int,
    "layers": _dict,
    "layers.names": lambda v: type(v) is list and all(type(x) is str for x in v),
    "layers.numel": lambda v: type(v) is list and all(_opt_int(x) for x in v),
    "precision": _str,
    "requested_precision": _opt_str,
    "scaler": _dict,
    "scaler.init_scale": _number,
    "scaler.min_scale": _number,
    "scaler.growth_interval": _int,
    "scaler.dynamic": _bool,
    "guard": _dict,
    "guard.accumulation_steps": lambda v: type(v) is int and v >= 1,
    "telemetry": _dict,
    "resumes": _list,
    "diagnostics": _dict,
    "diagnostics.fallbacks": lambda v: type(v) is list and all(type(x) is dict for x in v),
    "unrecorded": _dict,  # Telemetry: what a full disk kept out of the log (gaps, counts)
    "fp8": _dict,
    "fp8.recipe": _str,
    "fp8.emulated": _bool,
    "fp8.converted": lambda v: type(v) is list and all(type(x) is str for x in v),
    "fp8.kept_bf16": lambda v: type(v) is list and all(type(x) is str for x in v),
    "fp8.plan": lambda v: type(v) is dict and all(type(x) is dict for x in v.values()),
    "fp8.layers": lambda v: (
        type(v) is dict
        and all(_fp8_sample(x, "", extra={"step": _opt_int}) is None for x in v.values())
    ),
}
_WHAT.update(
    {
        META_FIELDS["layers.names"]: "a list of strings",
        META_FIELDS["layers.numel"]: "a list of integers or nulls",
        META_FIELDS["guard.accumulation_steps"]: "an integer >= 1",
        META_FIELDS["diagnostics.fallbacks"]: "a list of JSON objects",
        META_FIELDS["fp8.converted"]: "a list of strings",
        META_FIELDS["fp8.kept_bf16"]: "a list of strings",
        META_FIELDS["fp8.plan"]: "a JSON object of JSON objects (one per layer)",
        META_FIELDS["fp8.layers"]: "a JSON object of fp8 samples (one per layer: numbers or nulls)",
    }
)


def _what(check: _Check) -> str:
    return _WHAT.get(check, "of another type")


# ---------------------------------------------------------------------- warnings
class LineWarnings:
    """At most ``limit`` warnings about one file, then one with the count of the rest."""

    def __init__(self, path: str | os.PathLike, limit: int = MAX_WARNINGS) -> None:
        self.path, self.limit, self.count = str(path), limit, 0

    def warn(self, where: str, problem: str) -> None:
        self.count += 1
        if self.count <= self.limit:
            warnings.warn(
                f"{self.path}: {where}: {problem}; skipped",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def close(self) -> None:
        if self.count > self.limit:
            warnings.warn(
                f"{self.path}: {self.count - self.limit} more malformed line(s) or "
                f"field(s) skipped ({self.count} in all)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )


# ---------------------------------------------------------------------- events.jsonl lines
def parse_line(line: bytes) -> dict[str, Any] | str:
    """The JSON object on ``line``, or a string saying why it is not one."""
    if len(line) > _MAX_LINE:
        return f"longer than {_MAX_LINE >> 20} MiB"
    try:
        rec = _decode(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        return f"not JSON ({str(exc).splitlines()[0][:80]})"
    except RecursionError:
        return "JSON nested too deeply"
    if type(rec) is not dict:
        return f"a JSON {type(rec).__name__}, not an object"
    return rec


def _fields(
    rec: dict[str, Any], spec: dict[str, tuple[_Check, bool]], prefix: str = ""
) -> str | None:
    for key, (check, required) in spec.items():
        if key in rec:
            if not check(rec[key]):
                return f"field {prefix}{key!r} must be {_what(check)}, got {_short(rec[key])}"
        elif required:
            return f"field {prefix}{key!r} is missing"
    return None


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def check_record(rec: dict[str, Any], width: int) -> str | None:
    """``None`` when ``rec`` follows the schema (``width`` layers), else what is wrong.

    Unknown kinds pass (their fields are not read). Cost: proportional to the record's size.
    """
    kind = rec.get("kind", "step")
    if kind == "step":
        bad = _step_values(rec) if _step_types_ok(rec) else _fields(rec, STEP_FIELDS)
        if bad is None and "layers" in rec:
            bad = _per_layer(rec["layers"], ("grad_norm",), width, "layers.")
        if bad is None and "range" in rec:
            bad = _range(rec["range"], width)
        return bad
    if type(kind) is not str:
        return f"field 'kind' must be a string, got {_short(kind)}"
    spec = EVENT_FIELDS.get(kind)
    if spec is None:
        return None
    bad = _fields(rec, spec)
    if bad is None and kind == "finding":
        bad = _finding(rec["finding"], "finding.")
    if bad is None and kind == "fp8":
        for name, sample in rec["layers"].items():
            bad = _fp8_sample(sample, f"layers.{name}.")
            if bad is not None:
                break
    return bad


def _fp8_sample(sample: Any, prefix: str, extra: dict[str, _Check] | None = None) -> str | None:
    """``None`` when ``sample`` is one fp8 layer sample ({:data:`FP8_FIELDS`: number or null})."""
    if type(sample) is not dict:
        where = prefix.rstrip(".")
        return f"field {where!r} must be a JSON object (one layer's sample), got {_short(sample)}"
    checks = {**dict.fromkeys(FP8_FIELDS, _num), **(extra or {})}
    for key, check in checks.items():
        if key in sample and not check(sample[key]):
            return f"field {prefix + key!r} must be {_what(check)}, got {_short(sample[key])}"
    return None


# Fast path for step records: the verdict on a record's (keys, value types) signature is cached,
# so a million records of the one shape ampguard writes cost one dict lookup each for the types,
# then the few value checks below.
_NONE = type(None)
_STEP_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "scale_before": (float, _NONE),
    "scale": (float, _NONE),
    "loss": (float, _NONE),
    "grad_norm": (float, _NONE),
    "applied": (bool,),
    "overflow": (bool,),
    "collapse": (bool,),
    "nonfinite": (bool,),
    "dropped": (int,),
    "precision": (str,),
    "loss_nonfinite": (str,),
    "overflowed": (list,),
    "layers": (dict,),
    "range": (dict,),
    "kind": (str,),
}
_SIGNATURES: dict[tuple[tuple[str, ...], tuple[type, ...]], bool] = {}


def _step_types_ok(rec: dict[str, Any]) -> bool:
    sig = (tuple(rec), tuple(map(type, rec.values())))
    ok = _SIGNATURES.get(sig)
    if ok is None:
        ok = "step" in rec and all(t in _STEP_TYPES.get(k, (t,)) for k, t in zip(*sig, strict=True))
        if len(_SIGNATURES) < 4096:  # a hostile file must not grow the cache without bound
            _SIGNATURES[sig] = ok
    return ok


def _step_values(rec: dict[str, Any]) -> str | None:
    """The value checks :func:`_fields` would make, for a record whose types are right."""
    if not -_BIG <= rec["step"] <= _BIG:
        return _fields(rec, STEP_FIELDS)
    if not 0 <= rec.get("dropped", 0) <= _BIG:
        return _fields(rec, STEP_FIELDS)
    if "loss_nonfinite" in rec and rec["loss_nonfinite"] not in NONFINITE:
        return _fields(rec, STEP_FIELDS)
    if "overflowed" in rec and not _ints(rec["overflowed"]):
        return _fields(rec, STEP_FIELDS)
    return None


def _per_layer(group: dict[str, Any], keys: tuple[str, ...], width: int, prefix: str) -> str | None:
    for key in keys:
        values: Any = group.get(key)
        if not _nums(values):
            return f"field {prefix}{key!r} must be a list of numbers or nulls, got {_short(values)}"
        if len(values) != width:
            return f"field {prefix}{key!r} has {len(values)} values for {width} layer(s)"
    return None


def _range(group: dict[str, Any], width: int) -> str | None:
    bad = _per_layer(group, RANGE_FIELDS, width, "range.")
    if bad is None:
        window: Any = group.get("window")
        if not (_nums(window) and len(window) == 2):
            bad = f"field 'range.window' must be [lo, hi] (numbers or nulls), got {_short(window)}"
    return bad


_MAX_DEPTH = 64  # JSON nested deeper is not something ampguard writes; rendering it would recurse


def _too_deep(value: Any, limit: int = _MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists/objects more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict:
            item = list(item.values())
        if type(item) is list:
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in item if type(v) in (list, dict))
    return False


def _finding(data: dict[str, Any], prefix: str) -> str | None:
    bad = _fields(data, _FINDING_FIELDS, prefix)
    if bad is None and _too_deep(data.get("evidence")):
        bad = f"field {prefix}'evidence' is nested more than {_MAX_DEPTH} deep"
    if bad is None and data["severity"] not in SEVERITIES:
        bad = (
            f"field {prefix}'severity' must be one of {', '.join(SEVERITIES)}, got "
            f"{_short(data['severity'])}"
        )
    if bad is None and data["code"] not in CATALOGUE:
        bad = f"field {prefix}'code' must be a catalogued 'AGnnn' code, got {_short(data['code'])}"
    return bad


def check_meta(meta: dict[str, Any], note: LineWarnings) -> None:
    """Drop (with a warning) every ``meta.json`` field that does not follow :data:`META_FIELDS`
    or nests too deeply; keep the resumes that follow the ``resume`` record's schema."""
    for key in [k for k, v in meta.items() if _too_deep(v)]:
        note.warn(f"field {key!r}", f"is nested more than {_MAX_DEPTH} deep")
        del meta[key]
    for dotted, check in META_FIELDS.items():
        *parents, key = dotted.split(".")
        holder = meta.get(parents[0]) if parents else meta
        if type(holder) is dict and key in holder and not check(holder[key]):
            note.warn(f"field {dotted!r}", f"must be {_what(check)}, got {_short(holder[key])}")
            del holder[key]
    layers = meta.get("layers")
    if (
        type(layers) is dict
        and "numel" in layers
        and len(layers["numel"]) != len(layers.get("names") or [])
    ):
        note.warn("field 'layers.numel'", "has another length than 'layers.names'")
        del layers["numel"]
    resumes = meta.get("resumes")
    if resumes is not None:
        meta["resumes"] = [
            r for r in resumes if type(r) is dict and _fields(r, EVENT_FIELDS["resume"]) is None
        ]


def check_finding(item: Any) -> str | None:
    """``None`` when ``item`` is a finding as :meth:`ampguard.Finding.to_dict` writes it."""
    return _finding(item, "") if type(item) is dict else "not a JSON object"


def coverage_ok(cov: Any) -> bool:
    """Whether ``cov`` has the shape of the autocast census ``coverage.json`` holds."""
    modules = cov.get("modules", {}) if type(cov) is dict else None
    return (
        type(modules) is dict
        and all(type(m) is dict for m in modules.values())
        and all(
            type(cov.get(k) or []) is list and all(type(e) is dict for e in cov.get(k) or [])
            for k in ("escaped", "fragile")
        )
    )
