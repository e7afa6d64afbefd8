"""The flow interpreter's memo: a helper's exit is reused across caller assumptions it never
reads, a loop's settled head across passes that enter it the same way, and neither changes a
finding (each is checked against the interpreter with that shortcut off)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampguard.lint._flow as flow
from ampguard.lint import lint_source
from ampguard.lint._memo import FlowMemo, Reads, Touched, expand, hidden, strip

_FLOW = "AG200,AG201,AG202,AG204"


def _found(source: str) -> list[tuple[int, str, str]]:
    return sorted(
        (f.line, f.code, f.message) for f in lint_source(source, "train.py", select=_FLOW)
    )


def _without_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every assumption kept in the helper memo's key, no loop memo: the plain interpreter."""
    monkeypatch.setattr(flow, "hidden", lambda state, read, key_heads: frozenset())
    monkeypatch.setattr(flow, "_loop_key", lambda stmt, env, state: None)


def _visits(monkeypatch: pytest.MonkeyPatch, name: str) -> dict[str, int]:
    """Counts the interpretations of the body of the helper called ``name``."""
    visits = {"n": 0}
    real = flow.Interpreter._block

    def counting(self, stmts, state, env):  # type: ignore[no-untyped-def]
        if env.active and stmts is env.active[-1].body and env.active[-1].name == name:
            visits["n"] += 1
        return real(self, stmts, state, env)

    monkeypatch.setattr(flow.Interpreter, "_block", counting)
    return visits


_BRANCHY_CALLER = """
import torch
scaler = torch.amp.GradScaler("cuda")

def train(model, opt, loader):
    for x in loader:
        scaler.scale(model(x)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

def main(cfg, model, opt, loader):
{branches}
"""


def _branchy(count: int) -> str:
    lines = []
    for i in range(count):
        lines += [f"    if cfg.flag{i}:", "        train(model, opt, loader)", "    else:"]
        lines += ["        train(model, opt, loader)"]
    return _BRANCHY_CALLER.format(branches="\n".join(lines))


@pytest.mark.parametrize("count", [1, 5])
def test_a_helper_is_not_interpreted_again_for_each_callers_branch(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train()`` called in both branches of ``cfg.flag0`` .. ``cfg.flag4`` (which it never
    reads) is interpreted at most half as often as when every assumption is in the memo key
    (once per analysis for one flag, not once per branch), with the same findings."""
    source = _branchy(count)
    visits = _visits(monkeypatch, "train")
    found = _found(source)
    assert [(line, code) for line, code, _ in found] == [(8, "AG201")]
    memoised, visits["n"] = visits["n"], 0
    with monkeypatch.context() as plain:
        _without_memo(plain)
        assert _found(source) == found
    assert memoised <= visits["n"] // 2, (memoised, visits["n"])
    if count == 1:
        assert memoised == 2  # AG201 and AG202, one recording run each


# The helper reads its caller's assumption (``use_amp``): the run under the hidden assumption is
# void, and the helper runs again with it kept, so it takes only the branch the caller is on.
_READ_BY_HELPER = """
import torch
scaler = torch.amp.GradScaler("cuda")

def clip_unless_amp(model, use_amp):
    if not use_amp:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

def train(model, opt, loader, use_amp):
    for x in loader:
        if use_amp:
            scaler.scale(model(x)).backward()
            clip_unless_amp(model, use_amp)
            scaler.step(opt)
            scaler.update()
        else:
            model(x).backward()
            clip_unless_amp(model, use_amp)
            opt.step()
"""


def test_an_assumption_the_helper_tests_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _found(_READ_BY_HELPER) == []  # the clip runs only where nothing was scaled
    # the forgetting variant: the helper assigns the flag, so both its branches are taken
    # (with the memo as without it)
    forgets = _READ_BY_HELPER.replace(
        "    if not use_amp:", "    use_amp = bool(use_amp)\n    if not use_amp:"
    )
    found = _found(forgets)
    assert [code for _, code, _ in found] == ["AG201"]
    with monkeypatch.context() as plain:
        _without_memo(plain)
        assert _found(_READ_BY_HELPER) == []
        assert _found(forgets) == found


_NESTED_LOOPS = """
import torch
scaler = torch.amp.GradScaler("cuda")

def train(model, opt, loader, epochs):
    for epoch in range(epochs):
        for x in loader:
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.step()
"""


def test_a_loop_settles_once_per_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording pass of the outer loop enters the inner one as its last quiet round did:
    the inner loop's rounds are not run again (fewer body passes, the same findings)."""
    inner = {"n": 0}
    real = flow.Interpreter._block

    def counting(self, stmts, state, env):  # type: ignore[no-untyped-def]
        if stmts and getattr(stmts[0], "lineno", 0) == 8:
            inner["n"] += 1
        return real(self, stmts, state, env)

    monkeypatch.setattr(flow.Interpreter, "_block", counting)
    found = _found(_NESTED_LOOPS)
    memoised = inner["n"]
    inner["n"] = 0
    with monkeypatch.context() as plain:
        _without_memo(plain)
        assert _found(_NESTED_LOOPS) == found
    assert memoised < inner["n"], (memoised, inner["n"])
    assert [code for _, code, _ in found] == ["AG202"]


# The helper assigns its ``use_amp`` parameter: the caller forgets what it assumed about the flag
# (as when the helper's body is inlined), so ``if not use_amp:`` after the call is reachable.
_FORGOTTEN = """
import torch
scaler = torch.amp.GradScaler("cuda")

def step(scaler, opt, use_amp):
    scaler.step(opt)
    scaler.update()
    use_amp = False

def train(model, opt, loader, use_amp):
    for x in loader:
        if use_amp:
            scaler.scale(model(x)).backward()
            step(scaler, opt, use_amp)
            if not use_amp:
                opt.step()
"""

# The inner loop is entered with other paths on the outer loop's second round (after
# ``scaler.step``): its head settles again from them, so the ``opt.step()`` that follows the
# previous epoch's ``scaler.step(opt)`` is seen.
_INNER_LOOP_AGAIN = """
import torch
scaler = torch.amp.GradScaler("cuda")

def train(model, opt, loader, epochs):
    for epoch in range(epochs):
        for x in loader:
            opt.step()
            model(x).backward()
        scaler.step(opt)
        scaler.update()
"""

# ``inner``'s exit is memoised from ``b`` (no assumption); ``c`` reaches it through ``outer``
# under ``if use_amp:``, hidden from ``outer``: the memoised exit says it tested ``use_amp``, so
# ``outer`` runs again with the assumption, and ``inner`` skips its ``unscale_`` there.
_READ_BY_A_MEMOISED_EXIT = """
import torch
scaler = torch.amp.GradScaler("cuda")

def inner(scaler, opt, use_amp):
    if not use_amp:
        scaler.unscale_(opt)

def outer2(scaler, opt, use_amp):
    inner(scaler, opt, use_amp)

def outer(scaler, opt, use_amp):
    inner(scaler, opt, use_amp)

def b(model, opt, loader, use_amp):
    for x in loader:
        scaler.scale(model(x)).backward()
        outer2(scaler, opt, use_amp)
        scaler.step(opt)
        scaler.update()

def c(model, opt, loader, use_amp):
    for x in loader:
        if use_amp:
            scaler.scale(model(x)).backward()
            outer(scaler, opt, use_amp)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_FORGOTTEN, [(16, "AG202")]),
        (_INNER_LOOP_AGAIN, [(8, "AG202")]),
        (_READ_BY_A_MEMOISED_EXIT, [(27, "AG201")]),
    ],
    ids=["forgotten", "inner-loop-again", "read-by-a-memoised-exit"],
)
def test_what_the_memo_must_not_reuse(
    source: str, expected: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = _found(source)
    assert [(line, code) for line, code, _ in found] == expected
    with monkeypatch.context() as plain:
        _without_memo(plain)
        assert _found(source) == found


_HELPER_BODY = [
    "scaler.scale(loss).backward()",
    "scaler.unscale_(opt)",
    "torch.nn.utils.clip_grad_norm_(params, 1.0)",
    "scaler.step(opt)",
    "scaler.update()",
    "opt.step()",
    "opt.zero_grad()",
    "use_amp = not use_amp",
]
_helper_stmt = st.sampled_from(_HELPER_BODY)
_helper_part = st.one_of(
    _helper_stmt.map(lambda s: [s]),
    st.tuples(st.lists(_helper_stmt, min_size=1, max_size=3), st.booleans()).map(
        lambda pb: ["if use_amp:" if pb[1] else "if not use_amp:", *(f"    {s}" for s in pb[0])]
    ),
)
_caller_part = st.sampled_from(
    ["call", "flag", "use_amp", "not use_amp", "loop", "backward", "step"]
)
_CALLER_STEPS = {
    "backward": "scaler.scale(loss).backward()",
    "step": "scaler.step(opt); scaler.update()",
}


def _program(helper: list[list[str]], caller: list[str]) -> str:
    lines = ["import torch", "scaler = torch.amp.GradScaler()", ""]
    lines.append("def helper(scaler, opt, params, loss, use_amp):")
    lines += [f"    {line}" for part in helper for line in part] or ["    pass"]
    lines += ["", "def train(cfg, opt, params, loader, use_amp):", "    for loss in loader:"]
    indent = "        "
    for index, part in enumerate(caller):
        call = f"{indent}helper(scaler, opt, params, loss, use_amp)"
        if part == "call":
            lines.append(call)
        elif part in _CALLER_STEPS:
            lines.append(indent + _CALLER_STEPS[part])
        elif part == "flag":  # an assumption the helper never reads
            lines += [
                f"{indent}if cfg.flag{index}:",
                f"    {call}",
                f"{indent}else:",
                f"    {call}",
            ]
        elif part.endswith("amp"):  # one it may read
            lines += [f"{indent}if {part}:", f"    {call}"]
        else:
            lines += [f"{indent}for _ in range(cfg.accumulate):", f"    {call}"]
    return "\n".join(lines) + "\n"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_helper_part, min_size=1, max_size=4), st.lists(_caller_part, min_size=1, max_size=5)
)
def test_the_memo_changes_no_finding(helper: list, caller: list) -> None:
    """Any helper (steps, branches on a flag its caller may also test, an assignment to it),
    called under any mix of caller branches and loops: the same findings as the interpreter
    without the memo's shortcuts."""
    source = _program(helper, caller)
    found = _found(source)
    with pytest.MonkeyPatch.context() as plain:
        _without_memo(plain)
        assert _found(source) == found, source


def test_hidden_assumptions_are_those_every_path_holds_and_nothing_read() -> None:
    a, b, c = ("a is None", False), ("b is None", True), ("x > 1", True)
    state = {frozenset({a, b}): 1, frozenset({a, b, c}): 2}
    heads = {"a is None": {"a"}, "b is None": {"b"}, "x > 1": {"x"}}.__getitem__
    assert hidden(state, None, heads) == {a, b}
    assert hidden(state, (frozenset({"a is None"}), frozenset()), heads) == {b}
    assert hidden(state, (frozenset(), frozenset({"b"})), heads) == {a}
    assert strip(state, frozenset({a, b})) == {frozenset(): 1, frozenset({c}): 2}
    assert expand(strip(state, frozenset({a})), frozenset({a})) == state
    assert expand(None, frozenset({a})) is None


def test_a_read_of_a_hidden_assumption_stops_the_helper_that_hid_it() -> None:
    reads = Reads()
    heads = {"a is None": {"a"}, "b is None": {"b"}}.__getitem__
    outer = reads.push(frozenset({("a is None", True)}), heads)
    inner = reads.push(frozenset({("b is None", True)}), heads)
    reads.tested("c is None")  # read by both, hidden from neither
    assert "c is None" in outer.tested and "c is None" in inner.tested
    with pytest.raises(Touched) as caught:
        reads.assigned({"a"})
    assert caught.value.frame is outer  # the outermost helper that hid it
    with pytest.raises(Touched) as caught:
        reads.tested("b is None")
    assert caught.value.frame is inner
    reads.pop(inner)
    reads.pop(outer)
    memo = FlowMemo()
    memo.learn(("ctx",), (frozenset({"k"}), frozenset()))
    memo.learn(("ctx",), (frozenset(), frozenset({"n"})))
    assert memo.reads[("ctx",)] == (frozenset({"k"}), frozenset({"n"}))
    memo.clear()
    assert not memo.reads and not memo.exits and not memo.loops
