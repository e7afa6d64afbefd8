"""Every CLI user error is one line on stderr and exit status 2, never a traceback; an
exception raised by the user's own factory is shown as theirs, marked, exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ampguard import cli

USER_CODE = """
import torch

def boom():
    raise KeyError("raised by the user's factory")

def model():
    return torch.nn.Linear(4, 4)

NOT_CALLABLE = 3


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("raised by the user's forward")


def broken_experiment():
    import ampguard as ag
    model = Broken()
    batches = [(torch.randn(2, 4), torch.randn(2, 4))]
    return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                         lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
"""


@pytest.fixture
def place(tmp_path, monkeypatch) -> Path:
    """A working folder with a plain file, a broken run folder and the user's factory module."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "usercode.py").write_text(USER_CODE)
    (tmp_path / "import_fails.py").write_text("raise RuntimeError('at import')\n")
    meta_list = tmp_path / "meta_list"
    meta_list.mkdir()
    (meta_list / "meta.json").write_text("[1, 2]")
    (meta_list / "events.jsonl").write_text("")
    events_dir = tmp_path / "events_dir"
    (events_dir / "events.jsonl").mkdir(parents=True)
    (events_dir / "meta.json").write_text("{}")
    meta_dir = tmp_path / "meta_dir"
    (meta_dir / "meta.json").mkdir(parents=True)
    (meta_dir / "events.jsonl").write_text("")
    return tmp_path


USAGE_ERRORS = [
    [],
    ["bogus"],
    ["--bogus"],
    # demo
    ["demo", "--out", "afile"],
    ["demo", "--out", "afile/sub"],
    ["demo", "--steps", "0"],
    ["demo", "--steps", "abc"],
    ["demo", "--seed", "-1"],
    ["demo", "--seed", str(2**40)],
    ["demo", "--precision", "fp64"],
    ["demo", "--distributed"],
    ["demo", "--distributed", "fsdp2", "--steps", "2"],
    ["demo", "--distributed", "bogus"],
    ["demo", "--out", "meta_dir", "--steps", "2", "--no-progress"],
    # report
    ["report"],
    ["report", "missing"],
    ["report", "afile"],
    ["report", "."],
    ["report", "meta_list"],
    ["report", "events_dir"],
    ["report", "meta_dir"],
    ["report", "meta_list", "--fail-on", "bogus"],
    ["report", "meta_list", "--no-html"],
    # lint
    ["lint"],
    ["lint", "missing.py"],
    ["lint", "--select", "ZZ", "usercode.py"],
    ["lint", "--ignore", "AG9", "usercode.py"],
    ["lint", "--torch-version", "abc", "usercode.py"],
    ["lint", "--format", "xml", "usercode.py"],
    # compare
    ["compare"],
    ["compare", "usercode:model", "--out", "afile"],
    ["compare", "pkg.mod:missing"],
    ["compare", "nonexistent_module_xyz:f"],
    ["compare", "no_colon"],
    ["compare", ":f"],
    ["compare", "usercode:"],
    ["compare", "usercode:missing"],
    ["compare", "usercode:NOT_CALLABLE"],
    ["compare", "missing.py:f"],
    ["compare", "afile/x.py:f"],
    ["compare", ".rel:f"],
    ["compare", "usercode:model", "--steps", "0"],
    ["compare", "usercode:model", "--seed", "x"],
    ["compare", "usercode:model", "--variants", "bogus", "--steps", "2"],
    ["compare", "usercode:model", "--steps", "2", "--no-progress"],  # returns a model
    # inspect
    ["inspect"],
    ["inspect", "pkg.mod:missing"],
    ["inspect", "nonexistent_module_xyz:f"],
    ["inspect", "usercode:missing"],
    ["inspect", "usercode:NOT_CALLABLE"],
    ["inspect", "usercode:model", "--seed", "-5"],
    ["inspect", "missing.py:f"],
]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv", USAGE_ERRORS, ids=" ".join)
def test_a_user_error_is_one_line_and_exit_status_2(place, argv, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("ampguard"), err


def test_demo_without_torchrun_says_how_to_launch(place, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    code, err = run_cli(["demo", "--distributed", "ddp"], capsys)
    assert code == 2 and "torchrun --nproc-per-node 2 -m ampguard demo --distributed ddp" in err


def test_out_is_checked_before_any_training(place, capsys):
    code, err = run_cli(["compare", "usercode:boom", "--out", "afile"], capsys)
    assert code == 2 and "--out 'afile' exists and is not a folder" in err


@pytest.mark.slow  # the demo end to end
def test_demo_over_a_broken_meta_json_starts_a_new_log(place, capsys):
    folder = place / "broken"
    folder.mkdir()
    (folder / "meta.json").write_text("{not json")
    (folder / "events.jsonl").write_text('{"step": 1}\n')
    with pytest.warns(RuntimeWarning, match="cannot be continued.*meta.json is not valid JSON"):
        code, err = run_cli(["demo", "--out", "broken", "--steps", "3", "--no-progress"], capsys)
    assert code == 0 and "Traceback" not in err
    assert json.loads((folder / "meta.json").read_text())["layers"]["names"]
    assert (folder / "events.jsonl.prev").exists() and not list(folder.glob(".*.tmp"))


@pytest.mark.parametrize(
    "argv,where",
    [
        (["inspect", "usercode:boom"], 'usercode.py", line 5, in boom'),
        (
            ["compare", "usercode:boom", "--steps", "2", "--no-progress"],
            'usercode.py", line 5, in boom',
        ),
        (["inspect", "import_fails.py:f"], 'import_fails.py", line 1, in <module>'),
        (
            ["compare", "usercode:broken_experiment", "--steps", "2", "--no-progress"],
            'usercode.py", line 19, in forward',
        ),
    ],
)
def test_the_users_own_exception_is_shown_as_theirs(place, argv, where, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 1
    first, *rest = err.strip().splitlines()
    assert (
        first.startswith(f"ampguard {argv[0]}: error: ")
        and "in your code, not in ampguard" in first
    )
    assert rest[0] == "Traceback (most recent call last):" and where in err
    assert "ampguard/" not in "\n".join(rest)  # only the user's frames


@pytest.mark.slow  # a fresh interpreter per case
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "argv", [["report", "missing"], ["demo", "--out", "afile"], ["bogus"], ["report", "meta_list"]]
)
def test_the_console_entry_point_prints_no_traceback(place, argv):
    out = subprocess.run(
        [sys.executable, "-m", "ampguard", *argv],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=place,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
