"""The flow rules on real-code shapes: the path budget's note, AG213's frequency and
helpers, AG206 fallbacks, AG205 per-dict findings, AG207 under a condition."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampguard.lint import lint_paths, lint_source

CORPUS = Path(__file__).parent / "corpus"


def _lint(name: str, **kwargs: object) -> list:
    return lint_paths([CORPUS / name], torch_version="2.13", **kwargs)  # type: ignore[arg-type]


def test_a_unit_over_the_path_budget_gets_an_info_note_naming_it() -> None:
    [note] = _lint("ag200_budget_fire.py")
    assert (note.code, note.severity, note.title) == ("AG200", "info", "analysis budget exceeded")
    assert "finetune() (line 8)" in note.message and "AG201, AG202, AG204" in note.message
    assert note.line == 8 and note.evidence["reason"] == "paths"


def test_the_budget_note_obeys_select_and_ignore() -> None:
    assert _lint("ag200_budget_fire.py", ignore="AG200") == []
    assert _lint("ag200_budget_fire.py", select="AG202") == []  # nor a guessed AG202


def test_flags_that_do_not_change_the_step_merge_away_exactly() -> None:
    """The fp16 path never reaches the else branch's clip, however many flags surround it."""
    source = (CORPUS / "ag201_budget_ok.py").read_text()
    body = source.split("    for i, (imgs, targets) in enumerate(loader):\n", 1)
    flag = "        if cfg.flag{0}:\n            imgs = imgs.flip({0})\n"
    flags = "".join(flag.format(n) for n in range(8))
    wide = body[0] + "    for i, (imgs, targets) in enumerate(loader):\n" + flags + body[1]
    assert lint_source(wide, "train.py", torch_version="2.13") == []


SYNC_LOOP = """
import torch

def train(model, optimizer, scaler, loader, rank):
    for step, x in enumerate(loader):
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        {line}
"""


def _sync(line: str, filename: str = "train.py") -> list:
    source = SYNC_LOOP.format(line=line)
    return [f for f in lint_source(source, filename, torch_version="2.13") if f.code == "AG213"]


def test_ag213_says_how_often_the_sync_runs() -> None:
    [every] = _sync('print(f"{loss.item():.4f}")')
    assert "on every training step (loop at line 5)" in every.message
    [ranked] = _sync('if rank == 0: print(f"{loss.item():.4f}")')
    assert "on every training step on the main rank" in ranked.message
    [period] = _sync("if step % 5 == 0: print(float(loss))")
    assert "every 5 training steps" in period.message and period.evidence["period"] == 5
    assert _sync("if step % 50 == 0: print(float(loss))") == []
    assert _sync("if step % log_every == 0: print(float(loss))") == []


def test_ag213_is_silent_in_test_files_and_on_cpu_tensors() -> None:
    line = 'print(f"{loss.item():.4f}")'
    assert _sync(line, "tests/test_train.py") == []
    assert _sync(line, "train_test.py") == []
    assert _sync(line, "conftest.py") == []
    assert _sync("t = torch.tensor([1.0, 2.0]); print(t.tolist(), t.item())") == []
    [cpu] = _sync("print(loss.detach().cpu().numpy())")  # the copy is reported once
    assert cpu.evidence["sync"] == "loss.detach().cpu()"


def test_ag213_names_the_helper_called_per_step() -> None:
    found = [f for f in _lint("ag213_real_fire.py") if f.line == 70]
    assert len(found) == 1
    assert "in _log_step() called at line 87" in found[0].message


def test_ag206_fallbacks_are_info_plain_uses_stay_warnings() -> None:
    found = _lint("ag206_compat_fire.py")
    fallbacks = [f for f in found if f.line < 50]
    assert [f.severity for f in found if f.line >= 50] == ["warning"]  # a dtype test
    assert fallbacks and {f.severity for f in fallbacks} == {"info"}
    assert all(f.evidence["fallback"] is True for f in fallbacks)
    grad_scaler = next(f for f in fallbacks if f.evidence["deprecated"].endswith("GradScaler"))
    assert "torch >= 2.3" in grad_scaler.message
    plain = _lint("ag206_fire.py")
    assert plain and {f.severity for f in plain} == {"warning"}


def test_ag205_one_finding_per_dict_lists_every_save() -> None:
    found = [f for f in _lint("ag205_reassigned_fire.py") if f.line == 41]
    assert len(found) == 1 and found[0].evidence["save_lines"] == [41, 44]
    assert "(saved at lines 41, 44)" in found[0].message
    [built] = lint_paths([CORPUS / "proj_saver"], torch_version="2.13")
    assert "built by save_checkpoint() (model_utils.py:9)" in built.message
    assert built.evidence["save_lines"] == [20, 24]


def test_ag207_names_the_condition_that_does_not_gate() -> None:
    found = _lint("ag207_cond_fire.py")
    assert [f.line for f in found] == [20, 41]
    assert "under 'if sched is not None'" in found[0].message


_STEP = [
    "scaler.scale(loss).backward()",
    "loss.backward()",
    "scaler.unscale_(opt)",
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    "scaler.step(opt)",
    "opt.step()",
    "scaler.update()",
    "opt.zero_grad()",
]
_statement = st.sampled_from(_STEP)
_block = st.lists(_statement, min_size=1, max_size=4)
# a loop body: plain statements and ``if use_fp16: ... else: ...`` blocks
_part = st.one_of(
    _statement.map(lambda s: [s]),
    st.tuples(_block, _block).map(
        lambda ab: [
            "if use_fp16:",
            *(f"    {s}" for s in ab[0]),
            "else:",
            *(f"    {s}" for s in ab[1]),
        ]
    ),
)


def _program(parts: list[list[str]], flags: list[int]) -> str:
    lines = ["import torch", "scaler = torch.amp.GradScaler()", "", "def train(cfg, use_fp16):"]
    lines.append("    for x in loader:")
    lines.append("        loss = model(x)")
    for index, part in enumerate(parts):
        for flag in (f for f in flags if f == index):
            lines += [f"        if cfg.flag{flag}_{len(lines)}:", "            x = x.flip(0)"]
        lines += [f"        {line}" for line in part]
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_part, min_size=1, max_size=5), st.lists(st.integers(0, 4), max_size=9))
def test_unrelated_flags_never_change_the_order_findings(parts: list, flags: list) -> None:
    """However many flags that leave the step alone surround it, the findings are the same: no
    merge invents a path (and none loses one)."""

    def found(source: str) -> list[tuple[str, str]]:
        return sorted(
            (f.code, f.message)
            for f in lint_source(source, "train.py", select="AG201,AG202,AG204,AG200")
        )

    assert found(_program(parts, sorted(flags))) == found(_program(parts, []))


# A path set holding both ``{}`` (the loop's first iteration: nothing ran yet) and
# ``{use_fp16: False}`` (later iterations, after the ``else`` branch's steps) reaches the same
# ``if use_fp16:`` test: splitting ``{}`` on it lands on ``{use_fp16: False}`` too, and both states
# must be joined there. Overwriting one with the other drops the first iteration's path, which is
# what an unrelated ``if cfg.flag:`` (whose merge joins the two states first) used to reveal.
_FIRST_ITERATION = """
import torch
scaler = torch.amp.GradScaler()

def train(cfg, use_fp16):
    for x in loader:
{flag}        if use_fp16:
            pass
        else:
            scaler.step(opt)
            scaler.scale(loss).backward()
        opt.step()
"""


def test_a_test_seen_with_and_without_its_assumption_keeps_both_paths() -> None:
    def found(flag: str) -> list[tuple[str, str, int]]:
        source = _FIRST_ITERATION.format(flag=flag)
        return sorted(
            (f.code, f.message, f.line - flag.count("\n"))
            for f in lint_source(source, "train.py", select="AG201,AG202,AG204,AG200")
        )

    plain = found("")
    assert plain == found("        if cfg.flag:\n            x = x.flip(0)\n")
    # the first iteration reaches ``scaler.step(opt)`` before any ``opt.step()``; every later
    # one right after the previous iteration's ``opt.step()``, with no backward in between
    assert [(code, line) for code, _, line in plain] == [("AG202", 10), ("AG204", 10)]


def test_ag213_says_when_a_per_step_sync_is_logged_only_every_n_steps() -> None:
    [found] = [f for f in _lint("ag213_real_fire.py") if f.evidence["unit"] == "train_gpt"]
    assert "on every training step" in found.message
    assert "only to be logged under 'if iter_num % log_interval == 0'" in found.message
