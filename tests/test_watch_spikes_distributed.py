"""Attach mode under DDP (2 real gloo ranks): a loss spike in one rank's batch makes every rank
skip the step (``on_spike="skip"``: the ranks OR their spike flags, one async all-reduce), so no
rank applies an update another rank skips; each rank dumps its flight recorder."""

import _attach_spike_scenarios as A
import _distributed_scenarios as S
import pytest
import torch


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(200)
def test_a_spike_on_one_rank_is_skipped_by_every_watched_rank(tmp_path):
    names = ["attach_scaler", "attach_no_scaler"]
    results = S.run_ranks(A.rank_main, 2, names, 180, str(tmp_path), 30.0)
    for name in names:
        assert sorted(results[name]) == [0, 1], (name, results[name])
        values = []
        for rank in (0, 1):
            status, value = results[name][rank]
            assert status == "ok", (name, value)
            values.append(value)
        for v in values:
            p = {k: torch.tensor(t) for k, t in v["params"].items()}
            assert torch.equal(p[A.SPIKE], p[A.SPIKE - 1]), name  # skipped on every rank
            assert not torch.equal(p[A.SPIKE + 1], p[A.SPIKE]), name
        assert values[0]["params"] == values[1]["params"], name  # the replicas agree
        assert values[1]["spikes"] == [A.SPIKE], name
    for rank in (0, 1):  # every rank dumps its own ring (the agreed flag is a spike on each)
        for kind in ("scaler", "plain"):
            assert (tmp_path / f"{kind}{rank}" / "flight_recorder" / f"rank{rank}.json").is_file()
