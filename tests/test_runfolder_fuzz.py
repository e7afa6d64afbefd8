"""Fuzz: random and mutated records through the readers, the rules, the
summary and the report. The only exception allowed is RunFolderError (an unusable meta.json);
a bad line is a warning, never a KeyError / TypeError / ValueError / RecursionError."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from _runfolders import meta, steps, write
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ampguard as ag
from ampguard import rules, runlog
from ampguard.reporting import summary
from ampguard.runlog._schema import RunFolderError

FIELDS = [
    "step",
    "scale_before",
    "scale",
    "applied",
    "overflow",
    "collapse",
    "dropped",
    "loss",
    "loss_nonfinite",
    "grad_norm",
    "precision",
    "overflowed",
    "layers",
    "range",
    "kind",
    "finding",
    "previous_scale",
    "scale_reset",
    "from",
    "to",
]
KINDS = ["step", "resume", "fallback", "finding", "other"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["nan", "inf", "-inf", "fp16", "AG101", "error"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(FIELDS + ["grad_norm", "window", "code", "severity"]), inner, max_size=4
        ),
    ),
    max_leaves=8,
)

mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 40), st.sampled_from(FIELDS), values),
    st.tuples(st.just("del"), st.integers(0, 40), st.sampled_from(FIELDS), st.none()),
    st.tuples(st.just("kind"), st.integers(0, 40), st.sampled_from(KINDS), st.none()),
    st.tuples(
        st.just("line"), st.integers(0, 40), st.none(), st.one_of(values, st.binary(max_size=12))
    ),
)
meta_mutation = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from(
            ["model", "layers", "scaler", "guard", "diagnostics", "resumes", "precision"]
        ),
        values,
    ),
    st.tuples(
        st.sampled_from(
            [
                "layers.names",
                "scaler.min_scale",
                "guard.accumulation_steps",
                "model.parameters",
                "scaler.dynamic",
            ]
        ),
        values,
    ),
)


def mutate(records: list[Any], ops: list[tuple]) -> list[Any]:
    out: list[Any] = [dict(r) for r in records] + [
        {"kind": "resume", "step": 8, "scale": 64.0, "previous_scale": 1024.0, "scale_reset": True},
        {
            "kind": "finding",
            "step": 3,
            "finding": {"code": "AG301", "severity": "warning", "title": "t", "message": "m"},
        },
        {"kind": "fallback", "step": 10, "from": "fp16", "to": "bf16"},
    ]
    for op, i, key, value in ops:
        i %= len(out)
        if op == "line":
            out.insert(i, value)
        elif isinstance(out[i], dict):
            if op == "set":
                out[i][key] = value
            elif op == "del":
                out[i].pop(key, None)
            else:
                out[i]["kind"] = key
    return out


def folder(tmp: str, records: list[Any], meta_op: Any) -> Path:
    m = meta()
    if meta_op is not None:
        dotted, value = meta_op
        *parent, key = dotted.split(".")
        holder = m[parent[0]] if parent else m
        holder[key] = value
    path = Path(tmp) / "run"
    path.mkdir()
    (path / "meta.json").write_text(json.dumps(m))
    with open(path / "events.jsonl", "wb") as fh:
        for rec in records:
            fh.write(rec if isinstance(rec, bytes) else json.dumps(rec).encode())
            fh.write(b"\n")
    return path


def read_everything(path: Path, html: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            run = runlog.load_run(path)
        except RunFolderError as exc:
            assert "meta.json" in str(exc)
            return
        rules.evaluate(run)
        rules.skip_causes(run)
        runlog.last_step_record(path / "events.jsonl")
        summary(path)
        if html:
            ag.report(path)
            assert (path / "report.html").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(mutation, max_size=6), meta_op=meta_mutation)
def test_mutated_run_folders_never_crash_the_readers(ops, meta_op):
    with tempfile.TemporaryDirectory() as tmp:
        read_everything(folder(tmp, mutate(steps(24), ops), meta_op), html=False)


@pytest.mark.slow  # renders a report per example
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(mutation, min_size=1, max_size=6), meta_op=meta_mutation)
def test_mutated_run_folders_never_crash_the_report(ops, meta_op):
    with tempfile.TemporaryDirectory() as tmp:
        read_everything(folder(tmp, mutate(steps(24), ops), meta_op), html=True)


@settings(max_examples=25, deadline=None)
@given(lines=st.lists(st.one_of(values, st.binary(max_size=20)), max_size=12))
@example(lines=[{"step": 0}])  # a step line without any scale: the summary had no lowest scale
def test_random_lines_never_crash_the_readers(lines):
    with tempfile.TemporaryDirectory() as tmp:
        read_everything(folder(tmp, lines, None), html=False)


def test_the_writer_helpers_produce_a_clean_log():
    """The fuzz starts from a valid log: unmutated, nothing is skipped."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp) / "run", mutate(steps(24), []))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            run = runlog.load_run(path)
        assert run.bad_lines == 0 and run.steps.tolist() == list(range(1, 9))  # resume at 8
