"""``lint --diff`` applies with the real ``patch -p1`` and ``git apply`` and gives exactly the
bytes ``--fix`` writes: no newline at the end, BOM, a non-UTF-8 file with a coding comment, lone
CR and CRLF newlines, names with spaces, absolute paths; and a property test over files full of
hostile characters."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from _lint import lint_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampguard.lint import fix_paths, fix_source, unified_diff, unified_diff_bytes

PATCH, GIT = shutil.which("patch"), shutil.which("git")
needs_tools = pytest.mark.skipif(not (PATCH and GIT), reason="needs the patch and git binaries")

LOOP = (
    "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in xs:\n"
    "    scaler.scale(f(x)).backward()\n    scaler.step(opt)"
)
CASES: dict[str, tuple[str, bytes]] = {
    "no_newline_at_end": ("t.py", b"import torch\ns = torch.cuda.amp.GradScaler()"),
    "insert_after_last_line_without_newline": ("t.py", LOOP.encode()),
    "bom_crlf": ("t.py", b"\xef\xbb\xbfimport torch\r\ns = torch.cuda.amp.GradScaler()\r\n"),
    "latin1_cookie": (
        "t.py",
        "# -*- coding: latin-1 -*-\nimport torch\nname = 'caf\xe9'\n"
        "s = torch.cuda.amp.GradScaler()\n".encode("latin-1"),
    ),
    "lone_cr": ("t.py", (LOOP.replace("\n", "\r") + "\r").encode()),
    "lone_cr_no_end": ("t.py", b"import torch\rs = torch.cuda.amp.GradScaler()"),
    "crlf": ("t.py", (LOOP.replace("\n", "\r\n") + "\r\n").encode()),
    "space_in_name": ("my train.py", b"import torch\ns = torch.cuda.amp.GradScaler()\n"),
    "quote_in_name": ('we"ird\\.py', b"import torch\ns = torch.cuda.amp.GradScaler()\n"),
    "form_feed": (
        "t.py",
        b"import torch\n\x0c\n# \xc2\x85 \xe2\x80\xa8\ns = torch.cuda.amp.GradScaler()\n",
    ),
}


def _apply(diff: bytes, folder: Path, tool: str, *extra: str) -> subprocess.CompletedProcess:
    if tool == "patch":
        cmd = [PATCH, "-p1", "--batch", "--quiet", *extra]
    else:
        cmd = [GIT, "apply", "--unsafe-paths", *extra, "-"]
    return subprocess.run(cmd, input=diff, cwd=folder, capture_output=True, timeout=30)


def _fixed_bytes(name: str, data: bytes, tmp: Path) -> bytes:
    where = tmp / "fix"
    where.mkdir()
    (where / name).write_bytes(data)
    assert lint_cli("--fix", name, cwd=where).returncode in (0, 1)
    return (where / name).read_bytes()


@needs_tools
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tool", ["patch", "git"])
def test_the_diff_applies_and_equals_what_fix_writes(case: str, tool: str, tmp_path: Path) -> None:
    name, data = CASES[case]
    expected = _fixed_bytes(name, data, tmp_path)
    assert expected != data
    ast.parse(expected)
    work = tmp_path / "work"
    work.mkdir()
    (work / name).write_bytes(data)
    shown = subprocess.run(
        [os.sys.executable, "-m", "ampguard", "lint", "--diff", "."],
        cwd=work,
        capture_output=True,
        timeout=60,
    )
    assert shown.returncode == 1 and (work / name).read_bytes() == data
    assert b"a//" not in shown.stdout
    done = _apply(shown.stdout, work, tool)
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
    assert (work / name).read_bytes() == expected


@needs_tools
@pytest.mark.parametrize("tool", ["patch", "git"])
def test_an_absolute_path_is_named_relative_to_the_current_folder(
    tool: str, tmp_path: Path
) -> None:
    data = b"import torch\ns = torch.cuda.amp.GradScaler()\n"
    (tmp_path / "pkg").mkdir()
    target = tmp_path / "pkg" / "m.py"
    target.write_bytes(data)
    shown = subprocess.run(
        [os.sys.executable, "-m", "ampguard", "lint", "--diff", str(target)],
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert shown.stdout.startswith(b"--- a/pkg/m.py\n+++ b/pkg/m.py\n")
    assert _apply(shown.stdout, tmp_path, tool).returncode == 0
    assert target.read_bytes() == data.replace(
        b"torch.cuda.amp.GradScaler()", b'torch.amp.GradScaler("cuda")'
    )


@needs_tools
def test_a_file_outside_the_current_folder_is_named_from_the_root(tmp_path: Path) -> None:
    data = b"import torch\ns = torch.cuda.amp.GradScaler()\n"
    target = tmp_path / "m.py"
    target.write_bytes(data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = subprocess.run(
        [os.sys.executable, "-m", "ampguard", "lint", "--diff", str(target)],
        cwd=elsewhere,
        capture_output=True,
        timeout=60,
    )
    rel = str(target).lstrip("/").encode()
    assert shown.stdout.startswith(b"--- a/" + rel + b"\n")
    done = _apply(shown.stdout, Path("/"), "patch")
    assert done.returncode == 0, done.stderr
    assert b'torch.amp.GradScaler("cuda")' in target.read_bytes()


def test_the_text_diff_marks_a_missing_final_newline() -> None:
    fixed = fix_source("import torch\ns = torch.cuda.amp.GradScaler()")
    text = unified_diff(fixed)
    assert text.endswith(
        "-s = torch.cuda.amp.GradScaler()\n\\ No newline at end of file\n"
        '+s = torch.amp.GradScaler("cuda")\n\\ No newline at end of file\n'
    )
    assert unified_diff_bytes(fixed) == text.encode()


# ------------------------------------------------------------------------------ property test
_HOSTILE = st.sampled_from(
    ["\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x0b", "é", "\t", "\ufeff"]
)
_STATEMENTS = st.sampled_from(
    [
        "s = torch.cuda.amp.GradScaler()",
        "with torch.cuda.amp.autocast():\n    y = 1",
        "m.load_state_dict(torch.load('m.pt'))",
        "x = 1",
        "\x0c",
        "",
    ]
)


@st.composite
def _hostile_files(draw: st.DrawFn) -> tuple[bytes, str]:
    newline = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    lines = ["import torch"]
    for _ in range(draw(st.integers(1, 6))):
        lines.append(draw(_STATEMENTS))
        char = draw(_HOSTILE)
        lines.append(draw(st.sampled_from([f"# a{char}b", f"t = 'a{char}b'", "\x0c"])))
    text = newline.join(line.replace("\n", newline) for line in lines)
    if draw(st.booleans()):
        text += newline
    bom = draw(st.booleans())
    return (b"\xef\xbb\xbf" if bom else b"") + text.encode(), newline


@needs_tools
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_hostile_files())
def test_fix_output_parses_and_the_diff_applies_to_the_same_bytes(case: tuple[bytes, str]) -> None:
    data, _ = case
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "t.py"
        path.write_bytes(data)
        [dry] = fix_paths([path], write=False, torch_version="2.4") or [None]
        if dry is None:
            return
        diff = unified_diff_bytes(dry, root=work)
        [done] = fix_paths([path], torch_version="2.4")
        written = path.read_bytes()
        ast.parse(written)
        assert fix_paths([path], torch_version="2.4") == []  # idempotent
        path.write_bytes(data)
        applied = _apply(diff, work, "patch")
        assert applied.returncode == 0, applied.stdout
        assert path.read_bytes() == written
