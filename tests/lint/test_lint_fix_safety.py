"""``lint --fix`` never loses a byte of a user's file: hostile characters, symlinks, full and
read-only disks, unwritable files, a file saved while ``--fix`` runs, and undecodable bytes.

Real files, real tmpfs mounts (the machine runs tests as root; skipped cleanly where mount
fails), the real CLI in a subprocess.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
from _lint import lint_cli

import ampguard.lint._lint as lint_module
from ampguard.lint import fix_paths, fix_source, lint_paths, lint_source, unified_diff

FIX_ME = "s = torch.cuda.amp.GradScaler()\n"
FIXED = 's = torch.amp.GradScaler("cuda")\n'
# characters str.splitlines() splits at and the tokenizer does not
HOSTILE = ["\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x0b"]


def _mount(path: Path, options: str) -> Path:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return path


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.mark.parametrize("char", HOSTILE, ids=[f"U+{ord(c):04X}" for c in HOSTILE])
def test_characters_splitlines_splits_at_do_not_move_the_edits(char: str) -> None:
    comment = "\x0c\n" if char == "\x0c" else f"# page {char} break\n"
    source = (
        f'import torch\n{comment}x = "a{char}b"\n{FIX_ME}for i in range(3):\n'
        "    with torch.cuda.amp.autocast():\n        pass\n"
    )
    result = fix_source(source)
    expected = source.replace(FIX_ME, FIXED).replace(
        "torch.cuda.amp.autocast()", 'torch.amp.autocast("cuda")'
    )
    assert result.text == expected
    ast.parse(result.text)
    added = [line for line in unified_diff(result).split("\n")[2:] if line.startswith("+")]
    assert added == ["+" + FIXED.rstrip("\n"), '+    with torch.amp.autocast("cuda"):']


def test_a_form_feed_in_an_indentation_is_not_copied_into_an_inserted_line() -> None:
    source = (
        "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in xs:\n"
        "    scaler.scale(f(x)).backward()\n\x0c    scaler.step(opt)\n"
    )
    fixed = fix_source(source).text
    assert fixed == source + "    scaler.update()\n"
    ast.parse(fixed)


def test_fix_never_writes_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target.py"
    target.write_text(f"import torch\n{FIX_ME}")
    project = tmp_path / "project"
    project.mkdir()
    (project / "link.py").symlink_to(target)
    (project / "own.py").write_text(f"import torch\n{FIX_ME}")
    before = target.stat().st_mtime_ns
    result = lint_cli("--fix", "project", cwd=tmp_path)
    assert target.read_text() == f"import torch\n{FIX_ME}"
    assert target.stat().st_mtime_ns == before
    assert (project / "link.py").is_symlink()
    assert (project / "own.py").read_text() == f"import torch\n{FIXED}"
    lines = [line for line in result.stderr.splitlines() if "link.py" in line]
    assert len(lines) == 1 and "symlink" in lines[0] and "not fixed" in lines[0]
    assert "Traceback" not in result.stderr and result.returncode == 1
    diff = lint_cli("--diff", "project", cwd=tmp_path)
    assert "link.py" not in diff.stdout and "symlink" in diff.stderr


def test_fix_keeps_the_mode_and_the_owner(tmp_path: Path) -> None:
    path = tmp_path / "run.py"
    path.write_text(f"import torch\n{FIX_ME}")
    path.chmod(0o751)
    if os.geteuid() == 0:
        os.chown(path, 1234, 4321)
    [done] = fix_paths(tmp_path)
    assert done.error is None
    assert path.read_text() == f"import torch\n{FIXED}"
    assert path.stat().st_mode & 0o7777 == 0o751
    if os.geteuid() == 0:
        assert (path.stat().st_uid, path.stat().st_gid) == (1234, 4321)
    assert [p.name for p in tmp_path.iterdir()] == ["run.py"]  # no temporary left


def test_fix_on_a_full_disk_leaves_the_file_whole(tmp_path: Path) -> None:
    disk = _mount(tmp_path / "disk", "size=200k")
    try:
        # a file of exactly eight pages: the fix (one byte longer) needs a ninth
        body = f"import torch\n{FIX_ME}"
        pad = 4096 * 8 - len(body) - 2
        source = "#" + "x" * pad + "\n" + body
        path = disk / "train.py"
        path.write_text(source)
        fill = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fill, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fill)
        result = lint_cli("--fix", str(path), cwd=tmp_path)
        assert path.read_text() == source
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if "not fixed" in line]
        assert len(lines) == 1 and "train.py" in lines[0] and "No space left" in lines[0]
        assert result.returncode == 1
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "train.py"]
    finally:
        _umount(disk)


def test_a_read_only_file_is_named_and_the_others_are_fixed(tmp_path: Path) -> None:
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(f"import torch\n{FIX_ME}")
    (tmp_path / "b.py").chmod(0o444)
    result = lint_cli("--fix", ".", cwd=tmp_path)
    assert "Traceback" not in result.stderr
    assert (tmp_path / "a.py").read_text() == f"import torch\n{FIXED}"
    assert (tmp_path / "c.py").read_text() == f"import torch\n{FIXED}"
    assert (tmp_path / "b.py").read_text() == f"import torch\n{FIX_ME}"
    assert (tmp_path / "b.py").stat().st_mode & 0o777 == 0o444
    lines = [line for line in result.stderr.splitlines() if "not fixed" in line]
    assert len(lines) == 1 and "b.py" in lines[0] and "read-only" in lines[0]
    assert "fixed 2 finding(s) in 2 file(s)" in result.stderr
    assert result.returncode == 1


def test_a_read_only_filesystem_gives_one_line_per_file(tmp_path: Path) -> None:
    disk = _mount(tmp_path / "disk", "size=200k")
    try:
        for name in ("a.py", "b.py"):
            (disk / name).write_text(f"import torch\n{FIX_ME}")
        remount = subprocess.run(
            ["mount", "-o", "remount,ro", str(disk)], capture_output=True, timeout=30
        )
        if remount.returncode != 0:
            pytest.skip("cannot remount read-only")
        result = lint_cli("--fix", str(disk), cwd=tmp_path)
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if "not fixed" in line]
        assert len(lines) == 2 and all("Read-only file system" in line for line in lines)
        assert {Path(line.split(": ")[0]).name for line in lines} == {"a.py", "b.py"}
        assert (disk / "a.py").read_text() == f"import torch\n{FIX_ME}"
        assert result.returncode == 1
    finally:
        _umount(disk)


def test_a_file_saved_while_fix_runs_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.py"
    path.write_text(f"import torch\n{FIX_ME}")
    other = tmp_path / "other.py"
    other.write_text(f"import torch\n{FIX_ME}")
    real = lint_module.fix_text
    saved = f"import torch\n{FIX_ME}# the user's edit, saved while --fix ran\n"

    def user_saves_meanwhile(text, name, *args, **kwargs):
        result = real(text, name, *args, **kwargs)
        if name.endswith("train.py"):
            path.write_text(saved)  # same second, other content: mtime may not move
        return result

    monkeypatch.setattr(lint_module, "fix_text", user_saves_meanwhile)
    results = {Path(f.path).name: f for f in fix_paths(tmp_path)}
    assert path.read_text() == saved
    assert "changed while" in (results["train.py"].error or "")
    assert results["other.py"].error is None
    assert other.read_text() == f"import torch\n{FIXED}"


def test_same_size_same_mtime_edit_is_caught_by_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "train.py"
    path.write_text(f"import torch\n{FIX_ME}")
    stat = path.stat()
    real = lint_module.fix_text

    def same_size_edit(text, name, *args, **kwargs):
        result = real(text, name, *args, **kwargs)
        path.write_text(f"import TORCH\n{FIX_ME}")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return result

    monkeypatch.setattr(lint_module, "fix_text", same_size_edit)
    [done] = fix_paths(tmp_path)
    assert "changed while" in (done.error or "")
    assert path.read_text() == f"import TORCH\n{FIX_ME}"


def test_latin1_without_a_coding_comment_is_ag200(tmp_path: Path) -> None:
    data = f"import torch\n# caf\xe9 au lait\n{FIX_ME}".encode("latin-1")
    [finding] = lint_source(data, "x.py")
    assert finding.code == "AG200" and "utf-8" in finding.message.lower()
    assert finding.line == 2
    path = tmp_path / "x.py"
    path.write_bytes(data)
    assert [f.code for f in lint_paths([path])] == ["AG200"]
    result = lint_cli("--fix", "x.py", cwd=tmp_path)
    assert path.read_bytes() == data
    assert "x.py:2:1: AG200" in result.stdout and result.returncode == 1
    declared = b"# -*- coding: latin-1 -*-\n" + data
    assert {f.code for f in lint_source(declared, "y.py")} == {"AG206"}


@pytest.mark.parametrize("char", ["\x0c", "\x85", "\u2028"])
def test_noqa_and_columns_are_read_on_the_tokenizers_lines(char: str) -> None:
    source = f"import torch\n# a{char}b\ns = torch.cuda.amp.GradScaler()  # noqa: AG206\n"
    assert [f.code for f in lint_source(source)] == []
    [finding] = lint_source(source.replace("  # noqa: AG206", ""))
    assert (finding.line, finding.col) == (3, 5)


@pytest.mark.slow  # subprocesses killed mid-run
@pytest.mark.parametrize("delay", [0.4, 0.7, 1.0, 1.4])
def test_a_killed_fix_leaves_every_file_whole(tmp_path: Path, delay: float) -> None:
    import signal
    import sys
    import time

    body = "".join(f"# line {i} " + "x" * 60 + "\n" for i in range(2000))
    original = f"import torch\n{body}{FIX_ME}"
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(original)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampguard", "lint", "--fix", "--select", "AG206", "."],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    fixed = original.replace(FIX_ME, FIXED)
    for path in sorted(tmp_path.glob("*.py")):
        assert path.read_text() in (original, fixed), path.name  # never half-written
