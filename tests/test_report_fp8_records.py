"""The report reads fp8 records and ``meta.json["fp8"]`` through the schema,
and never blocks on a run folder whose files are FIFOs.

One real fp8 run (torchao, emulated on CPU) is written once; each test copies it and damages one
record or field. A malformed one is skipped with a warning naming file, line and field; ``ampguard
report`` prints its summary and never crashes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard import cli
from ampguard.runlog import load_run
from ampguard.runlog._schema import FP8_FIELDS

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tel = ag.Telemetry(path, flush_every=4, range_every=2)
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with ag.Guard(model, opt, precision="fp8", telemetry=tel) as guard:
            for _ in range(6):
                with guard.autocast():
                    loss = nn.functional.mse_loss(model(x).float(), y)
                guard.backward(loss)
                guard.step()
    (path / "report.html").unlink(missing_ok=True)
    return path


def _copy(fp8_run: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(fp8_run, folder)
    return folder


def test_the_fp8_schema_fields_are_the_ones_the_monitor_writes():
    from ampguard.fp8._stats import FIELDS

    assert FIELDS == FP8_FIELDS


def _fp8_line(folder: Path) -> tuple[int, dict]:
    lines = (folder / "events.jsonl").read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        rec = json.loads(line)
        if rec.get("kind") == "fp8":
            return number, rec
    raise AssertionError("the fp8 run wrote no fp8 record")


def _replace_line(folder: Path, number: int, rec: dict) -> None:
    path = folder / "events.jsonl"
    lines = path.read_text().splitlines()
    lines[number - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def _first_layer(rec: dict) -> str:
    return next(iter(rec["layers"]))


# (how to damage the record, the field the warning names)
RECORDS = {
    "layers a list": (lambda r: r.update(layers=[1, 2]), "'layers'"),
    "layers missing": (lambda r: r.pop("layers"), "'layers' is missing"),
    "an int sample": (lambda r: r["layers"].update({_first_layer(r): 5}), "'layers.0'"),
    "a list share": (
        lambda r: r["layers"][_first_layer(r)].update(input_flushed=[0.5]),
        "'layers.0.input_flushed'",
    ),
    "a string amax": (
        lambda r: r["layers"][_first_layer(r)].update(grad_amax="big"),
        "'layers.0.grad_amax'",
    ),
    "a bool share": (
        lambda r: r["layers"][_first_layer(r)].update(weight_flushed=True),
        "'layers.0.weight_flushed'",
    ),
    "a string step": (lambda r: r.update(step="4"), "'step'"),
}


@pytest.mark.parametrize("damage", list(RECORDS))
def test_a_malformed_fp8_record_is_skipped_with_a_warning_naming_line_and_field(
    fp8_run, tmp_path, capsys, damage
):
    folder = _copy(fp8_run, tmp_path)
    number, rec = _fp8_line(folder)
    edit, field = RECORDS[damage]
    edit(rec)
    _replace_line(folder, number, rec)
    with pytest.warns(RuntimeWarning) as caught:
        run = load_run(folder)
    texts = [str(w.message) for w in caught]
    assert any(
        f"events.jsonl: line {number}: " in t and field in t and t.endswith("skipped")
        for t in texts
    ), texts
    assert run.bad_lines == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert cli.main(["report", str(folder), "--no-html"]) == 0
    assert "fp8 (tensorwise" in capsys.readouterr().out


# (a meta.json["fp8"] field made malformed, the dotted field the warning names)
META = {
    "converted: 5": ({"converted": 5}, "'fp8.converted'"),
    "kept_bf16 a string": ({"kept_bf16": "0"}, "'fp8.kept_bf16'"),
    "recipe a list": ({"recipe": ["tensorwise"]}, "'fp8.recipe'"),
    "emulated a string": ({"emulated": "yes"}, "'fp8.emulated'"),
    "layers a list": ({"layers": [1]}, "'fp8.layers'"),
    "a layer's share a list": ({"layers": {"0": {"input_flushed": [1]}}}, "'fp8.layers'"),
    "plan of ints": ({"plan": {"0": 1}}, "'fp8.plan'"),
}


@pytest.mark.parametrize("damage", list(META))
def test_a_malformed_meta_fp8_field_is_dropped_with_a_warning(fp8_run, tmp_path, capsys, damage):
    folder = _copy(fp8_run, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    values, field = META[damage]
    meta["fp8"].update(values)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match=f"meta.json: field {field}: must be"):
        load_run(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert cli.main(["report", str(folder), "--no-html"]) == 0
    assert "fp8 (" in capsys.readouterr().out


def test_meta_fp8_not_an_object_is_dropped_and_the_report_has_no_fp8_section(
    fp8_run, tmp_path, capsys
):
    folder = _copy(fp8_run, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    meta["fp8"] = [1, 2]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match="meta.json: field 'fp8': must be a JSON object"):
        assert cli.main(["report", str(folder), "--no-html"]) == 0
    assert "fp8 (" not in capsys.readouterr().out


def test_twenty_malformed_fp8_records_give_ten_warnings_and_a_count(fp8_run, tmp_path):
    folder = _copy(fp8_run, tmp_path)
    with open(folder / "events.jsonl", "a") as f:
        for step in range(20):
            f.write(json.dumps({"kind": "fp8", "step": step, "layers": [step]}) + "\n")
    with pytest.warns(RuntimeWarning) as caught:
        load_run(folder)
    texts = [str(w.message) for w in caught if "events.jsonl" in str(w.message)]
    assert len(texts) == 11 and "10 more malformed line(s)" in texts[-1]


# ---------------------------------------------------------------------- item 7: FIFOs
fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")


@fifo
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["events.jsonl", "meta.json"])
def test_ampguard_report_on_a_fifo_in_the_run_folder_is_one_line_not_a_hang(
    fp8_run, tmp_path, name
):
    folder = _copy(fp8_run, tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)  # opening it to read would block until a writer came
    out = subprocess.run(
        [sys.executable, "-m", "ampguard", "report", str(folder), "--no-html"],
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 2, out
    assert f"{folder / name} is a FIFO (named pipe), not a regular file" in out.stderr
    assert "Traceback" not in out.stderr


@fifo
@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["findings.json", "coverage.json"])
def test_the_run_folders_other_json_files_are_not_read_through_a_fifo(tmp_path, name):
    from ampguard.runlog import RunFolderError, read_json

    os.mkfifo(tmp_path / name)
    with pytest.raises(RunFolderError, match="is a FIFO"):
        read_json(tmp_path / name)
