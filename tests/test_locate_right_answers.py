"""ag.locate gives the right answer where a simpler reading of the replays gives a wrong one:
a benign scaler probe in the same batch as a real finding, at any scale."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from test_silent_locate import NormNet, batch

import ampguard as ag


def big_ce(model, b):
    x, y = b
    return F.cross_entropy(model(x).float(), y) * 200  # backward overflows fp16 above ~2**3


@pytest.mark.parametrize("scale", [32.0, 2.0**10, 2.0**16, 2.0**20])
def test_benign_probe_never_hides_an_absorbed_overflow(scale):
    diag = ag.locate(NormNet(gain=2000.0), big_ce, batch(), scale=scale)
    assert (diag.kind, diag.code, diag.module, diag.op) == (
        "fp16_overflow_absorbed",
        "AG360",
        "norm",
        "aten.pow",
    )
    assert not diag.benign and not diag.ok
    probe = diag.stats.get("scaler_probe")
    if probe is not None:  # the probe is said, next to the finding, never instead of it
        assert probe["scale"] == scale and probe["module"] == "head"
        assert "probing" in diag.explain()


def test_benign_probe_alone_stays_benign():
    diag = ag.locate(NormNet(gain=1.0), big_ce, batch())
    assert diag.benign and diag.code == "AG305"
