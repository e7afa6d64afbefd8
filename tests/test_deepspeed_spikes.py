"""Loss spikes under ``ampguard.integrations.deepspeed.watch``: a real bf16 DeepSpeed engine
(0.19.8, one process, gloo, CPU) with a planted spike (one batch with outlier samples).

DeepSpeed's ``engine.step()`` owns the update, so ``on_spike="skip"`` warns once at attach
(naming DeepSpeed and why) and the spike is detected (AG180), recorded, dumped and read by
``ampguard postmortem``, but applied; ``ag.triage`` says it is not available there. As in
``tests/test_deepspeed.py`` the engine runs in a child process (its process group would leak
into the other tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
STEPS, SPIKE = 64, 60


def _child(out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29741", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import importlib

    ds_comm = importlib.import_module("deepspeed.comm.torch")
    ds_comm.build_shm_op = lambda: None  # the CPU JIT op one process never uses
    import deepspeed

    import ampguard as ag
    import ampguard.integrations.deepspeed as agds
    from ampguard.cli._main import main

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    run = out.parent / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = agds.watch(engine, ag.Telemetry(run, flush_every=16), on_spike="skip")
    attach_warnings = [str(w.message) for w in caught if "on_spike" in str(w.message)]
    changed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with handle:
            for step in range(1, STEPS + 1):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(8, 16, generator=g)
                y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(dim=1)
                if step == SPIKE:
                    x[:3] *= 50.0
                    y[:3] = (y[:3] + 1) % 4
                before = engine.module[2].weight.detach().float().clone()
                loss = torch.nn.functional.cross_entropy(engine(x.bfloat16()).float(), y)
                engine.backward(loss)
                engine.step()
                changed[step] = not torch.equal(before, engine.module[2].weight.detach().float())
            spikes = [f.step for f in handle.findings() if f.code == "AG180"]
    try:
        ag.triage(handle)
        triage = "no error"
    except ValueError as err:
        triage = str(err)
    autopsy = [
        {"step": d.step, "verified": d.verified, "replay": d.evidence.get("replay")}
        for d in ag.autopsy(handle)
    ]
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["postmortem", str(run)])
    out.write_text(
        json.dumps(
            {
                "attach_warnings": attach_warnings,
                "spikes": spikes,
                "applied_at_spike": changed[SPIKE],
                "dump": (run / "flight_recorder" / "rank0.json").is_file(),
                "postmortem_code": code,
                "postmortem": text.getvalue(),
                "triage": triage,
                "autopsy": autopsy,
            }
        )
    )


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
    sys.exit(0)


deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (pip install 'ampguard[deepspeed]')"
)


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("deepspeed_spikes") / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(HERE), str(out)],
        capture_output=True,
        text=True,
        timeout=280,  # a hang fails with the child's output
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # a DeepSpeed engine in a child process
@pytest.mark.timeout(300)
def test_deepspeed_cannot_skip_so_it_says_why_and_warns(child) -> None:
    (message,) = child["attach_warnings"]
    assert "on_spike='skip' under deepspeed" in message and "engine.step()" in message
    assert child["spikes"] == [SPIKE]
    assert child["applied_at_spike"]  # the engine applied it: ampguard could not skip it


@pytest.mark.slow  # a DeepSpeed engine in a child process
@pytest.mark.timeout(300)
def test_deepspeed_spike_is_dumped_and_postmortem_reads_it(child) -> None:
    assert child["dump"] and child["postmortem_code"] == 0
    assert f"step {SPIKE}: loss spike" in child["postmortem"]


@pytest.mark.slow  # a DeepSpeed engine in a child process
@pytest.mark.timeout(300)
def test_deepspeed_autopsy_reads_the_signals_and_says_why_no_replay(child) -> None:
    (d,) = child["autopsy"]
    assert d["step"] == SPIKE and d["verified"] is False
    assert "no replay on an attached deepspeed run" in d["replay"]
    assert "owns the forward" in d["replay"]


@pytest.mark.slow  # a DeepSpeed engine in a child process
@pytest.mark.timeout(300)
def test_deepspeed_triage_is_not_available_and_says_why(child) -> None:
    assert "not available on an attached deepspeed run" in child["triage"]
    assert "owns the forward" in child["triage"]
