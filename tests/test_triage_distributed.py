"""ag.triage under DDP (2 real gloo ranks): a fault planted on rank 1 only is named, with its
class, module and rank, by both ranks."""

import _distributed_scenarios as S
import _triage_scenarios as T
import pytest


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(150)
def test_faults_on_one_rank_are_named_by_every_rank(tmp_path):
    names = ["transient_on_rank1", "persistent_on_rank1"]
    results = S.run_ranks(T.rank_main, 2, names, 120, str(tmp_path), 30.0)
    want = {
        "transient_on_rank1": [[T.FAULT_STEP, "transient_fault", "4", None, 1]],
        "persistent_on_rank1": [[T.FAULT_STEP, "persistent_fault", "4", "aten.addmm", 1]],
    }
    for name in names:
        assert sorted(results[name]) == [0, 1], results[name]
        for rank in (0, 1):
            status, value = results[name][rank]
            assert status == "ok", value
            assert [list(e) for e in value["events"]] == want[name], (name, rank, value)


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(150)
def test_an_audit_mismatch_is_a_triage_event_by_itself(tmp_path):
    name = "audit_mismatch_on_rank1"
    results = S.run_ranks(T.rank_main, 2, [name], 120, str(tmp_path), 30.0)
    for rank in (0, 1):
        status, value = results[name][rank]
        assert status == "ok", value
        assert [m["step"] for m in value["mismatches"]] == [2], value
        assert [list(e) for e in value["events"]] == [[2, "transient_fault", "2", 1, "audit"]]
        assert value["codes"] == ["AG382"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(200)
def test_three_ranks_a_peer_replay_names_the_persistent_fault(tmp_path):
    """3 ranks: rank 0 replays rank 1's batch and does not reproduce its record, rank 1
    replays rank 2's and does not reproduce it, rank 2 reproduces rank 0's: the peers pin
    the persistent fault on rank 1 (evidence reference == "peer"), not a CPU reference."""
    names = ["persistent_on_rank1", "transient_on_rank1"]
    results = S.run_ranks(T.rank_main, 3, names, 170, str(tmp_path), 30.0)
    for rank in (0, 1, 2):
        status, value = results["persistent_on_rank1"][rank]
        assert status == "ok", value
        assert [list(e) for e in value["events"]] == [
            [T.FAULT_STEP, "persistent_fault", "4", "aten.addmm", 1]
        ]
        assert value["reference"] == ["peer"], value
        status, value = results["transient_on_rank1"][rank]
        assert status == "ok", value
        assert [list(e) for e in value["events"]] == [
            [T.FAULT_STEP, "transient_fault", "4", None, 1]
        ]
