"""ampguard._util: the shared atomic writer and argument validators."""

from __future__ import annotations

import os

import pytest

from ampguard._util import atomic
from ampguard._util.checks import check_bool, check_finite, check_int, is_int, is_number


def test_write_text_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    atomic.write_text(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failing_writer_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_mode_follows_the_umask_or_stays_that_of_the_replaced_file(tmp_path):
    old = os.umask(0o027)
    try:
        atomic.write_bytes(tmp_path / "new", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o640
    (tmp_path / "kept").write_bytes(b"")
    os.chmod(tmp_path / "kept", 0o600)
    atomic.write_bytes(tmp_path / "kept", b"y")
    assert (tmp_path / "kept").stat().st_mode & 0o777 == 0o600


def test_temp_name_is_used_and_a_taken_name_is_skipped(tmp_path):
    names = iter(["taken", "free"])
    (tmp_path / "taken").write_text("someone else's")
    seen = []

    def write(f):
        seen.extend(p.name for p in tmp_path.iterdir())
        f.write(b"x")

    atomic.atomic_write(tmp_path / "t", write, temp_name=lambda target: next(names))
    assert "free" in seen and (tmp_path / "taken").read_text() == "someone else's"


def test_validators_name_the_argument_and_reject_bool():
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_number(3.5) and not is_number(False)
    assert check_int("steps", 2) == 2
    with pytest.raises(ValueError, match=r"^steps must be an integer >= 1, got True$"):
        check_int("steps", True)
    with pytest.raises(ValueError, match=r"^n must be None or an integer >= 0, got -1$"):
        check_int("n", -1, 0, optional=True)
    assert check_int("n", None, optional=True) is None
    with pytest.raises(TypeError, match=r"^flag must be True or False, got 1$"):
        check_bool("flag", 1)
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0, got nan$"):
        check_finite("x", float("nan"), positive=True)
    with pytest.raises(ValueError, match=r"^x must be None or a finite number, got 'a'$"):
        check_finite("x", "a", optional=True)
