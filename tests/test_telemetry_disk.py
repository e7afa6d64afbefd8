"""The run log on a full or read-only disk, and checkpoints beside it.

Real small tmpfs mounts (the machine runs tests as root); skipped cleanly where mount fails.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import warnings

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.reporting.summary import run_facts, summary_text
from ampguard.runlog import EventLog, load_run


def _mount(path, options: str):
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return path


@pytest.fixture
def small_disk(tmp_path):
    disk = _mount(tmp_path / "disk", "size=512k")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], timeout=30)


def _fill(disk) -> None:
    """Fill the disk to the last byte (the filler is ``disk/filler``)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 16, 4096, 1):  # big chunks, then the last page, then the last bytes
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    probe = disk / "probe"
    with pytest.raises(OSError) as info:
        probe.write_bytes(b"x" * 8192)
    assert info.value.errno == errno.ENOSPC
    probe.unlink(missing_ok=True)


def _free(disk) -> None:
    (disk / "filler").unlink()


def _setup(run, **telemetry):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tel = ag.Telemetry(run, layer_every=1, range_every=0, **telemetry)
    return model, opt, ag.Guard(model, opt, precision="fp16", telemetry=tel)


def _window(model, guard, i: int):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    with guard.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    guard.backward(loss)


def _train(model, guard, steps):
    out = []
    for i in steps:
        _window(model, guard, i)
        out.append(guard.step())
    return out


def _whole_lines(path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a failed write left a partial line"
    return [json.loads(line) for line in data.splitlines()]


def test_a_full_disk_suspends_telemetry_with_one_warning_and_training_goes_on(small_disk):
    run = small_disk / "run"
    model, opt, guard = _setup(run, flush_every=5)
    _fill(small_disk)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _train(model, guard, range(1, 13))
    assert [r.step for r in results] == list(range(1, 13))
    assert all(r.applied for r in results)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    ours = [w for w in caught if "telemetry" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    text = str(ours[0].message)
    assert "events.jsonl" in text and "No space left on device" in text and "suspended" in text
    assert _whole_lines(run / "events.jsonl") == []
    assert guard.telemetry.unrecorded["records"] == 10
    assert guard.telemetry.unrecorded["suspended"]

    # space comes back: the next flush records the gap first, then the new steps
    _free(small_disk)
    _train(model, guard, range(13, 21))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard.close()
    lines = _whole_lines(run / "events.jsonl")
    gap = lines[0]
    assert gap["kind"] == "unrecorded" and (gap["step"], gap["last"]) == (1, 10)
    assert gap["reason"] == "disk full" and gap["records"] == 10
    log = load_run(run)
    assert log.steps.tolist() == list(range(11, 21))
    facts = run_facts(log, {})
    text = summary_text(log, [], facts)
    assert "steps 1-10 not recorded (disk full)" in text
    found = json.loads((run / "findings.json").read_text())
    ag140 = [f for f in found if f["code"] == "AG140"]
    assert len(ag140) == 1 and ag140[0]["step"] == 1
    assert "steps 1-10 not recorded (disk full)" in ag140[0]["message"]
    assert not (run / ".ampguard.lock").exists()
    html = (run / "report.html").read_text()  # written at close, now that there is room
    assert "steps 1-10 not recorded (disk full)" in html


def test_a_failed_write_never_leaves_a_partial_line(small_disk):
    """Half a page of room: the flush's lines do not fit, the write is cut back whole."""
    run = small_disk / "run"
    model, opt, guard = _setup(run, flush_every=40)
    _train(model, guard, range(1, 3))
    guard.telemetry.flush()
    size = (run / "events.jsonl").stat().st_size
    _fill(small_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, guard, range(3, 43))  # 40 records (> 4 KiB) due at step 42
    assert any("No space left" in str(w.message) for w in caught)
    assert (run / "events.jsonl").stat().st_size == size
    assert [r["step"] for r in _whole_lines(run / "events.jsonl")] == [1, 2]
    assert guard.telemetry.unrecorded["gaps"][0]["step"] == 3


def test_raise_mode_raises_before_the_update_and_the_window_can_be_stepped_again(small_disk):
    run = small_disk / "run"
    model, opt, guard = _setup(run, flush_every=4, on_write_error="raise")
    _train(model, guard, range(1, 5))  # the 4 records are written before step 5's update
    _fill(small_disk)
    _window(model, guard, 5)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ag.TelemetryError, match="events.jsonl") as info:
        guard.step()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert "disk full" in str(info.value)
    assert guard.steps == 4
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    _free(small_disk)
    result = guard.step()  # the same window, now that there is room
    assert result.step == 5 and result.applied
    guard.close()
    assert load_run(run).steps.tolist() == [1, 2, 3, 4, 5]


def test_close_on_a_full_disk_never_raises_a_bare_oserror(small_disk):
    for mode, error in (("warn", None), ("raise", ag.TelemetryError)):
        run = small_disk / f"run-{mode}"
        model, opt, guard = _setup(run, flush_every=50, on_write_error=mode)
        _train(model, guard, range(1, 4))
        _fill(small_disk)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            if error is None:
                guard.close()
            else:
                with pytest.raises(error, match="run-raise"):
                    guard.close()
        assert guard.telemetry.closed
        assert not (run / ".ampguard.lock").exists()
        _free(small_disk)


def test_guard_on_an_unwritable_folder_fails_at_construction_naming_it(tmp_path, small_disk):
    ro = _mount(tmp_path / "ro", "ro,size=64k")
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ag.TelemetryError, match=str(ro / "run")) as info:
            ag.Guard(model, opt, precision="bf16", telemetry=ro / "run")
        assert isinstance(info.value.__cause__, OSError)
    finally:
        subprocess.run(["umount", "-l", str(ro)], timeout=30)
    _fill(small_disk)
    with pytest.raises(ag.TelemetryError, match=str(small_disk / "run")):
        ag.Guard(model, opt, precision="bf16", telemetry=small_disk / "run")


def test_checkpoint_is_written_when_the_run_log_disk_is_full(tmp_path, small_disk):
    for mode in ("warn", "raise"):
        run = small_disk / f"run-{mode}"
        model, opt, guard = _setup(run, flush_every=100, on_write_error=mode)
        _train(model, guard, range(1, 4))
        _fill(small_disk)
        ckpt = tmp_path / f"ckpt-{mode}.pt"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ag.save_checkpoint(ckpt, model=model, optimizer=opt, guard=guard)
        assert ckpt.exists()
        messages = [str(w.message) for w in caught]
        assert all(str(ckpt) not in m for m in messages)
        if mode == "warn":
            assert any("events.jsonl" in m and "No space left" in m for m in messages)
        fresh = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        ag.load_checkpoint(ckpt, model=fresh)
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        if mode == "raise":  # the kept records fail again at the next update, naming the log
            _window(model, guard, 4)
            with pytest.raises(ag.TelemetryError, match="events.jsonl") as info:
                guard.step()
            assert str(ckpt) not in str(info.value)
        _free(small_disk)
        if mode == "raise":  # nothing lost: the kept records go first, then window 4
            assert guard.step().applied
        else:
            _train(model, guard, [4])
        guard.close()
        log = load_run(run)
        if mode == "raise":
            assert log.steps.tolist() == [1, 2, 3, 4] and log.unrecorded == []
        else:  # counted, and said
            assert log.steps.tolist() == [4]
            assert [(g["step"], g["last"]) for g in log.unrecorded] == [(1, 3)]


def test_the_reader_tells_a_failed_write_from_a_crash(tmp_path, monkeypatch):
    """Where even the cut-back fails (injected), the fragment is named a failed write."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, fresh=True)
    real_write, real_truncate = os.write, os.ftruncate

    def half_write(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", half_write)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError):
        log.write_lines(['{"step":1}\n'])
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "ftruncate", real_truncate)
    assert log.torn
    log.write_lines(['{"kind":"unrecorded","step":1,"last":1,"reason":"disk full"}\n'])
    log.write_lines(['{"step":2}\n'])
    log.close()
    from ampguard.runlog._read import read_columns

    with pytest.warns(RuntimeWarning, match="a write that failed: disk full"):
        cols = read_columns(path, 0)
    assert cols["steps"].tolist() == [2]

    crashed = tmp_path / "crashed.jsonl"
    crashed.write_bytes(b'{"step":1}\n{"step":')
    with pytest.warns(RuntimeWarning, match="killed mid-append"):
        read_columns(crashed, 0)


def test_a_gap_is_recorded_at_close_when_space_came_back_after_the_last_flush(small_disk):
    run = small_disk / "run"
    model, opt, guard = _setup(run, flush_every=5)
    _fill(small_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, guard, range(1, 6))  # steps 1-5 fail at their flush
    _free(small_disk)
    guard.close()  # no new records: the gap line is written alone
    log = load_run(run)
    assert log.steps.tolist() == []
    assert [(g["step"], g["last"], g["records"]) for g in log.unrecorded] == [(1, 5, 5)]
    assert "steps 1-5 not recorded (disk full)" in summary_text(log, [], run_facts(log, {}))
    assert any(f["code"] == "AG140" for f in json.loads((run / "findings.json").read_text()))


def test_a_disk_that_turns_read_only_mid_run_suspends_telemetry(tmp_path, monkeypatch):
    """EROFS injected at the log's write (a disk remounted read-only under an open file: a
    tmpfs cannot be remounted so while the log is open)."""
    run = tmp_path / "run"
    model, opt, guard = _setup(run, flush_every=3)
    _train(model, guard, range(1, 4))
    real_write = os.write

    def read_only(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("events.jsonl"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", read_only)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _train(model, guard, range(4, 10))
        guard.close()  # never a bare OSError
    monkeypatch.setattr(os, "write", real_write)
    assert all(r.applied for r in results)
    ours = [str(w.message) for w in caught if "ampguard telemetry" in str(w.message)]
    assert len(ours) == 1 and "Read-only file system" in ours[0], ours
    assert guard.telemetry.unrecorded["gaps"][0]["reason"] == "read-only file system"
    assert [r["step"] for r in _whole_lines(run / "events.jsonl")] == [1, 2, 3]
    log = load_run(run)  # meta.json (another file) took the gap at close
    assert [(g["step"], g["last"]) for g in log.unrecorded] == [(4, 9)]
