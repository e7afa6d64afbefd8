"""Loss spikes under DDP (2 real gloo ranks): a spike in one rank's batch makes every rank skip
the window (the ranks agree on the flag), and every rank dumps its flight recorder into the run
folder, which ``ampguard postmortem`` merges into one timeline naming the first rank."""

import _distributed_scenarios as S
import _spike_scenarios as P
import pytest

from ampguard.cli._main import main
from ampguard.reporting.postmortem import load


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(150)
def test_a_spike_on_one_rank_is_skipped_by_every_rank_and_dumped_by_each(tmp_path, capsys):
    results = S.run_ranks(P.rank_main, 2, ["spike_on_one_rank"], 120, str(tmp_path), 30.0)[
        "spike_on_one_rank"
    ]
    assert sorted(results) == [0, 1], results
    values = []
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        values.append(value)
    for v in values:  # the queue turns int keys into ints still (pickled dicts)
        assert v["causes"][P.SPIKE] == "loss_spike"
        assert v["causes"][P.SPIKE - 1] is None and v["causes"][P.SPIKE + 1] is None
    assert values[0]["params"] == values[1]["params"]  # no rank applied what the other skipped
    run = tmp_path / "run"
    assert {p.name for p in (run / "flight_recorder").iterdir()} == {"rank0.json", "rank1.json"}
    pm = load(run)
    assert pm.first_step == P.SPIKE and pm.first_rank == 1 and pm.what == "loss spike"
    assert main(["postmortem", str(run), "--autopsy"]) == 0
    out = capsys.readouterr().out
    assert f"first: rank 1, step {P.SPIKE}: loss spike" in out
    assert "autopsy (rank 1" in out
