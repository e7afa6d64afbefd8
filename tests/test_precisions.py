"""The precision registry: its facts, one entry is all a new precision needs, and no module
outside it compares a variable with a precision name."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ampguard import precisions
from ampguard.core.policy import resolve_precision
from ampguard.precisions import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ampguard"
NAMES = frozenset(REGISTRY)  # every registered name: a comparison with any is caught


# ---------------------------------------------------------------------- the registry's facts
# Every check here holds for every entry, read from the registry: none pins its contents, so a
# new entry is checked without an edit (tests/test_registry_contracts.py trains every entry).
# The audit codes of released entries: ranks exchange them, so a renumbering would make ranks
# of two versions disagree. A new entry appends its own code; this map does not grow.
RELEASED_AUDIT_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3, "mxfp8": 4, "nvfp4": 5}
KINDS = ("dynamic", "static", "none")  # ampguard.core.loss_scale.KINDS (checked there)


def test_one_full_precision_is_the_reference():
    full = [n for n, p in REGISTRY.items() if p.is_full]
    assert full == [precisions.full()]
    entry = REGISTRY[precisions.full()]
    assert entry.low_dtype is None and entry.autocast_dtype is None and not entry.needs_scaler


def test_scaled_is_the_first_entry_with_a_loss_scale():
    assert precisions.scaled() == next(n for n, p in REGISTRY.items() if p.needs_scaler)


def test_audit_codes_are_unique_append_only_and_round_trip():
    codes = {n: p.audit_code for n, p in REGISTRY.items()}
    assert len(set(codes.values())) == len(codes)
    released = {n: c for n, c in RELEASED_AUDIT_CODES.items() if n in codes}
    assert {n: codes[n] for n in released} == released
    assert all(precisions.by_audit_code(c) == n for n, c in codes.items())
    assert precisions.by_audit_code(max(codes.values()) + 1).startswith("unknown(")


def test_requests_are_auto_then_every_entry_in_order():
    assert precisions.requests() == (precisions.AUTO, *REGISTRY)
    watchable = tuple(n for n, p in REGISTRY.items() if p.watchable)
    assert precisions.names(watchable=True) == watchable


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_is_well_formed(name):
    p = REGISTRY[name]
    assert p.name == name and p.summary
    assert p.loss_scale in KINDS and p.needs_scaler == (p.loss_scale != "none")
    assert p.autocast_only == (not p.is_full and p.hook is None)
    assert (p.name in precisions.traced()) == p.autocast_only
    assert (p.refused_params is None) == (not p.param_advice)
    if p.hook is not None:  # a "module:attribute" under ampguard, imported on first use
        module, _, attribute = p.hook.partition(":")
        assert module.startswith("ampguard.") and attribute
    if p.extra is not None:
        assert p.hook is not None  # an extra is what a hook needs


@pytest.mark.parametrize("name", list(REGISTRY))
def test_watched_as_is_a_watchable_entry_with_the_same_autocast_and_scale(name):
    seen = REGISTRY[precisions.watched_as(name)]
    assert seen.watchable
    if REGISTRY[name].watchable:
        assert seen.name == name
    assert (seen.autocast_dtype, seen.loss_scale) == (
        REGISTRY[name].autocast_dtype,
        REGISTRY[name].loss_scale,
    )


def test_labels_are_the_first_entry_without_a_hook_that_rounds_to_the_dtype():
    for name in REGISTRY:
        dtype = REGISTRY[name].low_dtype or "float32"
        plain = (n for n, p in REGISTRY.items() if p.hook is None)
        first = next((n for n in plain if (REGISTRY[n].low_dtype or "float32") == dtype), dtype)
        assert precisions.label(dtype) == first
    assert precisions.label("float64") == "float64"


@pytest.mark.parametrize("bad", ["fp4", "FP16", "", "auto"])
def test_get_names_the_argument_and_the_allowed_names(bad):
    with pytest.raises(ValueError, match=r"^dtype_arg must be one of \(") as info:
        precisions.get(bad, argument="dtype_arg")
    for name in REGISTRY:
        assert repr(name) in str(info.value)
    assert repr(bad) in str(info.value)


def test_get_with_a_narrower_allowed_refuses_the_rest():
    assert precisions.get("bf16", allowed=("bf16",)) is REGISTRY["bf16"]
    with pytest.raises(ValueError, match=r"precision must be one of \('bf16',\), got 'fp16'"):
        precisions.get("fp16", allowed=("bf16",))


def test_checked_refuses_a_map_to_an_unregistered_precision():
    assert precisions.checked({"16-mixed": "fp16"}, source="x") == {"16-mixed": "fp16"}
    with pytest.raises(
        ValueError, match=r"Lightning's map maps to unregistered precisions \['fp4'\]"
    ):
        precisions.checked({"4-true": "fp4", "32": "fp32"}, source="Lightning's map")


# ---------------------------------------------------------------------- one vocabulary
def test_formats_compare_and_the_registry_share_one_vocabulary():
    from ampguard.experiments._lowp import LOWP_VARIANTS
    from ampguard.experiments._variants import PRECISION_OF
    from ampguard.fp8 import FORMATS

    for name, entry in REGISTRY.items():
        assert set(entry.formats) <= set(FORMATS), name  # the plan's format names
        if name in FORMATS:  # a precision named as a format trains in that format alone
            assert entry.formats == (name,)
    assert set(precisions.single_format()) == {n for n in REGISTRY if n in FORMATS}
    # every compare variant names the precision it trains in: its name, or name_qualifier
    assert set(PRECISION_OF.values()) <= set(REGISTRY)
    for variant, precision in PRECISION_OF.items():
        assert variant == precision or variant.startswith(f"{precision}_"), variant
    assert set(LOWP_VARIANTS) == set(precisions.single_format())


# ---------------------------------------------------------------------- prose that lists them
def test_the_guard_docstring_points_to_the_registry_and_lists_no_precision_by_hand():
    import inspect
    import re

    from ampguard.guard import Guard

    doc = inspect.getdoc(Guard) or ""
    paragraph = re.search(r"\n    precision: (.*?)\n    \w+:", doc, re.S)
    assert paragraph, "the Guard docstring documents precision="
    text = paragraph.group(1)
    assert "ampguard.precisions.REGISTRY" in text
    quoted = set(re.findall(r'``"([^"]+)"``', text))
    assert quoted <= {precisions.AUTO}, f"a hand-written list of precisions goes stale: {quoted}"


def test_the_cli_offers_every_request_from_the_registry():
    import argparse

    from ampguard.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo = commands.choices["demo"]
    option = next(a for a in demo._actions if "--precision" in a.option_strings)
    # argparse lists them in the help: every entry a name alone selects (a recipe is a value)
    assert tuple(option.choices) == precisions.requests(by_name=True)


# ---------------------------------------------------------------------- one entry is enough
@pytest.fixture
def bf16_test(monkeypatch):
    """A throwaway precision: a copy of bf16 under another name and audit code, registered the
    way a new precision is: one entry in REGISTRY, nothing else edited."""
    entry = dataclasses.replace(REGISTRY["bf16"], name="bf16-test", audit_code=99)
    monkeypatch.setitem(REGISTRY, "bf16-test", entry)
    return entry


def _gen_docs():  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_entry_resolves(bf16_test):
    policy = resolve_precision("bf16-test", "cpu")
    assert policy.entry is bf16_test
    assert policy.dtype is not None and str(policy.dtype) == "torch.bfloat16"
    assert not policy.needs_scaler
    assert precisions.by_audit_code(99) == "bf16-test"


def test_a_new_entry_is_a_cli_choice(bf16_test):
    from ampguard.cli import build_parser

    args = build_parser().parse_args(["demo", "--precision", "bf16-test"])
    assert args.precision == "bf16-test"


def test_validators_list_a_new_entry(bf16_test):
    import torch

    from ampguard.forensics.autocast_coverage import coverage

    with pytest.raises(ValueError, match="bf16-test") as policy_error:
        resolve_precision("fp4", "cpu")
    assert "precision must be one of" in str(policy_error.value)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"precision must be one of .*'bf16-test'"):
        coverage(model, lambda m, b: m(b).sum(), torch.randn(3, 4), "fp4")
    with pytest.raises(ValueError, match="bf16-test"):
        precisions.get("fp4")


def test_coverage_traces_a_new_autocast_entry(bf16_test):
    import torch

    from ampguard.forensics.autocast_coverage import coverage

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    cov = coverage(model, lambda m, b: m(b).float().sum(), torch.randn(4, 8), "bf16-test")
    assert cov.precision == "bf16-test"
    assert cov.low_precision_share > 0.5  # the Linear layers ran in bf16


def test_the_docs_table_lists_a_new_entry(bf16_test):
    table = _gen_docs().precisions_table()
    row = next(line for line in table.splitlines() if line.startswith("| `bf16-test` |"))
    assert "bfloat16" in row and "| none |" in row and "bf16 autocast on the device" in row


def test_the_fp16_range_rules_judge_an_entry_by_its_dtype(monkeypatch):
    from ampguard.rules._base import fp16_mask

    monkeypatch.setitem(
        REGISTRY, "fp16-test", dataclasses.replace(REGISTRY["fp16"], name="fp16-test")
    )
    names = [*REGISTRY, "unknown"]
    mask = fp16_mask(names)
    assert mask.tolist() == [n in REGISTRY and REGISTRY[n].low_dtype == "float16" for n in names]
    assert mask[names.index("fp16-test")]
    assert mask.dtype == np.bool_


# ---------------------------------------------------------------------- no string comparisons
# Files allowed to compare with a precision name (none: every comparison reads the registry; an
# entry added while code moves must go when it lands, the test below fails on a stale entry).
ALLOWED: set[str] = set()
# lint reads the user's code: its "fp16"/"bf16" are the kinds of the user's torch dtypes and
# framework flags (``bf16=True``), not ampguard's precisions.
NOT_PRECISIONS = ("lint/",)


def _literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_literal(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_literal(e) for e in node.elts)
    return _literal(node)


def _is_kind(node: ast.AST) -> bool:
    """``kind`` / ``x.kind`` / ``ev["kind"]`` / ``ev.get("kind")``: a run-log event kind (the
    ``"fp8"`` event), another vocabulary."""
    if isinstance(node, ast.Name):
        return node.id == "kind"
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get" and bool(node.args) and _is_kind_key(node.args[0])
    return False


def _is_kind_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "kind"


def comparisons(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every ``==``/``!=``/``in``/``not in`` between a value and a precision
    name literal (or a tuple/list/set holding one), and of every literal tuple/list/set of two or
    more precision names (a hand-written list of the registry's names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
            sides = [node.left, *node.comparators]
            if (
                any(isinstance(op, ops) for op in node.ops)
                and any(_names_literal(s) for s in sides)
                and not any(_is_kind(s) for s in sides)
            ):
                found.append((node.lineno, ast.get_source_segment(source, node) or ""))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if sum(_literal(e) for e in node.elts) >= 2:
                found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


@pytest.mark.parametrize(
    "source",
    [
        'if precision == "fp16": pass',
        'ok = "bf16" != p',
        'x = name in ("bf16", "fp8")',
        'x = guard.precision not in {"fp32"}',
        'ALLOWED = ("fp16", "bf16", "auto")',
        'f(["fp32", "fp8"])',
    ],
)
def test_the_scanner_finds_a_comparison(source):
    assert comparisons(source)


@pytest.mark.parametrize(
    "source",
    [
        "if entry.needs_scaler: pass",
        'precision = "fp16"',
        'd = {"fp16": 1}',
        'if kind == "fp8": pass',
        'if ev.get("kind") != "fp8": pass',
        'if name == "fp16_dynamic": pass',
        'results["fp32"]',
    ],
)
def test_the_scanner_leaves_what_is_not_a_comparison(source):
    assert not comparisons(source)


def _scanned() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "precisions.py" or rel.startswith(NOT_PRECISIONS):
            continue
        hits = comparisons(path.read_text(encoding="utf-8"))
        if hits:
            out[rel] = hits
    return out


def test_no_module_compares_with_a_precision_name():
    found = _scanned()
    offending = {f: h for f, h in found.items() if f not in ALLOWED}
    assert not offending, (
        "compare registry facts (entry.needs_scaler, is_full, low_dtype, ...) instead of "
        f"precision names: {offending}"
    )


def test_the_allow_list_has_no_stale_entry():
    stale = ALLOWED - set(_scanned())
    assert not stale, f"these files no longer compare with precision names: drop {stale}"
