"""Checkpoints: atomic save under SIGKILL, weights_only load, hostile files, plain-loop adoption."""

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models import batch, make_model
from torch import nn

import ampguard as ag
from ampguard.checkpoint import atomic_write


def trained(steps: int = 2):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = ag.Guard(model, opt, precision="fp16")
    for i in range(steps):
        with guard.autocast():
            loss = F.mse_loss(model(batch(i)[0]).float(), batch(i)[1])
        guard.backward(loss)
        guard.step()
    return model, opt, guard


def fresh():
    model = make_model(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ag.Guard(model, opt, precision="fp16")


def temp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


# ---------------------------------------------------------------------- round trips
def test_checkpoint_file_loads_with_plain_torch_weights_only(tmp_path):
    model, opt, guard = trained()
    ag.save_checkpoint(
        tmp_path / "c.pt", model=model, optimizer=opt, guard=guard, extra={"epoch": 3}
    )
    data = torch.load(tmp_path / "c.pt", weights_only=True)
    assert data["guard"] == guard.state_dict() and data["extra"] == {"epoch": 3}


def test_round_trip_restores_model_optimizer_guard_and_extra(tmp_path):
    model, opt, guard = trained()
    extra = {"epoch": 3, "name": "run", "best": [0.5, None], "t": torch.arange(3)}
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, guard=guard, extra=extra)
    model2, opt2, guard2 = fresh()
    got = ag.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, guard=guard2)
    assert got.keys() == extra.keys() and torch.equal(got["t"], extra["t"])
    assert {k: got[k] for k in ("epoch", "name", "best")} == {
        "epoch": 3,
        "name": "run",
        "best": [0.5, None],
    }
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert guard2.state_dict() == guard.state_dict()
    assert guard2.resume["scale_reset"] is False


def test_scheduler_and_rng_state_round_trip(tmp_path):
    model, opt, _ = trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()  # no grads: a no-op that keeps the scheduler's order check quiet
    sched.step()
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched)
    expected = torch.rand(3)
    model2, opt2, _ = fresh()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    ag.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, scheduler=sched2)
    assert sched2.state_dict() == sched.state_dict()
    assert torch.equal(torch.rand(3), expected)


def test_optimizer_count_mismatch_is_a_checkpoint_error(tmp_path):
    model = make_model()
    opts = [
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    ]
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opts)
    with pytest.raises(ag.CheckpointError, match=r"holds 2 optimizer state\(s\), 1 optimizer"):
        ag.load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opts[0])


def test_model_that_does_not_fit_is_a_checkpoint_error_naming_the_path(tmp_path):
    ag.save_checkpoint(tmp_path / "c.pt", model=make_model())
    with pytest.raises(ag.CheckpointError, match="does not fit") as info:
        ag.load_checkpoint(tmp_path / "c.pt", model=nn.Linear(8, 32))
    assert str(tmp_path / "c.pt") in str(info.value)


# ---------------------------------------------------------------------- extra validation
@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"obj": object()}, r"extra\['obj'\] holds a object"),
        ({"run": {"dir": Path("/tmp")}}, r"extra\['run'\]\['dir'\] holds a PosixPath"),
        ({"steps": [1, 2, {3, 4}]}, r"extra\['steps'\]\[2\] holds a set"),
        ({(1, 2): 3}, "extra has a key of type tuple"),
        ("epoch=3", "extra must be a dict or None"),
    ],
)
def test_non_plain_extra_is_a_type_error_at_save_time(tmp_path, extra, where):
    target = tmp_path / "c.pt"
    ag.save_checkpoint(target, model=make_model(), extra={"i": 1})
    with pytest.raises(TypeError, match=where):
        ag.save_checkpoint(target, model=make_model(), extra=extra)
    assert ag.load_checkpoint(target, model=make_model()) == {"i": 1}  # previous file intact
    assert temp_files(tmp_path) == []


def test_failed_write_leaves_the_previous_file_and_no_temp_file(tmp_path):
    target = tmp_path / "c.pt"
    ag.save_checkpoint(target, model=make_model(), extra={"i": 1})

    def write_half_then_fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(ag.CheckpointError, match="could not be written: disk full"):
        atomic_write(target, write_half_then_fail)
    assert ag.load_checkpoint(target, model=make_model()) == {"i": 1}
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------------- crash safety
WRITER = textwrap.dedent("""
    import sys, torch, ampguard as ag
    torch.set_num_threads(1)
    path, log = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(1024, 1024)  # ~4 MB: a save takes long enough to be caught mid-way
    with open(log, "a") as out:
        for i in range(10**9):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(i))
            ag.save_checkpoint(path, model=model, extra={"i": i}, rng=False)
            out.write(f"{i}\\n")
            out.flush()
""")


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


def kill_writer_at(folder: Path, moment: str) -> tuple[list[str], list[Path]]:
    """Run the writer, SIGKILL it at ``moment``; return the logged saves and stray temp files."""
    script, log, target = folder / "writer.py", folder / "saved.log", folder / "ckpt.pt"
    script.write_text(WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(target), str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: log.exists() and log.read_text().count("\n") >= 2, 60, "first saves")
        if moment == "temp file created":
            wait_for(lambda: temp_files(folder), 20, moment)
        elif moment == "temp file half written":
            wait_for(
                lambda: any(p.stat().st_size > 2**21 for p in temp_files(folder) if p.exists()),
                20,
                moment,
            )
        else:
            time.sleep(float(moment))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    return log.read_text().split(), temp_files(folder)


@pytest.mark.slow  # SIGKILL of a writer process
@pytest.mark.timeout(150)
def test_sigkill_at_any_moment_leaves_a_loadable_consistent_checkpoint(tmp_path):
    moments = ["temp file created", "temp file half written", "0.05", "0.3"]
    strays = 0
    for n, moment in enumerate(moments):
        folder = tmp_path / f"run{n}"
        folder.mkdir()
        logged, temps = kill_writer_at(folder, moment)
        strays += bool(temps)
        model = nn.Linear(1024, 1024)
        extra = ag.load_checkpoint(folder / "ckpt.pt", model=model, rng=False)
        last = int(logged[-1])
        # The file is the last confirmed save or the one renamed just before the kill.
        assert extra["i"] in (last, last + 1), moment
        assert all(torch.all(p == extra["i"]) for p in model.parameters()), moment
        # The next save removes the killed writer's stray temp file (and only that).
        ag.save_checkpoint(folder / "ckpt.pt", model=make_model(), extra={"i": -1})
        assert ag.load_checkpoint(folder / "ckpt.pt", model=make_model()) == {"i": -1}
        assert temp_files(folder) == []
    assert strays >= 1  # at least one kill really landed mid-save


# ---------------------------------------------------------------------- hostile files
class Evil:
    """Pickles as a call to os.system: loading it with plain pickle runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_really_runs_code_under_plain_pickle(tmp_path):
    # Control for the test below: this payload is live.
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps({"model": {}, "x": Evil(marker)}))
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_malicious_pickle_is_refused_without_running_code(tmp_path, writer):
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    payload = {"model": make_model().state_dict(), "x": Evil(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(ag.CheckpointError, match="refused without executing") as info:
        ag.load_checkpoint(path, model=make_model())
    assert str(path) in str(info.value)
    assert not marker.exists()


def write_truncated(path: Path) -> None:
    model, opt, guard = trained()
    ag.save_checkpoint(path, model=model, optimizer=opt, guard=guard)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (write_truncated, "corrupt or truncated"),
        (lambda p: p.write_bytes(random.Random(0).randbytes(4096)), "corrupt"),
        (lambda p: p.write_bytes(b""), "corrupt or truncated"),
        (lambda p: torch.save([1, 2, 3], p), "top level is list"),
        (
            lambda p: torch.save({"weights": torch.ones(2)}, p),
            "not a checkpoint ampguard understands",
        ),
        (
            lambda p: torch.save({"format": "ampguard.checkpoint", "version": 99, "model": {}}, p),
            "unsupported ampguard checkpoint version 99",
        ),
    ],
)
def test_bad_file_is_a_checkpoint_error_naming_the_path(tmp_path, make, reason):
    path = tmp_path / "bad.pt"
    make(path)
    with pytest.raises(ag.CheckpointError, match=reason) as info:
        ag.load_checkpoint(path, model=make_model())
    assert str(path) in str(info.value)


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(ag.CheckpointError, match="no such checkpoint file"):
        ag.load_checkpoint(tmp_path / "nope.pt", model=make_model())


# ---------------------------------------------------------------------- plain torch loops
def torch_loop(model, opt, scaler, windows):
    for i in windows:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(batch(i)[0]).float(), batch(i)[1])
        scaler.scale(loss).backward()
        if i == 2:
            model[2].weight.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def test_plain_loop_checkpoint_loads_with_a_scale_restart_warning(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_loop(model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10), range(3))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    model2, opt2, guard2 = fresh()
    with pytest.warns(RuntimeWarning, match="restarts at init_scale=65536"):
        assert (
            ag.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, guard=guard2) == {}
        )
    assert guard2.scale == 2.0**16 and guard2.resume["scale_reset"] is True
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_plain_loop_grad_scaler_state_is_adopted_and_training_continues_bitwise(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    torch_loop(model, opt, scaler, range(4))
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
        tmp_path / "c.pt",
    )
    model2 = make_model(seed=5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    guard2 = ag.Guard(
        model2,
        opt2,
        precision="fp16",
        scaler=ag.ScalerConfig(init_scale=2.0**10, growth_interval=2),
    )
    with pytest.warns(RuntimeWarning, match="adopted the torch GradScaler state"):
        ag.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, guard=guard2)
    assert guard2.scale == scaler.get_scale()
    assert guard2.state_dict()["scaler"]["growth_tracker"] == scaler.state_dict()["_growth_tracker"]
    torch_loop(model, opt, scaler, range(4, 9))  # the torch run goes on ...
    for i in range(4, 9):  # ... and so does the migrated one, through the Guard
        with guard2.autocast():
            loss = F.mse_loss(model2(batch(i)[0]).float(), batch(i)[1])
        guard2.backward(loss)
        guard2.step()
    assert guard2.scale == scaler.get_scale()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
