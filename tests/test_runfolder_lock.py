"""One run folder, one writer: a lock file with the pid, stale locks taken
over, a clear error for a second writer, released on close."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.runlog import load_run
from ampguard.runlog._lock import LOCK

_SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def _guard(run):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, ag.Guard(model, opt, precision="bf16", telemetry=run)


def _steps(model, guard, n):
    for _ in range(n):
        with guard.autocast():
            loss = model(torch.randn(2, 4)).float().pow(2).mean()
        guard.backward(loss)
        guard.step()


def test_a_second_guard_in_the_same_process_is_refused_naming_folder_and_holder(tmp_path):
    run = tmp_path / "run"
    model, first = _guard(run)
    holder = json.loads((run / LOCK).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(ag.TelemetryError, match="being written by another Guard") as info:
        _guard(run)
    assert str(run) in str(info.value) and str(os.getpid()) in str(info.value)
    _steps(model, first, 5)
    first.close()
    assert not (run / LOCK).exists()
    model, second = _guard(run)  # released on close: the next writer may start
    _steps(model, second, 3)
    second.close()
    assert load_run(run).steps.tolist() == [1, 2, 3]


def test_a_dropped_unclosed_guard_does_not_hold_the_folder_forever(tmp_path):
    run = tmp_path / "run"
    model, guard = _guard(run)
    _steps(model, guard, 2)
    del guard, model  # never closed; unreachable (a reference cycle with its telemetry)
    model, again = _guard(run)
    _steps(model, again, 1)
    again.close()


_HOLDER = textwrap.dedent(
    """
    import sys, time, torch, ampguard as ag
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="bf16", telemetry=sys.argv[1])
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.slow  # a second process holds the lock, then is killed
def test_another_process_is_refused_and_its_lock_is_taken_over_once_it_died(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(_SRC))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run)], stdout=subprocess.PIPE, env=env
    )
    try:
        deadline = time.monotonic() + 60
        line = b""
        while b"ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert b"ready" in line, "the holder process did not start"
        with pytest.raises(ag.TelemetryError, match=f"pid {proc.pid}") as info:
            _guard(run)
        assert str(run) in str(info.value)
        proc.send_signal(signal.SIGKILL)  # a crash: the lock file stays, stale
        proc.wait(timeout=30)
        assert (run / LOCK).exists()
        assert json.loads((run / LOCK).read_text())["pid"] == proc.pid
        model, guard = _guard(run)  # the dead pid's lock is taken over
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
        _steps(model, guard, 2)
        guard.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_symlinked_lock_file_is_refused_and_its_target_left_alone(tmp_path):
    from ampguard.runlog._lock import RunFolderLock

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / LOCK).symlink_to(victim)
    with pytest.raises(ag.TelemetryError, match="symlink") as info:
        RunFolderLock(run)
    assert LOCK in str(info.value) and str(victim) in str(info.value)
    assert victim.read_text() == "precious\n"
    assert (run / LOCK).is_symlink()


def test_a_dangling_lock_link_creates_nothing_outside_the_run_folder(tmp_path):
    from ampguard.runlog._lock import RunFolderLock

    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "elsewhere" / "created.txt"
    outside.parent.mkdir()
    (run / LOCK).symlink_to(outside)
    with pytest.raises(ag.TelemetryError, match="symlink"):
        RunFolderLock(run)
    assert not outside.exists() and os.listdir(outside.parent) == []
    with pytest.raises(ag.TelemetryError, match="symlink"):
        _guard(run)  # through the Guard: the same refusal, nothing created
    assert not outside.exists()
