"""Output people can act on: severity and fix in the text output, the code's
own variable names in messages, ``--fail-on`` deciding the exit status, dangling symlinks named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _lint import lint_cli

from ampguard.findings.codes import EXAMPLES
from ampguard.lint import failing, format_findings, lint_paths, lint_source, summary_line

INFO_ONLY = EXAMPLES["AG213"].replace(
    "import torch\n", "import torch\nscaler = torch.amp.GradScaler('cuda')\n", 1
)
WARNING = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"  # AG206, a warning
ERROR = (
    "import torch\n"
    "scaler = torch.amp.GradScaler('cuda')\n"
    "for x in loader:\n"
    "    scaler.scale(model(x)).backward()\n"
    "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "    scaler.step(optimizer)\n"
    "    scaler.update()\n"
)


def test_text_shows_severity_and_the_fix_under_each_finding() -> None:
    [finding] = lint_source(WARNING, "t.py")
    text = format_findings([finding])
    first, second = text.splitlines()
    assert first == (
        "t.py:2:10: AG206 [warning] [*] torch.cuda.amp.GradScaler is deprecated: "
        "use torch.amp.GradScaler('cuda', ...)"
    )
    assert second == f"    fix: {finding.fix}"


def test_fixable_findings_are_marked_and_counted_the_others_are_not() -> None:
    """``[*]`` marks what ``--fix`` rewrites (as ruff's): an AG206 call, not an AG205 (no
    rewrite) nor an old entry point bound to a name (the fixer rewrites calls)."""
    source = (
        "import torch\n"
        "scaler = torch.cuda.amp.GradScaler()\n"
        "def f(device):\n"
        "    amp_autocast = torch.cuda.amp.autocast\n"
        "    if device == 'npu':\n"
        "        amp_autocast = torch.npu.amp.autocast\n"
        "    with amp_autocast():\n"
        "        pass\n"
    )
    findings = lint_source(source, "t.py")
    lines = [line for line in format_findings(findings).splitlines() if "AG206" in line]
    assert [("[*]" in line) for line in lines] == [True, False]
    assert summary_line(findings).endswith("; [*] 1 fixable with --fix")
    assert "[*]" not in summary_line(lint_source(INFO_ONLY, "t.py"))


def test_messages_name_the_codes_own_variables() -> None:
    source = (
        "import torch\n"
        "class Trainer:\n"
        "    def __init__(self, model):\n"
        "        self.scaler = torch.amp.GradScaler('cuda')\n"
        "        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    def train_step(self, loss):\n"
        "        self.scaler.scale(loss).backward()\n"
        "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"
        "        self.scaler.step(self.optimizer)\n"
        "        self.scaler.update()\n"
    )
    [finding] = lint_source(source, select="AG201")
    assert "no self.scaler.unscale_(self.optimizer) after self.scaler.scale" in finding.message
    assert finding.evidence["optimizer"] == "self.optimizer"
    assert "(optimizer)" not in finding.message


@pytest.mark.parametrize(
    ("source", "fail_on", "code"),
    [
        (INFO_ONLY, "warning", 0),  # the default: an info hint never fails a pre-commit hook
        (INFO_ONLY, "info", 1),
        (WARNING, "warning", 1),
        (WARNING, "error", 0),
        (ERROR, "error", 1),
    ],
)
def test_fail_on_decides_the_exit_status(
    tmp_path: Path, source: str, fail_on: str, code: int
) -> None:
    (tmp_path / "t.py").write_text(source)
    args = ["t.py"] if fail_on == "warning" else ["t.py", "--fail-on", fail_on]
    result = lint_cli(*args, cwd=tmp_path)
    assert result.returncode == code, result.stdout + result.stderr
    assert result.stdout.strip(), "findings are printed whatever the exit status"
    assert f"at --fail-on {fail_on} or worse" in result.stderr


def test_fail_on_rejects_an_unknown_severity(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(WARNING)
    result = lint_cli("t.py", "--fail-on", "fatal", cwd=tmp_path)
    assert result.returncode == 2 and "--fail-on" in result.stderr


def test_failing_and_summary_from_python() -> None:
    findings = lint_source(INFO_ONLY) + lint_source(WARNING)
    assert sorted(f.severity for f in findings) == ["info", "warning"]
    assert [f.code for f in failing(findings)] == ["AG206"]
    assert failing(findings, "error") == []
    assert len(failing(findings, "info")) == 2
    assert (
        summary_line(findings) == "2 findings (1 warning, 1 info); 1 at --fail-on warning or worse"
        "; [*] 1 fixable with --fix"
    )
    with pytest.raises(ValueError, match="fail_on must be one of error, warning, info"):
        failing(findings, "fatal")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_a_dangling_symlink_says_so_and_where_it_points(tmp_path: Path) -> None:
    os.symlink("gone/train.py", tmp_path / "train.py")
    [finding] = lint_paths([tmp_path])
    assert finding.code == "AG200"
    assert finding.message == (
        "not read: a dangling symlink: it points to 'gone/train.py' "
        f"({tmp_path / 'gone' / 'train.py'}), which does not exist"
    )
    os.symlink(str(tmp_path / "nowhere.py"), tmp_path / "abs.py")  # an absolute target
    messages = {Path(f.path).name: f.message for f in lint_paths([tmp_path])}
    assert messages["abs.py"] == (
        f"not read: a dangling symlink: it points to {str(tmp_path / 'nowhere.py')!r}, "
        "which does not exist"
    )


def test_the_fix_marker_asks_the_fixer_about_a_file_s_shape(tmp_path: Path) -> None:
    """An explicit ``weights_only=False`` is AG208 but the author's decision, which ``--fix``
    leaves alone: no ``[*]``; a load without the argument whose result only feeds
    ``load_state_dict`` is rewritten: ``[*]``. Nothing is written to the file."""
    source = (
        "import torch\n"
        "def a(path):\n"
        "    return torch.load(path, weights_only=False)\n"
        "def b(model, path):\n"
        "    model.load_state_dict(torch.load(path))\n"
    )
    path = tmp_path / "t.py"
    path.write_text(source)
    findings = [f for f in lint_paths([path], torch_version="2.4") if f.code == "AG208"]
    marks = {f.line: "[*]" in format_findings([f]) for f in findings}
    assert marks == {3: False, 5: True}
    assert path.read_text() == source
