"""Review of the user-facing surface: what README.md and the CLI help promise."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.cli import build_parser


def _hot_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(1e5)  # its outputs pass fp16's 65504
    return model


def test_forensics_finding_states_its_fix_once():
    batch = (torch.randn(8, 16) * 10, torch.randint(0, 4, (8,)))
    diag = ag.locate(_hot_model(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch)
    finding = diag.to_finding(step=3)
    assert (finding.code, finding.fix != "") == ("AG301", True)
    assert finding.fix not in finding.message and "'2'" in finding.message


def test_cli_help_describes_the_tool_not_the_module():
    description = build_parser().description
    assert "mixed-precision" in description and "dispatch" not in description


class _Island(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.inner(x.float())


def test_escaped_module_message_counts_what_it_says():
    model = nn.Sequential(nn.Linear(16, 16), _Island(), nn.Linear(16, 2))
    cov = ag.coverage(model, lambda m, b: m(b).float().sum(), torch.randn(4, 16))
    (finding,) = [f for f in cov.findings() if f.code == "AG310"]
    count = finding.evidence["heavy_fp32"]
    assert f"all {count} of its forward and backward matmul-family ops" in finding.message


def test_lint_names_a_non_utf8_file_without_declaration_as_such():
    (finding,) = ag.lint_source(b'x = 1\ny = "\xff"\n', "latin.py")
    assert (finding.code, finding.line) == ("AG200", 2)
    assert "not valid utf-8" in finding.message


def test_cli_output_piped_into_an_early_exit_reader_ends_without_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampguard", "lint", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before any output, like `| head -0`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and b"Traceback" not in err and b"BrokenPipe" not in err
