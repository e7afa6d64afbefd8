"""Eight attacks on checkpoints, each asserting that a failure changes nothing.

Every load that raises must leave the model, the optimizer (state included), the scheduler, the
Guard and the torch RNG bitwise as they were; every save that raises must leave the previous file
and no temporary.
"""

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models import batch
from torch import nn

import ampguard as ag
from ampguard.checkpoint._files import stale_temporaries, temp_name

SRC = str(Path(ag.__file__).resolve().parents[1])


def make_model(seed: int = 0, hidden: int = 16, extra_layer: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4)]
    if extra_layer:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers)


def train(model, opt, guard, steps, start=0):
    for i in range(start, start + steps):
        with guard.autocast():
            loss = F.mse_loss(model(batch(i)[0]).float(), batch(i)[1][:, :4])
        guard.backward(loss)
        guard.step()


def run(seed=0, precision="fp16", steps=2, **model_kw):
    """A trained model, AdamW (with state), scheduler and Guard."""
    model = make_model(seed, **model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    guard = ag.Guard(model, opt, precision=precision, schedulers=[sched])
    train(model, opt, guard, steps, start=seed * 10)
    return model, opt, sched, guard


def snapshot(model, opt, sched, guard):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
        "param_groups": copy.deepcopy(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        ),
        "sched": copy.deepcopy(sched.state_dict()) if sched is not None else None,
        "guard": guard.state_dict() if guard is not None else None,
        "precision": guard.precision if guard is not None else None,
        "rng": torch.get_rng_state().clone(),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def assert_unchanged(before, model, opt, sched, guard):
    after = snapshot(model, opt, sched, guard)
    for key in before:
        assert same(before[key], after[key]), f"{key} changed by a failed load"


def saved(tmp_path, name="c.pt", **kw) -> Path:
    model, opt, sched, guard = run(**kw)
    path = tmp_path / name
    ag.save_checkpoint(
        path, model=model, optimizer=opt, guard=guard, scheduler=sched, extra={"epoch": 3}
    )
    return path


def refused(path, live, match):
    """Load ``path`` into ``live``: CheckpointError naming the path, and nothing changed."""
    model, opt, sched, guard = live
    before = snapshot(model, opt, sched, guard)
    with pytest.raises(ag.CheckpointError, match=match) as info:
        ag.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, guard=guard)
    assert str(path) in str(info.value)
    assert_unchanged(before, model, opt, sched, guard)
    return info.value


def craft(path: Path, change) -> Path:
    """Rewrite the checkpoint with ``change(data)`` applied (a valid zip, CRCs and all)."""
    data = torch.load(path, weights_only=True)
    change(data)
    out = path.with_name("crafted.pt")
    torch.save(data, out)
    return out


# ---------------------------------------------------------------------- 1. damaged files
def member_span(path: Path, suffix: str) -> tuple[str, int, int]:
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
        with zf.open(info) as f:  # the data's offset: after the local header
            start = f._fileobj.tell()  # type: ignore[attr-defined]
    return info.filename, start, info.file_size


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("member", ["data/0", "data/3", "data.pkl"])
def test_a_flipped_byte_in_a_member_is_refused_naming_the_member(tmp_path, member):
    path = saved(tmp_path)
    name, start, size = member_span(path, member)
    flip(path, start + size // 2)
    err = refused(path, run(seed=1), rf"member '{name}' fails its CRC-32")
    assert name in str(err)


@pytest.mark.slow  # every byte of a checkpoint, flipped and loaded
@pytest.mark.timeout(240)
def test_no_flipped_byte_anywhere_loads_different_content(tmp_path):
    """Every byte of a small checkpoint (sampled) flipped: refused, or loads identical content."""
    model = make_model()
    path = tmp_path / "c.pt"
    ag.save_checkpoint(path, model=model, extra={"epoch": 3}, rng=False)
    good = torch.load(path, weights_only=True)
    raw = path.read_bytes()
    positions = sorted(random.Random(0).sample(range(len(raw)), min(len(raw), 400)))
    silent = []
    for pos in positions:
        data = bytearray(raw)
        data[pos] ^= 0x04
        path.write_bytes(bytes(data))
        live = make_model(seed=5)
        try:
            extra = ag.load_checkpoint(path, model=live, rng=False)
        except ag.CheckpointError:
            continue
        if extra != {"epoch": 3} or not same(live.state_dict(), good["model"]):
            silent.append(pos)
    assert silent == [], f"a flip at offsets {silent[:10]} loaded changed content silently"


def test_a_checkpoint_from_plain_torch_save_still_loads_verified(tmp_path):
    # ampguard 0.1 wrote exactly this: torch.save of the payload dict, no digest of its own
    model, opt, sched, guard = run()
    payload = {
        "format": "ampguard.checkpoint",
        "version": 1,
        "torch_version": "2.5.0",
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "guard": guard.state_dict(),
        "scheduler": sched.state_dict(),
        "extra": {"epoch": 1},
        "rng": {"cpu": torch.get_rng_state()},
    }
    torch.save(payload, tmp_path / "v01.pt")
    live = run(seed=1)
    assert ag.load_checkpoint(
        tmp_path / "v01.pt", model=live[0], optimizer=live[1], scheduler=live[2], guard=live[3]
    ) == {"epoch": 1}
    assert same(live[0].state_dict(), model.state_dict())
    name, start, size = member_span(tmp_path / "v01.pt", "data/1")
    flip(tmp_path / "v01.pt", start + 1)
    refused(tmp_path / "v01.pt", run(seed=2), "fails its CRC-32")


def test_a_file_written_without_crcs_loads_with_a_warning(tmp_path):
    from torch.serialization import set_crc32_options

    model = make_model()
    set_crc32_options(False)
    try:
        torch.save({"model": model.state_dict()}, tmp_path / "nocrc.pt")
    finally:
        set_crc32_options(True)
    live = make_model(seed=3)
    with pytest.warns(RuntimeWarning, match="carry no CRC-32"):
        ag.load_checkpoint(tmp_path / "nocrc.pt", model=live, rng=False)
    assert same(live.state_dict(), model.state_dict())


def test_save_writes_crcs_even_when_torch_is_told_not_to(tmp_path):
    from torch.serialization import get_crc32_options, set_crc32_options

    set_crc32_options(False)
    try:
        ag.save_checkpoint(tmp_path / "c.pt", model=make_model())
        assert get_crc32_options() is False  # the user's setting is put back
    finally:
        set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "c.pt") as zf:
        assert all(i.CRC != 0 for i in zf.infolist() if i.file_size)


# ---------------------------------------------------------------------- 2-3. models that do not fit
@pytest.mark.parametrize(
    ("live_kw", "match"),
    [
        (
            {"hidden": 32},
            r"'0.weight' has shape \(16, 8\) in the checkpoint, \(32, 8\) in the model",
        ),
        ({"extra_layer": True}, r"missing from the checkpoint: '3.bias', '3.weight'"),
    ],
)
def test_a_model_that_does_not_fit_is_refused_and_nothing_is_loaded(tmp_path, live_kw, match):
    refused(saved(tmp_path), run(seed=1, **live_kw), match)


def test_a_checkpoint_with_an_extra_layer_is_refused_and_nothing_is_loaded(tmp_path):
    path = saved(tmp_path, extra_layer=True)
    refused(path, run(seed=1), r"in the checkpoint but not in Sequential: '3.bias', '3.weight'")


def test_a_tensor_of_another_dtype_is_refused(tmp_path):
    path = craft(saved(tmp_path), lambda d: d["model"].update({"2.bias": torch.zeros(4).double()}))
    refused(path, run(seed=1), r"'2.bias' is torch.float64 in the checkpoint, torch.float32")


# ---------------------------------------------------------------------- 4. optimizers
def test_a_mismatched_optimizer_leaves_the_model_unloaded(tmp_path):
    path = saved(tmp_path)
    model, _, _, guard = run(seed=1)
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    refused(path, (model, opt, sched, guard), r"1 parameter group\(s\) in the checkpoint, 2 in")


def test_optimizer_state_that_does_not_fit_the_parameters_is_refused(tmp_path):
    def swap(d):  # exp_avg of the first weight replaced by one of another shape
        d["optimizer"]["state"][0]["exp_avg"] = torch.zeros(4, 16)

    refused(
        craft(saved(tmp_path), swap),
        run(seed=1),
        r"'exp_avg' has shape \(4, 16\) in the checkpoint, the parameter needs \(16, 8\)",
    )


def test_an_optimizer_count_mismatch_leaves_everything(tmp_path):
    path = saved(tmp_path)
    model, opt, sched, guard = run(seed=1)
    before = snapshot(model, opt, sched, guard)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ag.CheckpointError, match=r"holds 1 optimizer state\(s\), 2 optimizer"):
        ag.load_checkpoint(path, model=model, optimizer=[opt, other], guard=guard)
    assert_unchanged(before, model, opt, sched, guard)


# ---------------------------------------------------------------------- 5. crafted fields
CRAFTED = {
    "rng is a string": (lambda d: d.update(rng="abc"), r"'rng' field is a str"),
    "rng cpu is short": (
        lambda d: d["rng"].update(cpu=torch.zeros(3, dtype=torch.uint8)),
        r"rng\['cpu'\] is a torch.uint8 tensor of shape \(3,\)",
    ),
    "rng cpu is float": (lambda d: d["rng"].update(cpu=torch.zeros(5056)), r"rng\['cpu'\]"),
    "rng cuda not a list": (lambda d: d["rng"].update(cuda=7), r"rng\['cuda'\] must be a list"),
    "optimizer is an int": (lambda d: d.update(optimizer=5), "not an optimizer state dict"),
    "optimizer state is an int": (
        lambda d: d["optimizer"].update(state=3),
        "not an optimizer state dict",
    ),
    "optimizer lr is a string": (
        lambda d: d["optimizer"]["param_groups"][0].update(lr="fast"),
        r"'lr' is 'fast' in the checkpoint",
    ),
    "optimizer params not ints": (
        lambda d: d["optimizer"]["param_groups"][0].update(params=["a"] * 4),
        "not a parameter group",
    ),
    "optimizer state for no parameter": (
        lambda d: d["optimizer"]["state"].update({99: {}}),
        "parameter id 99, which no group holds",
    ),
    "guard is an int": (lambda d: d.update(guard=5), "not an ampguard Guard state"),
    "guard has no fields": (lambda d: d.update(guard={"version": 1}), "missing field"),
    "guard steps is a string": (lambda d: d["guard"].update(steps="7"), r"'steps' must be an int"),
    "guard scale is negative": (
        lambda d: d["guard"]["scaler"].update(scale=-1.0),
        r"'scaler.scale' must be a finite number > 0",
    ),
    "guard precision unknown": (lambda d: d["guard"].update(precision="fp4"), r"'precision'"),
    "guard counters bad": (lambda d: d["guard"]["counters"].update(applied="x"), "'applied'"),
    "guard history short": (
        lambda d: d["guard"]["scale_history"].update(values=[1.0]),
        "scale_history.values",
    ),
    "scheduler injects an attribute": (
        lambda d: d["scheduler"].update(optimizer={}),
        r"unexpected field\(s\) 'optimizer'",
    ),
    "scheduler last_epoch is a string": (
        lambda d: d["scheduler"].update(last_epoch="x"),
        "'last_epoch'",
    ),
    "model is a list": (lambda d: d.update(model=[1]), "'model' field is a list"),
    "model value is a string": (
        lambda d: d["model"].update({"0.bias": "x"}),
        "'0.bias' is a str in the checkpoint",
    ),
    "extra is an int": (lambda d: d.update(extra=5), "'extra' field is a int"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_field_is_a_checkpoint_error_and_changes_nothing(tmp_path, case):
    change, match = CRAFTED[case]
    err = refused(craft(saved(tmp_path), change), run(seed=1), match)
    assert "does not fit" in str(err)


def test_a_plain_loop_checkpoint_with_its_own_rng_format_loads_without_touching_the_rng(tmp_path):
    model = make_model()
    torch.save({"model": model.state_dict(), "rng": torch.get_rng_state()}, tmp_path / "p.pt")
    live = make_model(seed=4)
    rng = torch.get_rng_state()
    with pytest.warns(RuntimeWarning, match="not in ampguard's format"):
        ag.load_checkpoint(tmp_path / "p.pt", model=live)
    assert torch.equal(torch.get_rng_state(), rng)
    assert same(live.state_dict(), model.state_dict())


def test_a_plain_loop_scaler_with_a_bad_scale_is_refused(tmp_path):
    model, opt, sched, _ = run()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": {"scale": float("nan"), "_growth_tracker": 0},
        },
        tmp_path / "p.pt",
    )
    live = run(seed=1)
    refused(
        tmp_path / "p.pt",
        (live[0], live[1], None, live[3]),
        r"scaler\['scale'\] must be a finite number > 0",
    )


# ---------------------------------------------------------------------- 6. precision on resume
@pytest.mark.parametrize(
    ("saved_in", "live_in", "match"),
    [
        (
            "bf16",
            "fp16",
            r"saved in bf16, this Guard was given precision='fp16' \(fp16\); training "
            r"continues in fp16 .* loss scale starts at init_scale=65536.*AG107",
        ),
        ("fp32", "fp16", r"saved in fp32, .*continues in fp16 .*init_scale=65536.*AG107"),
        (
            "fp16",
            "bf16",
            r"saved in fp16, .*continues in bf16 .*saved fp16 loss scale \(\d+\) is "
            r"dropped",
        ),
        (
            "bf16",
            "fp32",
            r"saved in bf16, .*continues in fp32 .*neither precision uses a loss scale",
        ),
    ],
)
def test_the_constructors_precision_wins_with_a_warning(tmp_path, saved_in, live_in, match):
    path = saved(tmp_path, precision=saved_in)
    model, opt, sched, guard = run(seed=1, precision=live_in, steps=3)
    with pytest.warns(RuntimeWarning, match=match):
        ag.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, guard=guard)
    assert guard.precision == live_in
    assert guard.uses_scaler == (live_in == "fp16")
    if live_in == "fp16":
        assert guard.scale == 65536.0 and guard.resume["scale_reset"] is True
    assert guard.steps == 2
    train(model, opt, guard, 2)  # and it trains on
    assert guard.steps == 4


COLLAPSING = ag.ScalerConfig(init_scale=2.0, min_scale=1.0, on_collapse="fallback")


def collapsed_run(tmp_path) -> Path:
    """An fp16 run whose loss scale collapsed and fell back to bf16, saved."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp16", scaler=COLLAPSING)
    with pytest.warns(RuntimeWarning, match="switched precision fp16 -> bf16"):
        for i in range(4):
            with guard.autocast():
                loss = model(batch(i)[0]).float().sum() * float("inf")
            guard.backward(loss)
            guard.step()
    assert guard.fallback is not None
    ag.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, guard=guard)
    return tmp_path / "c.pt"


def test_a_recorded_fallback_from_the_same_precision_is_resumed_with_a_warning(tmp_path):
    path = collapsed_run(tmp_path)
    model = make_model(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp16", scaler=COLLAPSING)
    with pytest.warns(
        RuntimeWarning,
        match=r"automatic fallback fp16 -> bf16 at step \d+ .*"
        r"precision='fp16'.*resumes in bf16",
    ):
        ag.load_checkpoint(path, model=model, optimizer=opt, guard=guard)
    assert guard.precision == "bf16" and not guard.uses_scaler
    assert guard.fallback is not None and guard.fallback["from"] == "fp16"


def test_a_recorded_fallback_from_another_precision_is_not_resumed(tmp_path):
    path = collapsed_run(tmp_path)
    model = make_model(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp32", scaler=COLLAPSING)
    with pytest.warns(
        RuntimeWarning,
        match=r"saved in bf16, .*precision='fp32'.*continues in "
        "fp32",
    ):
        ag.load_checkpoint(path, model=model, optimizer=opt, guard=guard)
    assert guard.precision == "fp32" and guard.fallback is None


# ---------------------------------------------------------------------- 7. Guard.load_state_dict
BAD_GUARD_STATES = {
    "forensics names a module the model lacks": lambda s: s.update(
        forensics={"keep_fp32": ["nope"], "changes": []}
    ),
    "scaler missing in fp16": lambda s: s.update(scaler=None),
    "history too short": lambda s: s["scale_history"].update(values=[2.0] * 3),
    "resume ramp not an int": lambda s: s.update(resume={"ramp_start": "x"}),
    "fallback names an unknown precision": lambda s: s.update(
        fallback={"step": 1, "from": "fp16", "to": "fp4"}
    ),
    "counters not a dict": lambda s: s.update(counters=[1]),
    "steps negative": lambda s: s.update(steps=-1),
}


@pytest.mark.parametrize("case", list(BAD_GUARD_STATES))
def test_a_guard_state_that_raises_leaves_the_guard_unchanged(case):
    model, opt, sched, guard = run(steps=3)
    model2 = make_model(seed=1)
    guard2 = ag.Guard(
        model2, torch.optim.SGD(model2.parameters(), lr=0.1), precision="fp16", keep_fp32=["0"]
    )
    train(model2, guard2.optimizers[0], guard2, 2)
    state = guard.state_dict()
    BAD_GUARD_STATES[case](state)
    before = guard2.state_dict()
    with pytest.raises(ValueError, match="Guard state"):
        guard2.load_state_dict(state)
    assert guard2.state_dict() == before and guard2.steps == 2


# ---------------------------------------------------------------------- 8. OS errors
def test_saving_under_a_file_is_a_checkpoint_error_with_the_os_error_as_cause(tmp_path):
    (tmp_path / "run").write_text("a file, not a folder")
    target = tmp_path / "run" / "sub" / "c.pt"
    with pytest.raises(ag.CheckpointError, match="exists and is not a folder") as info:
        ag.save_checkpoint(target, model=make_model())
    assert str(target) in str(info.value) and isinstance(info.value.__cause__, OSError)
    target = tmp_path / "run" / "c.pt"  # the parent itself is the file
    with pytest.raises(ag.CheckpointError, match=str(target)) as info:
        ag.save_checkpoint(target, model=make_model())
    assert isinstance(info.value.__cause__, OSError)


def test_saving_onto_a_folder_is_a_checkpoint_error(tmp_path):
    (tmp_path / "c.pt").mkdir()
    with pytest.raises(ag.CheckpointError, match="it is a folder"):
        ag.save_checkpoint(tmp_path / "c.pt", model=make_model())


SAVER = textwrap.dedent("""
    import os, resource, signal, sys
    import torch, ampguard as ag
    import ampguard.checkpoint  # import everything before dropping privileges
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "unprivileged" and os.geteuid() == 0:
        os.setgid(65534); os.setuid(65534)  # root writes anywhere: drop to nobody
    if mode == "file size limit":  # the disk is full as far as this process can tell
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        ag.save_checkpoint(path, model=torch.nn.Linear(64, 64), extra={"i": 2})
    except ag.CheckpointError as exc:
        cause = exc.__cause__
        print("CheckpointError|" + type(cause).__name__ + "|" + str(exc))
    else:
        print("saved")
""")


def save_in_subprocess(tmp_path, mode, target) -> str:
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    os.chmod(script, 0o644)
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(150)
@pytest.mark.slow  # saves in a subprocess
def test_an_unwritable_folder_is_a_checkpoint_error_with_permission_error_as_cause(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    target = folder / "c.pt"
    ag.save_checkpoint(target, model=nn.Linear(64, 64), extra={"i": 1})
    os.chmod(tmp_path, 0o755)
    os.chmod(folder, 0o555)
    try:
        out = save_in_subprocess(tmp_path, "unprivileged", target)
    finally:
        os.chmod(folder, 0o755)
    kind, cause, message = out.split("|", 2)
    assert (kind, cause) == ("CheckpointError", "PermissionError")
    assert str(target) in message and "Permission denied" in message
    assert ag.load_checkpoint(target, model=nn.Linear(64, 64)) == {"i": 1}
    assert list(folder.iterdir()) == [target]


@pytest.mark.timeout(150)
@pytest.mark.slow  # saves in a subprocess
def test_a_full_disk_is_a_checkpoint_error_and_leaves_the_previous_file(tmp_path):
    target = tmp_path / "c.pt"
    ag.save_checkpoint(target, model=nn.Linear(64, 64), extra={"i": 1})
    kind, cause, message = save_in_subprocess(tmp_path, "file size limit", target).split("|", 2)
    assert (kind, cause) == ("CheckpointError", "OSError")
    assert str(target) in message and "File too large" in message
    assert ag.load_checkpoint(target, model=nn.Linear(64, 64)) == {"i": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "saver.py"]


def test_a_read_error_is_a_checkpoint_error_with_the_os_error_as_cause():
    path = Path("/proc/self/mem")  # a file whose first page reads as EIO: a failing disk
    if not path.is_file():
        pytest.skip("needs Linux /proc")
    live = run(seed=1)
    before = snapshot(*live)
    with pytest.raises(ag.CheckpointError, match="could not be read") as info:
        ag.load_checkpoint(path, model=live[0], optimizer=live[1], guard=live[3])
    assert isinstance(info.value.__cause__, OSError) and str(path) in str(info.value)
    assert_unchanged(before, *live)


@pytest.mark.timeout(30)
def test_a_pipe_is_neither_read_nor_replaced(tmp_path):
    pipe = tmp_path / "c.pt"
    os.mkfifo(pipe)  # opening it to read would block forever
    with pytest.raises(ag.CheckpointError, match="not a regular file"):
        ag.load_checkpoint(pipe, model=make_model())
    with pytest.raises(ag.CheckpointError, match="not a regular file"):
        ag.save_checkpoint(pipe, model=make_model())  # a rename would replace it
    assert pipe.is_fifo() and list(tmp_path.iterdir()) == [pipe]


def test_loading_a_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(ag.CheckpointError, match="is a folder, not a checkpoint file"):
        ag.load_checkpoint(tmp_path, model=make_model())


# ---------------------------------------------------------------------- 9. killed saves
WRITER = textwrap.dedent("""
    import sys, torch, ampguard as ag
    torch.set_num_threads(1)
    model = torch.nn.Linear(1024, 2048)  # ~8 MB: a save is long enough to be caught mid-way
    while True:
        ag.save_checkpoint(sys.argv[1], model=model, rng=False)
""")


@pytest.mark.slow  # SIGKILL of a writer process
@pytest.mark.timeout(120)
def test_a_save_removes_what_killed_saves_left_and_nothing_else(tmp_path):
    target = tmp_path / "ckpt.pt"
    (tmp_path / "writer.py").write_text(WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "writer.py"), str(target)],
        env=dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 90
        while not any(
            p.stat().st_size > 2**20 for p in tmp_path.glob(".ckpt.pt.*.tmp") if p.exists()
        ):
            assert time.monotonic() < deadline and proc.poll() is None, "no temp file seen"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    orphans = list(tmp_path.glob(".ckpt.pt.*.tmp"))
    assert orphans, "the kill did not land mid-save"
    # files that are not this save's own stale temporaries
    keep = [
        tmp_path / n
        for n in (
            ".ckpt.pt.notes.tmp",
            ".other.pt.abcd1234.tmp",
            "ckpt.pt.tmp",
            ".ckpt.pt.abcd1234.tmp.bak",
            "ckpt.pt.old",
        )
    ]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = (
            tmp_path / f".ckpt.pt.{temp_name(target).split('.')[3].rsplit('-', 2)[0]}-"
            f"{live.pid}-0123abcd.tmp"
        )
        keep.append(alive)  # a writer that is still running
        for p in keep:
            p.write_text("keep me")
        (tmp_path / ".ckpt.pt.zz99yy88.tmp").mkdir()  # a folder, whatever its name
        v01 = tmp_path / ".ckpt.pt.k3_9x0qa.tmp"  # what a killed ampguard 0.1 save left
        v01.write_text("stale")
        assert sorted(stale_temporaries(target)) == sorted([*orphans, v01])
        ag.save_checkpoint(target, model=make_model())
        assert all(p.exists() for p in keep) and not v01.exists()
        assert not any(p.exists() for p in orphans)
        assert (tmp_path / ".ckpt.pt.zz99yy88.tmp").is_dir()
    finally:
        live.kill()
        live.wait(timeout=10)
    ag.load_checkpoint(target, model=make_model(seed=3))


# ---------------------------------------------------------------------- 10. file mode
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_file_mode_follows_the_umask_like_torch_save(tmp_path, umask):
    old = os.umask(umask)
    try:
        ag.save_checkpoint(tmp_path / "ag.pt", model=make_model())
        torch.save(make_model().state_dict(), tmp_path / "torch.pt")
    finally:
        os.umask(old)
    mode = (tmp_path / "ag.pt").stat().st_mode & 0o777
    assert mode == (tmp_path / "torch.pt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_overwriting_keeps_the_files_mode_like_torch_save(tmp_path):
    ag.save_checkpoint(tmp_path / "c.pt", model=make_model())
    os.chmod(tmp_path / "c.pt", 0o600)
    ag.save_checkpoint(tmp_path / "c.pt", model=make_model())
    assert (tmp_path / "c.pt").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------- a valid load still works
def test_a_valid_checkpoint_round_trips_bitwise_after_all_the_checks(tmp_path):
    path = saved(tmp_path)
    original = torch.load(path, weights_only=True)
    model, opt, sched, guard = run(seed=1)
    assert ag.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, guard=guard) == {
        "epoch": 3
    }
    assert same(model.state_dict(), original["model"])
    assert same(opt.state_dict(), original["optimizer"])
    assert sched.state_dict() == original["scheduler"] and guard.state_dict() == original["guard"]
    assert torch.equal(torch.get_rng_state(), original["rng"]["cpu"])
