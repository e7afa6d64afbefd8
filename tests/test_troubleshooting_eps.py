"""docs/troubleshooting.md walks the planted-eps case (a hand-written norm whose eps underflows
in fp16) from the symptom to a fix that removes every skip: run its code blocks as written and
check what the page says they do."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
HEADING = "## Every step is skipped and the loss is NaN: an eps fp16 cannot hold"


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start : end if end > 0 else None]


@pytest.fixture(scope="module")
def walked() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
    assert len(blocks) == 4  # the model, the symptom, the diagnosis, the fix
    ns: dict = {"__name__": "troubleshooting_eps"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the on_collapse="warn" run warns, as the page says
        for code in blocks:
            exec(compile(code, str(PAGE), "exec"), ns)
    return ns


def test_the_symptom_every_step_skipped_as_a_nonfinite_forward(walked):
    assert walked["broken_skips"] == 40
    causes = walked["broken_causes"]
    assert causes["nonfinite_forward"] == 40 and causes["overflow"] == 0


def test_the_default_policy_stops_where_the_page_says():
    import ampguard as ag

    ns: dict = {}
    exec(re.findall(r"```python\n(.*?)```", _section(), flags=re.S)[0], ns)
    with pytest.raises(ag.ScaleCollapseError, match="collapsed at step 17"):
        ns["train"](ns["Net"](), precision="fp16")


def test_the_diagnosis_names_the_eps_and_the_fix_that_works(walked):
    diag = walked["diag"]
    assert (diag.kind, diag.phase, diag.module, diag.op) == (
        "fp16_overflow",
        "forward",
        "norm",
        "aten.div",
    )
    assert diag.stats["tiny_eps"] == [{"module": "norm", "attribute": "eps", "value": 1e-12}]
    check = diag.stats["keep_fp32_check"]
    assert check["finite"] is False and (check["phase"], check["module"]) == ("backward", "proj")
    shown = re.search(r"```text\n(.*?)```", _section(), flags=re.S).group(1)
    assert " ".join(shown.split()) == " ".join(diag.explain().split())  # the page shows it as is


def test_the_documented_fix_removes_every_skip(walked):
    assert walked["fixed_skips"] == 0 and walked["bf16_skips"] == 0
    assert walked["fixed"].diagnostics()["skipped_steps"] == 0


def test_the_eps_alone_claim(walked):
    model = walked["Net"]()
    model.norm.eps = 1e-5
    guard, skipped = walked["train"](model, precision="fp16")
    assert "6 of 40 skipped here, ending at scale 1024" in _section()
    assert (skipped, guard.scale) == (6, 1024.0)
