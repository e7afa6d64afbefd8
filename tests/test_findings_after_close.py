"""Guard.findings() after the ``with`` block or close() returns what the Guard wrote to
findings.json (the quickstart calls it exactly there), never an empty list."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from _models import batch, make_model

import ampguard as ag


def _overflowing_run(run_dir, close_with: str) -> ag.Guard:
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = ag.ScalerConfig(init_scale=2.0**16, growth_interval=1000)
    guard = ag.Guard(model, opt, precision="fp16", scaler=cfg, telemetry=run_dir)

    def steps() -> None:
        for i in range(12):
            x, y = batch(i)
            with guard.autocast():
                loss = F.mse_loss(model(x).float(), y)
            guard.backward(loss)
            model[2].weight.grad.view(-1)[0] = float("inf")  # every step overflows
            guard.step()

    if close_with == "with":
        with guard:
            steps()
    else:
        steps()
        guard.close()
    return guard


def _codes(found) -> list[str]:
    return sorted(f.code for f in found)


def test_findings_after_with_block_match_findings_json(tmp_path) -> None:
    guard = _overflowing_run(tmp_path / "run", "with")
    on_disk = json.loads((tmp_path / "run" / "findings.json").read_text())
    assert on_disk, "the run should have findings (every step overflowed)"
    after = guard.findings()
    assert _codes(after) == sorted(d["code"] for d in on_disk)
    assert after, "findings() after the with block must not be []"


def test_findings_after_close_are_stable_and_write_nothing(tmp_path) -> None:
    guard = _overflowing_run(tmp_path / "run", "close")
    path = tmp_path / "run" / "findings.json"
    before = path.read_bytes()
    first, second = guard.findings(), guard.findings()
    assert first and _codes(first) == _codes(second)
    assert path.read_bytes() == before  # a closed run folder is not written again
    assert isinstance(first[0], ag.Finding)


def test_telemetry_findings_after_close(tmp_path) -> None:
    guard = _overflowing_run(tmp_path / "run", "close")
    assert guard.telemetry is not None and guard.telemetry.closed
    assert guard.telemetry.findings(), "Telemetry.findings() after close returns its findings"
