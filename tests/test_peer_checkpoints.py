"""Distributed checkpoints and the Guard's own group under failing peers.

Real gloo groups of 2 CPU ranks (tests/_peer_checkpoint_scenarios.py). Every wait is bounded by
``peer_timeout`` (1.5 s here) or, when it is not given, by the group's own timeout; a failure is
a ``CheckpointError`` naming the path with a ``PeerFailureError`` naming the rank as its cause.
"""

from __future__ import annotations

from datetime import timedelta

import _peer_checkpoint_scenarios as P
import pytest
import torch
import torch.distributed as dist

import ampguard as ag
from ampguard.distributed._peers import DEFAULT_PEER_TIMEOUT, resolve_peer_timeout


def _survivor(per_rank: dict) -> dict:
    status, v = per_rank[0]
    assert status == "ok", v
    return v


def _named_in_a_checkpoint_error(v: dict, bound: float) -> None:
    assert v["error"] == "CheckpointError", v
    assert v["message"].startswith(v["path"]), v["message"]
    assert v["cause"] == "PeerFailureError" and v["ranks"] == [1], v
    assert "rank(s) 1 did not answer" in v["message"]
    assert v["seconds"] < bound, v  # peer_timeout + roll call, not the group's 30 s


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(90)
def test_a_peer_that_dies_before_a_ddp_save_is_a_checkpoint_error_naming_it():
    v = _survivor(P.run_group(2, ["save_with_a_crashed_peer_ddp"])["save_with_a_crashed_peer_ddp"])
    _named_in_a_checkpoint_error(v, bound=P.PEER + 8)
    assert "saving the distributed checkpoint failed" in v["message"]
    assert not v["exists"]  # nothing written when the audit could not run


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(90)
def test_a_peer_that_hangs_in_an_fsdp2_save_is_bounded_by_peer_timeout():
    per_rank = P.run_group(2, ["save_with_a_hung_peer_fsdp2"])["save_with_a_hung_peer_fsdp2"]
    v = _survivor(per_rank)
    _named_in_a_checkpoint_error(v, bound=P.SLEEP)
    assert not v["exists"]
    status, late = per_rank[1]  # the late rank gets a bounded error too, never a hang
    assert status == "ok" and late["error"] == "CheckpointError", late
    assert late["cause"] == "PeerFailureError"


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_a_rank_that_never_calls_load_does_not_block_the_others_and_nothing_is_loaded(kind):
    name = f"load_with_an_absent_peer_{kind}"
    v = _survivor(P.run_group(2, [name])[name])
    _named_in_a_checkpoint_error(v, bound=P.SLEEP)
    assert "loading the distributed checkpoint failed" in v["message"]
    assert v["unchanged"]  # the first collective comes before any read: nothing was loaded


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(90)
def test_a_rank_whose_guard_raised_is_named_after_the_users_group_timeout():
    per_rank = P.run_group(2, ["guard_group_with_an_absent_peer"], pg_timeout=4.0)
    per_rank = per_rank["guard_group_with_an_absent_peer"]
    status, value = per_rank[1]
    assert status == "error" and "audit_every" in value
    v = _survivor(per_rank)
    assert v["peer_timeout"] == 4.0  # init_process_group(timeout=4 s), no peer_timeout given
    assert v["error"] == "PeerFailureError" and v["ranks"] == [1], v
    assert "building the Guard's process group" in v["message"]
    assert "rank(s) 1 never reached Guard(...)" in v["message"]
    assert 3.5 < v["seconds"] < 10, v  # the user's 4 s, not torch's 30 min


def test_peer_timeout_defaults_to_ten_minutes_without_a_group():
    assert resolve_peer_timeout(None) == DEFAULT_PEER_TIMEOUT == 600.0
    assert resolve_peer_timeout(2) == 2.0


@pytest.mark.parametrize(("seconds", "expected"), [(20, 20.0), (1800, DEFAULT_PEER_TIMEOUT)])
def test_peer_timeout_defaults_to_the_timeout_the_user_gave_the_group(tmp_path, seconds, expected):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=seconds),
    )
    try:
        model = torch.nn.Linear(4, 4)
        guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert guard.peer_timeout == expected  # 1800 s is torch's default: not "set"
        assert (
            ag.Guard(
                model, torch.optim.SGD(model.parameters(), lr=0.1), peer_timeout=7
            ).peer_timeout
            == 7.0
        )
    finally:
        dist.destroy_process_group()


def test_a_group_timeout_above_one_day_is_kept_at_the_cap_and_said_so(tmp_path):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(days=3),
    )
    try:
        with pytest.warns(RuntimeWarning, match="above peer_timeout's cap of 86400 s"):
            assert resolve_peer_timeout(None) == 86400.0  # not 10 minutes
        model = torch.nn.Linear(4, 4)
        with pytest.warns(RuntimeWarning, match="259200"):
            guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert guard.peer_timeout == 86400.0
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(90)
def test_ranks_that_load_different_checkpoints_are_refused_naming_the_paths():
    per_rank = P.run_group(2, ["load_different_paths_ddp"])["load_different_paths_ddp"]
    for rank in (0, 1):
        status, v = per_rank[rank]
        assert status == "ok" and v["error"] == "CheckpointError", v
        assert "the ranks load different checkpoints (rank 0: " in v["message"]
        assert "own-1.pt" in v["message"] and "nothing was loaded" in v["message"]
