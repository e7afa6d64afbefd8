"""Property tests: no input crashes the linter (random text, random bytes, random AMP programs)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampguard.findings import Finding
from ampguard.lint import RULES, lint_source

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Statements that exercise every rule: scaler protocol, clipping, checkpoints, losses, syncs.
_SIMPLE = [
    "scaler.scale(loss).backward()",
    "loss.backward()",
    "scaler.unscale_(opt)",
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    "scaler.step(opt)",
    "opt.step()",
    "scaler.update()",
    "opt.zero_grad()",
    "sched.step()",
    "helper(scaler, opt)",
    "h2(s=scaler)",
    "self.scaler.step(self.opt)",
    "self.helper()",
    "print(loss.item())",
    "writer.add_scalar('s', scaler.get_scale(), i)",
    "v = loss.item()",
    "log.info(v)",
    "scaler = torch.amp.GradScaler()",
    "scaler = torch.cuda.amp.GradScaler(enabled=fp16)",
    "model.half()",
    "model = model.to(torch.float16)",
    "torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict()}, p)",
    "ck['scaler'] = scaler.state_dict()",
    "torch.load(p, weights_only=False)",
    "y = torch.log(torch.softmax(x, -1))",
    "l = F.binary_cross_entropy(p, t)",
    "ctx = torch.autocast('cuda', dtype=torch.bfloat16)",
    "break",
    "continue",
    "return",
    "raise ValueError",
    "pass",
    "x = a if b else c",
]
_COMPOUND = [  # (header, follow-up clause or None)
    ("for i, x in enumerate(loader):", "else:"),
    ("while cond:", None),
    ("while True:", None),
    ("if amp:", "else:"),
    ("if i % 10 == 0:", None),
    ("with torch.autocast('cuda'):", None),
    ("with torch.no_grad():", None),
    ("with ctx:", None),
    ("try:", "except Exception:"),
    ("def helper(s, o):", None),
    ("def evaluate():", None),
    ("@torch.no_grad()\ndef val():", None),
    ("class T:", None),
    ("def step(self):", None),
    ("match x:\n    case 1:", None),
]


@st.composite
def _block(draw: st.DrawFn, depth: int) -> list[str]:
    lines: list[str] = []
    for _ in range(draw(st.integers(1, 6 if depth else 12))):
        if depth < 5 and draw(st.integers(0, 2)) == 0:
            header, clause = draw(st.sampled_from(_COMPOUND))
            extra = header.count("\n")
            lines.extend(header.split("\n"))
            lines.extend("    " * (extra + 1) + line for line in draw(_block(depth + 1)))
            if clause is not None and (clause.startswith("except") or draw(st.booleans())):
                lines.append(clause)
                lines.extend("    " + line for line in draw(_block(depth + 1)))
        else:
            lines.append(draw(st.sampled_from(_SIMPLE)))
    return lines


@st.composite
def amp_programs(draw: st.DrawFn) -> str:
    """Random nestings of AMP statements, all valid Python."""
    body = draw(_block(0))
    return "import torch\nimport torch.nn.functional as F\n" + "\n".join(body) + "\n"


def _check(findings: list[Finding], n_lines: int) -> None:
    for finding in findings:
        assert finding.code in RULES
        assert finding.line is not None and 1 <= finding.line <= max(n_lines, 1) + 1
        assert finding.col is not None and finding.col >= 1


@pytest.mark.slow  # hypothesis: random text
@SETTINGS
@given(st.text(max_size=400))
def test_random_text_never_crashes(text: str) -> None:
    _check(lint_source(text), text.count("\n") + 1)


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes_never_crash(data: bytes) -> None:
    _check(lint_source(data), data.count(b"\n") + 1)


@pytest.mark.slow  # hypothesis: generated AMP programs
@SETTINGS
@given(amp_programs())
def test_random_amp_programs_never_crash(program: str) -> None:
    findings = lint_source(program, torch_version="2.4")
    _check(findings, program.count("\n") + 1)
    assert not [f for f in findings if f.code == "AG200"]  # valid Python is always analysed
