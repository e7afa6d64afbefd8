"""``ampguard lint`` as a user runs it: a real subprocess, exit codes, formats, no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _lint import lint_cli

from ampguard.lint import RULES

ROOT = Path(__file__).resolve().parents[2]
BUG = (
    "import torch\nscaler = torch.cuda.amp.GradScaler()\n"
    "x = torch.load('a.pt', weights_only=False)\n"
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(BUG)
    (tmp_path / "clean.py").write_text("import torch\nscaler = torch.amp.GradScaler('cuda')\n")
    return tmp_path


def test_clean_file_exits_0_and_prints_nothing(project: Path) -> None:
    result = lint_cli("clean.py", cwd=project)
    assert (result.returncode, result.stdout) == (0, "")


def test_findings_exit_1_with_path_line_col_code_lines(project: Path) -> None:
    result = lint_cli(".", cwd=project)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert [line.split(": ", 1)[0] for line in lines] == ["train.py:2:10", "train.py:3:5"]
    assert [line.split()[1] for line in lines] == ["AG206", "AG208"]


@pytest.mark.parametrize(
    "args",
    [
        ["--select", "AG999", "train.py"],
        ["missing.py"],
        ["--format", "xml", "train.py"],
        [],
    ],
)
def test_usage_errors_exit_2(project: Path, args: list[str]) -> None:
    result = lint_cli(*args, cwd=project)
    assert result.returncode == 2
    assert "error" in result.stderr


def test_select_and_ignore_filter_codes(project: Path) -> None:
    assert lint_cli("--select", "AG206", "train.py", cwd=project).stdout.count("AG") == 1
    assert lint_cli("--ignore", "AG206,AG208", "train.py", cwd=project).returncode == 0
    assert (
        lint_cli("--ignore", "AG206", "--ignore", "AG208", "train.py", cwd=project).returncode == 0
    )


def test_exclude_option_skips_matching_files(project: Path) -> None:
    assert lint_cli(".", "--exclude", "train.py", cwd=project).returncode == 0


def test_json_format_is_a_list_of_findings(project: Path) -> None:
    result = lint_cli("--format", "json", "train.py", cwd=project)
    data = json.loads(result.stdout)
    assert [d["code"] for d in data] == ["AG206", "AG208"]
    assert {"path", "line", "col", "message", "fix", "severity"} <= set(data[0])


def test_json_format_of_a_clean_run_is_an_empty_list(project: Path) -> None:
    result = lint_cli("--format", "json", "clean.py", cwd=project)
    assert (result.returncode, json.loads(result.stdout)) == (0, [])


def test_sarif_format_is_sarif_2_1_0(project: Path) -> None:
    sarif = json.loads(lint_cli("--format", "sarif", "train.py", cwd=project).stdout)
    assert sarif["version"] == "2.1.0"
    [run_] = sarif["runs"]
    rules = run_["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == sorted(RULES)  # every rule, in code order
    for result in run_["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        loc = result["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"] == "train.py"
        assert loc["region"]["startLine"] >= 1 and loc["region"]["startColumn"] >= 1
    assert [r["level"] for r in run_["results"]] == ["warning", "warning"]


def test_syntax_error_and_non_utf8_files_are_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "latin.py").write_bytes(b"name = '\xe9'\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    result = lint_cli(".", cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert [line.split()[1] for line in lines] == ["AG200", "AG200"]


def test_noqa_comment_silences_a_finding(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("import torch\ns = torch.cuda.amp.GradScaler()  # noqa: AG206\n")
    assert lint_cli("t.py", cwd=tmp_path).returncode == 0


def test_lint_does_not_import_torch(project: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ampguard", "lint", "."],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1  # it did lint
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "ampguard.lint" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy")}


def _hooks(text: str) -> list[dict[str, str]]:
    """The ``key: value`` fields of each ``- id: ...`` item (the file is a flat YAML list)."""
    hooks: list[dict[str, str]] = []
    for line in text.splitlines():
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        if item.startswith("- "):
            hooks.append({})
            item = item[2:]
        key, _, value = item.partition(": ")
        hooks[-1][key] = value
    return hooks


def test_pre_commit_hooks_run_ampguard_lint_on_python_files() -> None:
    hooks = _hooks((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == ["ampguard-lint", "ampguard-lint-system"]
    for hook in hooks:
        assert hook["entry"] == "ampguard lint" and hook["types"] == "[python]"
