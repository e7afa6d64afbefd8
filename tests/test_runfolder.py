"""The run-folder schema: a malformed line is skipped with one warning naming
file, line and field; an unusable meta.json / findings.json is one clear error naming the file;
no reader raises a raw KeyError / TypeError / ValueError / RecursionError."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from _runfolders import meta, step, steps, write

import ampguard as ag
from ampguard import cli, rules, runlog
from ampguard.reporting import summary
from ampguard.runlog._files import read_findings
from ampguard.runlog._schema import MAX_WARNINGS, RunFolderError


def load(path: Path) -> tuple[runlog.RunLog, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = runlog.load_run(path)
    return run, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# ---------------------------------------------------------------------- one bad line each
BAD_LINES = {
    "null step": ({"step": None}, "'step'"),
    "resume without a step": ({"kind": "resume", "scale": 2.0}, "'step' is missing"),
    "fallback without a step": ({"kind": "fallback", "from": "fp16"}, "'step' is missing"),
    "string step": ({"step": "abc"}, "'step' must be an integer"),
    "float step": ({"step": 3.5}, "'step'"),
    "bool step": ({"step": True}, "'step'"),
    "huge step": ({"step": 10**400}, "'step'"),
    "string scale": ({**step(3), "scale": "1024"}, "'scale' must be a number"),
    "list loss": ({**step(3), "loss": [1]}, "'loss'"),
    "applied as int": ({**step(3), "applied": 1}, "'applied' must be true or false"),
    "negative dropped": ({**step(3), "dropped": -1}, "'dropped'"),
    "precision as number": ({**step(3), "precision": 16}, "'precision'"),
    "bad loss_nonfinite": ({**step(3), "loss": None, "loss_nonfinite": "NaN"}, "'loss_nonfinite'"),
    "layers not a dict": ({**step(3), "layers": [1.0, 2.0, 3.0]}, "'layers'"),
    "layer norms too short": ({**step(3), "layers": {"grad_norm": [1.0]}}, "layers.'grad_norm'"),
    "layer norm a string": (
        {**step(3), "layers": {"grad_norm": ["x", 1.0, 1.0]}},
        "layers.'grad_norm'",
    ),
    "range without window": (
        {
            **step(3),
            "range": {
                k: [0.1] * 3
                for k in ("zero_frac", "amax", "headroom_bits", "underflow", "safe_lo", "safe_hi")
            },
        },
        "'range.window'",
    ),
    "overflowed not ints": ({**step(3), "overflowed": ["0"]}, "'overflowed'"),
    "kind a list": ({"kind": ["step"], "step": 3}, "'kind'"),
    "finding not a dict": ({"kind": "finding", "step": 3, "finding": "AG101"}, "'finding'"),
    "finding bad severity": (
        {
            "kind": "finding",
            "step": 3,
            "finding": {"code": "AG301", "severity": "fatal", "title": "t", "message": "m"},
        },
        "finding.'severity'",
    ),
    "finding without code": (
        {
            "kind": "finding",
            "step": 3,
            "finding": {"severity": "error", "title": "t", "message": "m"},
        },
        "finding.'code'",
    ),
    "resume scale a string": ({"kind": "resume", "step": 2, "scale": "big"}, "'scale'"),
    "a JSON list": ([1, 2, 3], "not an object"),
    "a JSON string": ("step", "not an object"),
}


@pytest.mark.parametrize("name", list(BAD_LINES))
def test_a_malformed_line_is_skipped_with_one_warning_naming_file_line_and_field(tmp_path, name):
    bad, field = BAD_LINES[name]
    folder = write(tmp_path / "run", [step(1), step(2), bad, step(4)])
    run, messages = load(folder)
    assert run.steps.tolist() == [1, 2, 4] and run.bad_lines == 1
    assert len(messages) == 1
    assert str(folder / "events.jsonl") in messages[0] and "line 3" in messages[0]
    assert field in messages[0], messages[0]
    # the rules, the summary and the report read the same run without an exception
    rules.evaluate(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert "steps 1-4" in summary(folder)


@pytest.mark.parametrize(
    "raw,why",
    [
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),  # RecursionError in json
        (b'{"step": 3, \n', "not JSON"),
        (b"\xff\xfe{}\n", "not JSON"),
        (b'{"step": NaN}\n', "'step'"),
    ],
)
def test_unparsable_lines_are_skipped(tmp_path, raw, why):
    folder = write(tmp_path / "run", [step(1)], raw_lines=[raw])
    run, messages = load(folder)
    assert run.steps.tolist() == [1] and len(messages) == 1 and why in messages[0]


def test_a_torn_last_line_is_named_as_such(tmp_path):
    folder = write(tmp_path / "run", [step(1)], raw_lines=[b'{"step": 2, "sca'])
    run, messages = load(folder)
    assert run.steps.tolist() == [1] and "line 2 (a torn last line" in messages[0]


def test_at_most_n_warnings_then_a_count(tmp_path):
    folder = write(tmp_path / "run", [step(1)] + [{"step": None}] * 50)
    run, messages = load(folder)
    assert run.bad_lines == 50 and len(messages) == MAX_WARNINGS + 1
    assert f"{50 - MAX_WARNINGS} more" in messages[-1] and "50 in all" in messages[-1]


def test_valid_optional_fields_are_read(tmp_path):
    rec = {**step(2), "loss": None, "loss_nonfinite": "inf", "overflowed": [1], "future": {"x": 1}}
    folder = write(tmp_path / "run", [step(1), rec, {"kind": "something_new", "step": "any"}])
    run, messages = load(folder)
    assert messages == [] and run.steps.tolist() == [1, 2] and np.isnan(run.loss[1])
    assert run.events == [{"kind": "something_new", "step": "any"}]  # kept, not interpreted


def test_resume_drops_rerun_steps_in_every_family(tmp_path):
    recs = (
        steps(10)
        + [{"kind": "resume", "step": 6, "scale": 512.0}]
        + [step(i, layers=True, rng=True) for i in (7, 8)]
    )
    run, messages = load(write(tmp_path / "run", recs))
    assert messages == []
    assert run.steps.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert run.layer_steps.tolist() == [2, 4, 6, 7, 8] and run.layer_norm.shape == (5, 3)
    assert run.range_steps.tolist() == [5, 7, 8] and run.window.shape == (3, 2)
    assert len(run.precision) == 8 and len(run.range_precision) == 3


def test_resume_in_an_unsorted_log_keeps_the_earlier_steps(tmp_path):
    recs = [
        step(5),
        step(2, layers=True),
        step(9, layers=True),
        step(3),
        {"kind": "resume", "step": 4},
    ]
    run, _ = load(write(tmp_path / "run", recs))
    assert run.steps.tolist() == [2, 3] and run.layer_steps.tolist() == [2]
    assert run.layer_norm.shape == (1, 3)


# ---------------------------------------------------------------------- meta.json / findings.json
@pytest.mark.parametrize("kind", ["list", "bad json", "folder", "number", "deep", "empty"])
def test_an_unusable_meta_json_is_one_error_naming_the_file(tmp_path, kind, capsys):
    folder = write(tmp_path / "run", [step(1)])
    target = folder / "meta.json"
    if kind == "folder":
        target.unlink()
        target.mkdir()
    else:
        target.write_text(
            {
                "list": "[1, 2]",
                "bad json": "{'a': 1}",
                "number": "3",
                "deep": "[" * 100_000,
                "empty": "",
            }[kind]
        )
    with pytest.raises(RunFolderError, match="meta.json"):
        runlog.load_run(folder)
    assert cli.main(["report", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "meta.json" in err and "Traceback" not in err


def test_events_jsonl_as_a_folder_is_one_error(tmp_path):
    folder = write(tmp_path / "run", [])
    (folder / "events.jsonl").unlink()
    (folder / "events.jsonl").mkdir()
    with pytest.raises(RunFolderError, match="events.jsonl is a folder"):
        runlog.load_run(folder)


def test_a_wrong_meta_field_is_dropped_with_a_warning(tmp_path):
    bad = {
        **meta(),
        "model": {"class": 3, "parameters": "many"},
        "guard": [],
        "scaler": {"min_scale": "1"},
        "diagnostics": {"fallbacks": [1]},
    }
    folder = write(tmp_path / "run", steps(12), meta_obj=bad)
    run, messages = load(folder)
    assert len(messages) == 5 and all("meta.json" in m for m in messages)
    assert any("'model.parameters'" in m for m in messages)
    assert "min_scale" not in run.meta["scaler"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert summary(folder).startswith("ampguard report:")


def test_bad_layer_names_in_meta_leave_layer_records_skipped(tmp_path):
    folder = write(tmp_path / "run", steps(4), meta_obj={**meta(), "layers": {"names": "enc"}})
    run, messages = load(folder)  # the per-layer lines no longer fit: skipped, named
    assert run.layers == [] and run.steps.tolist() == [1, 3]
    assert any("'layers.names'" in m for m in messages)
    assert any("layers.'grad_norm' has 3 values for 0 layer(s)" in m for m in messages)


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"code": "AG101"}', "must hold a JSON list"),
        ("[1]", "entry 0: not a JSON object"),
        ('[{"code": "AG101", "severity": "bad", "title": "t", "message": "m"}]', "severity"),
        ("[", "not valid JSON"),
    ],
)
def test_an_unusable_findings_json_is_one_error_naming_the_file(tmp_path, content, match):
    path = tmp_path / "findings.json"
    path.write_text(content)
    with pytest.raises(RunFolderError, match=match) as info:
        read_findings(path)
    assert "findings.json" in str(info.value)


def test_last_step_record_skips_wrong_typed_lines(tmp_path):
    folder = write(tmp_path / "run", [step(1), step(2, rng=True), {"step": "x"}, {"step": None}])
    assert runlog.last_step_record(folder / "events.jsonl")["step"] == 2
    assert runlog.last_step_record(folder / "events.jsonl", at_most=1)["step"] == 1


def test_report_of_a_hostile_log_writes_the_page(tmp_path):
    dead = [{**step(i), "layers": {"grad_norm": [0.5, 0.0, 0.5]}} for i in range(1, 31)]
    recs = dead + [
        {"step": None},
        {"kind": "resume"},
        [1],
        {"kind": "fallback", "step": 9, "from": "$x^$", "to": "bf16"},
    ]
    folder = write(tmp_path / "run", recs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        page = ag.report(folder).read_text()
    assert "layer &#x27;a$b^$&#x27; got all-zero gradients" in page  # AG104 names it verbatim
    found = json.loads((folder / "findings.json").read_text())
    assert [f["code"] for f in found] == ["AG104"] and found[0]["evidence"]["layer"] == "a$b^$"


def test_meta_numbers_the_rules_need_are_numbers(tmp_path):
    bad = {
        **meta(),
        "scaler": {"min_scale": None, "init_scale": "x", "dynamic": True},
        "layers": {"names": ["enc", "a$b^$", "head"], "numel": [1]},
    }
    folder = write(
        tmp_path / "run",
        [{**step(i), "layers": {"grad_norm": [0.5, 0.0, 0.5]}} for i in range(1, 31)],
        meta_obj=bad,
    )
    run, messages = load(folder)
    assert {"min_scale", "init_scale"}.isdisjoint(run.meta["scaler"])
    assert "numel" not in run.meta["layers"] and len(messages) == 3
    assert [f.code for f in rules.evaluate(run)] == ["AG104"]


@pytest.mark.parametrize(
    "coverage",
    ['{"modules": {"a": {"forward": [1]}}}', "[]", "{", '{"modules": [1]}', '{"escaped": "x"}'],
)
def test_a_hand_edited_coverage_json_does_not_break_the_report(tmp_path, coverage):
    folder = write(tmp_path / "run", steps(12))
    (folder / "coverage.json").write_text(coverage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert ag.report(folder).exists()


def test_deeply_nested_evidence_or_meta_fields_are_dropped_not_recursed(tmp_path):
    deep: object = 1
    for _ in range(500):
        deep = [deep]
    found = {
        "kind": "finding",
        "step": 2,
        "finding": {
            "code": "AG301",
            "severity": "warning",
            "title": "t",
            "message": "m",
            "evidence": {"x": deep},
        },
    }
    folder = write(
        tmp_path / "run", steps(12) + [found], meta_obj={**meta(), "distributed": {"x": deep}}
    )
    run, messages = load(folder)
    assert "distributed" not in run.meta and len(messages) == 2
    assert any("'evidence' is nested more than 64 deep" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert ag.report(folder).exists()


def test_the_resume_read_refuses_a_fifo_in_place_of_the_event_log(tmp_path):
    # a resuming run reads the last step record from the end of the log: a FIFO there must be one
    # error naming the file, not a read that waits for a writer forever
    from ampguard.runlog import RunFolderError, last_step_record

    fifo = tmp_path / "steps.jsonl"
    try:
        os.mkfifo(fifo)
    except (AttributeError, OSError) as exc:
        pytest.skip(f"no FIFO here: {exc}")
    with pytest.raises(RunFolderError, match=r"steps\.jsonl is a FIFO \(named pipe\)"):
        last_step_record(fifo)
