"""The absorbed-overflow scans run early: windows 1, 2, 4, ... then every ``range_every``
(telemetry's AG170 counter and the Guard's auto_fallback scan), so a silent failure present
from step 0 is found in a short run, not after 100 steps."""

from __future__ import annotations

import torch
from test_silent_locate import NormNet, batch, ce

import ampguard as ag
from ampguard import runlog
from ampguard._util.cadence import early_or_every


def _run(run_dir, steps: int, **kwargs):
    model = NormNet(gain=2000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    with ag.Guard(model, opt, precision="fp16", telemetry=run_dir, **kwargs) as guard:
        for _ in range(steps):
            with guard.autocast():
                loss = ce(model, (x, y))
            guard.backward(loss)
            guard.step()
        state = guard.state_dict()
    return guard.findings(), state


def test_cadence_is_geometric_then_periodic():
    due = [s for s in range(1, 401) if early_or_every(s, 100)]
    assert due == [1, 2, 4, 8, 16, 32, 64, 100, 200, 300, 400]
    assert [s for s in range(1, 9) if early_or_every(s, 4)] == [1, 2, 4, 8]
    assert not any(early_or_every(s, 0) for s in range(1, 10))  # 0: never


def test_a_short_run_reports_the_absorbed_overflow(tmp_path):
    found, _ = _run(tmp_path / "run", steps=6)  # default range_every=100
    events = runlog.load_run(tmp_path / "run").events
    steps = [e["step"] for e in events if e.get("kind") == "absorbed"]
    assert steps[:3] == [1, 2, 4]
    ag170 = [f for f in found if f.code == "AG170"]
    assert ag170 and ag170[0].evidence["module"] == "norm"


def test_auto_fallback_scans_the_first_window(tmp_path):
    found, state = _run(tmp_path / "run", steps=3, auto_fallback=True)
    assert state["forensics"]["keep_fp32"] == ["norm"]
    assert state["forensics"]["changes"][0]["step"] <= 2
    assert {"AG360", "AG306"} <= {f.code for f in found}
