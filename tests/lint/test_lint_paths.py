"""Path assumptions of the flow interpreter: fixed conditions, forgetting them, their bounds."""

from __future__ import annotations

from ampguard.lint import lint_source

HEAD = (
    "import torch\n"
    "scaler = torch.amp.GradScaler('cuda')\n"
    "def train(loader, model, opt, use_fp16, accum):\n"
    "    for i, x in enumerate(loader):\n"
    "        loss = model(x).sum()\n"
)
FP16_THEN_FP32 = (
    "        if use_fp16:\n"
    "            scaler.scale(loss).backward()\n"
    "            if (i + 1) % accum == 0:\n"
    "                scaler.unscale_(opt)\n"
    "                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "                scaler.step(opt)\n"
    "                scaler.update()\n"
    "        else:\n"
    "            loss.backward()\n"
    "            if (i + 1) % accum == 0:\n"
    "                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "                opt.step()\n"
)


def codes(src: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint_source(src) if f.code == "AG201"]


def test_a_loop_invariant_flag_keeps_each_iteration_in_its_branch() -> None:
    assert codes(HEAD + FP16_THEN_FP32) == []


def test_a_flag_assigned_in_the_loop_is_not_fixed() -> None:
    src = HEAD + "        use_fp16 = i % 2 == 0\n" + FP16_THEN_FP32
    assert codes(src) == [(17, "AG201")]


def test_a_flag_assigned_by_a_walrus_or_a_call_is_not_fixed() -> None:
    src = HEAD + FP16_THEN_FP32.replace("if use_fp16:", "if should_scale(i):")
    assert codes(src) == [(16, "AG201")]


def test_correlated_flags_with_different_names_never_add_a_finding() -> None:
    src = (
        HEAD + "        if use_fp16:\n"
        "            scaler.scale(loss).backward()\n"
        "        else:\n"
        "            loss.backward()\n"
        "        if accum:\n"
        "            scaler.unscale_(opt)\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        scaler.step(opt)\n"
        "        scaler.update()\n"
    )
    assert codes(src) == []  # judged on every path that can reach the clip, joined


def test_many_independent_conditions_stay_bounded() -> None:
    flags = "".join(f"        if f{n}:\n            loss = loss * {n}\n" for n in range(40))
    src = (
        HEAD.replace("accum):", "accum, " + ", ".join(f"f{n}" for n in range(40)) + "):")
        + flags
        + "        scaler.scale(loss).backward()\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        scaler.step(opt)\n        scaler.update()\n"
    )
    assert codes(src) == [(87, "AG201")]
