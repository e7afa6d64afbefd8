"""Lint reads regular files only: a FIFO named x.py never blocks, a symlink to
/dev/zero is never read, symlink loops end, and a file over the size cap is an AG200 finding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ampguard.lint import MAX_FILE_BYTES, lint_paths

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX special files"),
]

CLEAN = "import torch\nscaler = torch.amp.GradScaler('cuda')\n"


@pytest.fixture
def tree(tmp_path):
    """A folder with one real script and every kind of special file named *.py."""
    (tmp_path / "ok.py").write_text(CLEAN)
    os.mkfifo(tmp_path / "x.py")
    os.symlink("/dev/zero", tmp_path / "y.py")
    os.symlink("loop.py", tmp_path / "loop.py")  # a symlink to itself
    os.symlink(".", tmp_path / "here")  # a folder loop
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    os.symlink("../..", tmp_path / "sub" / "deeper" / "up")
    (tmp_path / "dir.py").mkdir()  # a folder named like a script
    (tmp_path / "dir.py" / "inner.py").write_text(CLEAN)
    os.symlink("ok.py", tmp_path / "alias.py")  # a link to a regular file is read (once)
    os.symlink("missing_target.py", tmp_path / "dangling.py")
    return tmp_path


def messages(findings) -> dict[str, str]:
    return {os.path.basename(f.path): f.message for f in findings}


def test_special_files_in_a_folder_are_findings_not_reads(tree):
    found = messages(lint_paths([tree]))
    assert found["x.py"] == "not read: a FIFO (named pipe), not a regular file"
    assert found["y.py"] == "not read: a character device, not a regular file"
    assert found["loop.py"].startswith("cannot read the file: Too many levels of symbolic links")
    assert found["dangling.py"] == (
        "not read: a dangling symlink: it points to 'missing_target.py' "
        f"({tree / 'missing_target.py'}), which does not exist"
    )
    assert set(found) == {"x.py", "y.py", "loop.py", "dangling.py"}  # ok.py and inner.py: clean


def test_special_files_named_on_the_command_line(tree):
    names = ["x.py", "y.py", "loop.py", "dangling.py"]
    found = messages(lint_paths([tree / n for n in names]))
    assert set(found) == {"x.py", "y.py", "loop.py", "dangling.py"}
    assert lint_paths([tree / "dir.py"]) == []  # a folder named x.py is walked as a folder


def test_a_file_over_the_cap_is_not_read(tmp_path):
    big = tmp_path / "big.py"
    with open(big, "wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used, nothing worth reading
    (finding,) = lint_paths([big])
    assert finding.code == "AG200" and f"{MAX_FILE_BYTES + 1:,} bytes" in finding.message
    at_cap = tmp_path / "at_cap.py"
    at_cap.write_bytes(b"x = 1\n" + b"#" * (MAX_FILE_BYTES - 7) + b"\n")
    assert lint_paths([at_cap]) == []


def test_the_cli_over_special_files_ends_with_findings(tree):
    out = subprocess.run(
        [sys.executable, "-m", "ampguard", "lint", str(tree)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "x.py:1:1: AG200 [error] not read: a FIFO" in out.stdout
