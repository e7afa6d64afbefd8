"""lint_source / lint_paths: findings shape, AG200, noqa, select/ignore, folders, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

import ampguard as ag
from ampguard.findings import Finding
from ampguard.lint import lint_paths, lint_source

CLIP_BUG = (
    "import torch\n"
    "scaler = torch.amp.GradScaler()\n"
    "for x in data:\n"
    "    scaler.scale(model(x).sum()).backward()\n"
    "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0){comment}\n"
    "    scaler.step(opt)\n"
    "    scaler.update()\n"
)


def test_public_names_are_exported_from_the_package() -> None:
    assert ag.lint_source is lint_source
    assert ag.lint_paths is lint_paths


def test_finding_carries_path_line_col_and_fix() -> None:
    [finding] = lint_source(CLIP_BUG.format(comment=""), "train.py")
    assert isinstance(finding, Finding)
    assert (finding.code, finding.path, finding.line, finding.col) == ("AG201", "train.py", 5, 5)
    assert finding.severity == "error" and "unscale_" in finding.fix


def test_findings_are_sorted_by_line() -> None:
    src = (
        "import torch\n"
        "b = torch.load('b.pt', weights_only=False)\n"
        "a = torch.cuda.amp.GradScaler()\n"
    )
    assert [(f.line, f.code) for f in lint_source(src)] == [(2, "AG208"), (3, "AG206")]


@pytest.mark.parametrize("comment", ["  # noqa", "  # noqa: AG201", "  # NOQA:AG201,AG202"])
def test_noqa_silences_the_line(comment: str) -> None:
    assert lint_source(CLIP_BUG.format(comment=comment)) == []


def test_noqa_for_another_code_does_not_silence() -> None:
    assert [f.code for f in lint_source(CLIP_BUG.format(comment="  # noqa: E501"))] == ["AG201"]


@pytest.mark.parametrize(
    ("select", "ignore", "expected"),
    [
        (None, None, ["AG208", "AG206"]),
        ("AG206", None, ["AG206"]),
        (["AG20"], "AG208", ["AG206"]),
        ("ALL", ["AG206", "AG208"], []),
    ],
)
def test_select_and_ignore_take_codes_and_prefixes(select, ignore, expected) -> None:
    src = (
        "import torch\nx = torch.load('b.pt', weights_only=False)\n"
        "s = torch.cuda.amp.GradScaler()\n"
    )
    assert [f.code for f in lint_source(src, select=select, ignore=ignore)] == expected


@pytest.mark.parametrize("bad", ["AG999", "E501", "AG2x"])
def test_unknown_code_is_a_value_error_naming_the_argument(bad: str) -> None:
    with pytest.raises(ValueError, match="select: unknown code"):
        lint_source("x = 1\n", select=bad)


def test_non_text_source_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="text must be str or bytes"):
        lint_source(123)  # type: ignore[arg-type]


def test_syntax_error_is_one_ag200_finding_with_its_position() -> None:
    [finding] = lint_source("def f(:\n    pass\n", "bad.py")
    assert (finding.code, finding.line) == ("AG200", 1)
    assert "syntax error" in finding.message


def test_non_utf8_bytes_are_one_ag200_finding() -> None:
    [finding] = lint_source(b"x = 1\ny = '\xff\xfe'\n", "latin.py")
    assert finding.code == "AG200" and "not valid utf-8" in finding.message
    assert finding.line == 2


def test_declared_latin1_encoding_is_honoured() -> None:
    src = (
        "# -*- coding: latin-1 -*-\nimport torch\nname = 'caf\xe9'\n"
        "s = torch.cuda.amp.GradScaler()\n"
    )
    assert [f.code for f in lint_source(src.encode("latin-1"))] == ["AG206"]


def test_null_bytes_are_an_ag200_finding() -> None:
    assert [f.code for f in lint_source(b"x = 1\x00\n")] == ["AG200"]


def test_ag200_can_be_ignored() -> None:
    assert lint_source("def f(:\n", ignore="AG200") == []


def test_column_counts_characters_not_utf8_bytes() -> None:
    [finding] = lint_source("import torch\nnamé = 'é'; s = torch.cuda.amp.GradScaler()\n")
    assert finding.col == len("namé = 'é'; s = ") + 1


def test_ag208_default_depends_on_the_targeted_torch() -> None:
    src = "import torch\nstate = torch.load('ckpt.pt')\n"
    assert [f.code for f in lint_source(src, torch_version="2.4.1")] == ["AG208"]
    assert lint_source(src, torch_version="2.6") == []


def test_bad_torch_version_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="torch_version"):
        lint_source("x = 1\n", torch_version="latest")


def _tree(root: Path) -> None:
    bug = "import torch\ns = torch.cuda.amp.GradScaler()\n"
    for rel in (
        "pkg/train.py",
        "pkg/sub/more.py",
        ".venv/lib/x.py",
        "build/gen.py",
        "node_modules/a.py",
        "pkg/__pycache__/c.py",
        "pkg/notes.txt",
        "vendor/v.py",
    ):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bug)


def test_folders_recurse_into_py_files_and_skip_common_excludes(tmp_path: Path) -> None:
    _tree(tmp_path)
    found = {Path(f.path).relative_to(tmp_path).as_posix() for f in lint_paths(tmp_path)}
    assert found == {"pkg/train.py", "pkg/sub/more.py", "vendor/v.py"}


def test_exclude_patterns_skip_folders_and_files(tmp_path: Path) -> None:
    _tree(tmp_path)
    found = {Path(f.path).name for f in lint_paths([tmp_path], exclude=["vendor", "more.py"])}
    assert found == {"train.py"}


def test_a_file_named_explicitly_is_linted_even_without_py_suffix(tmp_path: Path) -> None:
    script = tmp_path / "train"
    script.write_text("import torch\ns = torch.cuda.amp.GradScaler()\n")
    assert [f.code for f in lint_paths([script])] == ["AG206"]


def test_a_file_reached_twice_is_linted_once(tmp_path: Path) -> None:
    _tree(tmp_path)
    once = lint_paths([tmp_path / "pkg"])
    assert lint_paths([tmp_path / "pkg", tmp_path / "pkg" / "train.py"]) == once


def test_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        lint_paths([tmp_path / "nope.py"])


def test_paths_must_be_strings_or_pathlike() -> None:
    with pytest.raises(TypeError, match="paths must hold"):
        lint_paths([3])  # type: ignore[list-item]
