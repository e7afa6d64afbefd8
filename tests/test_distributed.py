"""ampguard under torch.distributed, for real: gloo process groups of 2 and 4 CPU ranks, DDP and
FSDP2 (``fully_shard``), fp16 autocast. Each group is spawned once per module and runs several
scenarios (tests/_distributed_scenarios.py); each test checks one behaviour of one scenario.

Tolerances: DDP vs one process on the same global batch differ only by fp16/fp32 rounding order
(about 5e-6 here), so parameters must agree to 1e-4 while training moves them by > 1e-2.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import _distributed_scenarios as S
import pytest
import torch

import ampguard as ag
from ampguard.checkpoint import CheckpointError
from ampguard.distributed import param_checksum
from ampguard.precisions import traced
from ampguard.testing import SyncCounter

TWO = [
    "inf_on_one_rank",
    "inf_after_reduce",
    "fault_after_reduce_plain_ddp",
    "ddp_accumulation",
    "ddp_containment",
    "fsdp2_vs_ddp",
    "desync_raises",
    "desync_repairs",
    "desync_warns",
    "ddp_resume",
    "fsdp2_resume",
    "hook_drops_nan_rank",
    "demo_fsdp2",
]
FOUR = ["inf_on_one_rank", "desync_raises", "rank_raises"]
GROUP_TIMEOUT = 150
# a rank that pauses in ampguard's own collectives; the default group keeps its 30 s timeout
HANGS = [
    "sleep_in_audit_ddp",
    "sleep_in_audit_fsdp2",
    "sleep_in_audit_plain",
    "sleep_before_step_fsdp2",
    "sleep_before_step_plain",
]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return S.run_group(2, TWO, timeout=120, tmp=str(tmp_path_factory.mktemp("two")))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return S.run_group(4, FOUR, timeout=120, tmp=str(tmp_path_factory.mktemp("four")))


def ok(results: dict, name: str) -> dict[int, dict]:
    """The scenario's value per rank; fails with the rank's error if any rank did not finish."""
    per_rank = results[name]
    for rank, (status, value) in sorted(per_rank.items()):
        if status != "ok":
            pytest.fail(f"{name} failed on rank {rank}: {value}")
    return {rank: value for rank, (_, value) in per_rank.items()}


def group(request: pytest.FixtureRequest, world: int) -> tuple[dict, int]:
    return request.getfixturevalue("two" if world == 2 else "four"), world


def all_ranks(values: dict[int, dict], world: int) -> list[dict]:
    assert sorted(values) == list(range(world)), f"ranks that reported: {sorted(values)}"
    return [values[r] for r in range(world)]


# ---------------------------------------------------------------------- found_inf consensus
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_inf_on_one_rank_makes_every_rank_skip_that_step(request, world):
    results, world = group(request, world)
    for v in all_ranks(ok(results, "inf_on_one_rank"), world):
        assert v["applied"] == [True, False, True, True]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_inf_on_one_rank_backs_the_scale_off_identically(request, world):
    results, world = group(request, world)
    for v in all_ranks(ok(results, "inf_on_one_rank"), world):
        assert v["scales"] == [1024.0, 512.0, 512.0, 512.0]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_inf_on_one_rank_leaves_parameters_identical_across_ranks(request, world):
    results, world = group(request, world)
    values = all_ranks(ok(results, "inf_on_one_rank"), world)
    for v in values[1:]:
        assert v["params"] == values[0]["params"]  # bitwise


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_plain_ddp_runs_no_consensus_collective(request, world):
    results, world = group(request, world)
    for v in all_ranks(ok(results, "inf_on_one_rank"), world):
        assert v["needed"] is False
        assert v["consensus_calls"] == 0


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_overflow_origin_names_the_rank_whose_gradients_overflowed(request, world):
    results, world = group(request, world)
    expected = {r: int(r == world - 1) for r in range(world)}
    first = {r: (2 if r == world - 1 else None) for r in range(world)}  # injected at window 2
    for v in all_ranks(ok(results, "inf_on_one_rank"), world):
        assert v["summary"]["rank_overflows"] == expected
        assert v["summary"]["rank_first_overflow_step"] == first
        assert v["summary"]["origin"] == "each rank's own loss, gathered at the audit of step 4"


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("kind", ["ddp_hook", "ddp_safe_hook", "plain"])
def test_paths_that_keep_the_consensus_skip_a_fault_after_the_reduction_on_every_rank(two, kind):
    values = [v[kind] for v in all_ranks(ok(two, "inf_after_reduce"), 2)]
    for v in values:
        assert v["applied"] == [True, False, True]
        assert v["consensus_calls"] == 3  # one per window
        assert v["rank_overflows"] == {0: 0, 1: 1}
    if kind != "plain":  # a plain model is not averaged: its ranks train apart by design
        assert values[0]["params"] == values[1]["params"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_plain_ddp_fault_after_the_all_reduce_is_named_by_the_next_audit(two):
    # the trade of dropping the consensus: a rank-local change after DDP's all-reduce is not
    # agreed on per step; the audit (every 3 windows here) catches the divergence
    for v in all_ranks(ok(two, "fault_after_reduce_plain_ddp"), 2):
        assert v["step"] == 3 and v["ranks"] == [1]
        assert {"param_checksum", "scale", "skipped_steps"} <= set(v["fields"])


# ---------------------------------------------------------------------- accumulation
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_ddp_accumulation_matches_one_process_on_the_global_batch(two):
    values = all_ranks(ok(two, "ddp_accumulation"), 2)
    reference = S.single_process(2)
    start = S.flat(S.make_model())
    assert (reference - start).abs().max() > 1e-2  # training really moved the weights
    for v in values:
        assert torch.allclose(torch.tensor(v["params"]), reference, rtol=0, atol=1e-4)


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_ddp_accumulation_all_reduces_once_per_window(two):
    for v in all_ranks(ok(two, "ddp_accumulation"), 2):
        assert v["allreduce_calls"] == 3  # 3 windows x 2 micro-batches, one bucket


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_ddp_containment_drops_the_same_microbatch_on_every_rank(two):
    values = all_ranks(ok(two, "ddp_containment"), 2)
    for v in values:
        assert [tuple(r) for r in v["results"]] == [(True, 0), (True, 1), (True, 0)]
        assert v["rank_dropped"] == {0: 1, 1: 1}
    assert values[0]["params"] == values[1]["params"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_ddp_containment_matches_one_process_on_the_global_batch(two):
    reference = S.single_containment(2)
    for v in all_ranks(ok(two, "ddp_containment"), 2):
        assert torch.allclose(torch.tensor(v["params"]), reference, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------- FSDP2
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_fsdp2_with_fp16_autocast_trains_and_matches_ddp(two):
    for v in all_ranks(ok(two, "fsdp2_vs_ddp"), 2):
        assert v["kind"] == "fsdp2"
        assert v["moved"] > 1e-2
        assert v["max_diff"] <= 1e-5


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_fsdp2_overflow_in_one_ranks_shard_skips_on_every_rank(two):
    for v in all_ranks(ok(two, "fsdp2_vs_ddp"), 2):
        assert v["skipped"] == 1
        assert v["scale"] == v["ddp_scale"] == 512.0
        assert v["rank_overflows"] == {0: 0, 1: 1}


# ---------------------------------------------------------------------- audit
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("world", [2, 4])
def test_scale_desync_on_one_rank_raises_desync_error_naming_it(request, world):
    results, world = group(request, world)
    victim = world - 1
    for v in all_ranks(ok(results, "desync_raises"), world):
        assert v["step"] == 3  # injected after window 2, audit every 3 windows
        assert v["ranks"] == [victim]
        assert v["differences"]["scale"][victim] == 64.0
        assert v["differences"]["scale"][0] == 1024.0
        assert f"rank {victim} = 64" in v["message"]
        assert v["code"] == "AG130"


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_desync_repair_copies_rank0_scaler_state_and_parameters(two):
    values = all_ranks(ok(two, "desync_repairs"), 2)
    assert [v["scale"] for v in values] == [1024.0, 1024.0]
    assert values[0]["params"] == values[1]["params"]
    for v in values:
        assert len(v["warnings"]) == 1 and "Repaired" in v["warnings"][0]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_desync_warn_only_warns_and_changes_nothing(two):
    values = all_ranks(ok(two, "desync_warns"), 2)
    assert [v["scale"] for v in values] == [1024.0, 64.0]
    for v in values:
        assert len(v["warnings"]) == 1 and "rank(s) 1 differ" in v["warnings"][0]
        assert "Repaired" not in v["warnings"][0]


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_resume", "fsdp2_resume"])
def test_checkpoint_resume_equals_the_uninterrupted_run(two, name):
    for v in all_ranks(ok(two, name), 2):
        assert v["equal"], "resumed parameters differ from the uninterrupted run"
        assert v["extra"] == {"step": 3}
        assert v["loaded_scale"] == 512.0 and v["skipped"] == 1


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("name", ["ddp_resume", "fsdp2_resume"])
def test_checkpoint_resume_restores_each_ranks_own_rng(two, name):
    values = all_ranks(ok(two, name), 2)
    assert all(v["rng_restored"] for v in values)
    assert values[0]["rng"] != values[1]["rng"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_sharded_checkpoint_leaves_no_temporary_folder(two):
    for v in all_ranks(ok(two, "fsdp2_resume"), 2):
        assert not [f for f in v["files"] if f.endswith((".tmp", ".old"))]


# ---------------------------------------------------------------------- comm hook
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_nonfinite_safe_hook_applies_the_healthy_ranks_mean(two):
    reference = S.healthy_ranks_step(2)
    for v in all_ranks(ok(two, "hook_drops_nan_rank"), 2):
        assert v["applied"]
        assert torch.allclose(torch.tensor(v["params"]), reference, rtol=0, atol=1e-6)


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_nonfinite_safe_hook_records_the_dropped_rank(two):
    for v in all_ranks(ok(two, "hook_drops_nan_rank"), 2):
        assert v["hook"]["dropped_buckets"] == {0: 0, 1: 1}
        assert "AG132" in v["codes"]


# ---------------------------------------------------------------------- failures
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_a_rank_that_raises_does_not_leave_the_others_hanging(four):
    per_rank = four["rank_raises"]
    status, value = per_rank[3]
    assert status == "error" and "simulated crash" in value
    named = []
    for rank in range(3):
        status, v = per_rank[rank]
        assert status == "ok", v
        assert v["error"] == "PeerFailureError"
        # plain DDP runs no consensus: the next window's gradient all-reduce fails
        assert "gradient reduction in backward at step 3" in v["message"]
        assert v["ranks"] in ([3], [])  # never an innocent rank
        named += v["ranks"]
        assert v["seconds"] < 20  # far below the 30 s collective timeout
    # a ring neighbour of the dead rank fails at once and names it; a rank still blocked in the
    # ring is reported as blocked, not as failed (its roll-call thread answers for it)
    assert 3 in named


# ---------------------------------------------------------------------- failing peers
@pytest.fixture(scope="module")
def hangs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return S.run_group(2, HANGS, timeout=130, tmp=str(tmp_path_factory.mktemp("hangs")))


def _named_by_survivor(per_rank: dict, what: str) -> None:
    status, v = per_rank[0]
    assert status == "ok", v
    assert v["error"] == "PeerFailureError", v
    assert v["ranks"] == [1] and "rank(s) 1 did not answer" in v["message"]
    assert what in v["message"]
    assert v["seconds"] < S.SLEEP + 4  # peer_timeout + roll call, not the 30 s group timeout


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "plain"])
def test_a_rank_paused_inside_the_audit_is_named_after_peer_timeout(hangs, kind):
    per_rank = hangs[f"sleep_in_audit_{kind}"]
    _named_by_survivor(per_rank, "the cross-rank audit at step 2")
    status, v = per_rank[1]  # the paused rank gets a bounded error too, saying it was late
    assert status == "ok" and v["error"] == "PeerFailureError" and v["ranks"] == []
    assert "stopped waiting for THIS rank" in v["message"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("kind", ["fsdp2", "plain"])
def test_a_rank_paused_before_step_is_named_by_the_consensus_after_peer_timeout(hangs, kind):
    _named_by_survivor(hangs[f"sleep_before_step_{kind}"], "the found_inf consensus at step 2")


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_under_plain_ddp_a_rank_paused_before_step_is_bounded_by_the_group_timeout():
    # no consensus under plain DDP: the others wait in DDP's next all-reduce, which only the
    # process group's own timeout bounds (init_process_group(timeout=...); README)
    per_rank = S.run_group(2, ["sleep_before_step_ddp"], timeout=100, pg_timeout=3.0)
    per_rank = per_rank["sleep_before_step_ddp"]
    _named_by_survivor(per_rank, "the gradient reduction in backward at step 3")
    assert "Timed out" in per_rank[0][1]["message"]


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_crashed_rank_is_a_peer_failure_error_naming_it(kind):
    per_rank = S.run_group(2, [f"crash_{kind}"], timeout=100)[f"crash_{kind}"]
    status, v = per_rank[0]
    assert status == "ok", v
    assert v["error"] == "PeerFailureError" and v["ranks"] == [1]
    assert "at step 2 failed on rank 0 of 2" in v["message"]
    assert "Connection" in v["message"]  # gloo's own words stay in the message as the cause
    assert v["seconds"] < 15


# ---------------------------------------------------------------------- demo
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(GROUP_TIMEOUT)
def test_distributed_demo_under_fsdp2_skips_the_outlier_steps_on_every_rank(two):
    for v in all_ranks(ok(two, "demo_fsdp2"), 2):
        assert v["skipped"] == v["spike_steps"] == [16, 17, 18]
        assert v["loss_after"] < v["loss_before"]
        assert v["audits"] >= 1
        # the overflow origin names the last rank (whose shard held the burst), as under DDP
        assert v["origin"] == {0: 0, 1: 3}


_TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun_demo(out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(S._free_port()), "-m", "ampguard", "demo", "--distributed"]
    cmd += ["--steps", "30", "--no-progress", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)


@pytest.mark.slow  # multi-process (torchrun)
@pytest.mark.timeout(220)
def test_torchrun_launches_the_ddp_demo(tmp_path):
    proc = _torchrun_demo(tmp_path / "run")
    if proc.returncode != 0 and _TEARDOWN_ABORT in proc.stderr:
        # a rank aborting in torch's own teardown (std::terminate: a C++ thread still
        # joinable at exit) was seen once in a loaded CI run, never in 30 launches alone; a
        # second launch tells that from a demo that fails
        proc = _torchrun_demo(tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ampguard demo: 30 steps in fp16 on 2 CPU ranks (ddp") == 1
    assert (
        "overflow origin:   buckets non-finite BEFORE the all-reduce: rank 0: 0, rank 1: 3"
        in proc.stdout
    )
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert (tmp_path / "run" / "events.jsonl").is_file()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["distributed"]["world_size"] == 2  # rank 0 records the per-rank counters
    assert set(meta["distributed"]["rank_overflows"]) == {"0", "1"}


# ---------------------------------------------------------------------- one process
def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "100"])
def test_bad_audit_every_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="audit_every must be None or an integer >= 1"):
        ag.Guard(*tiny(), audit_every=value)


# None is the default: the group's own timeout if the user set one (test_peer_checkpoints.py)
@pytest.mark.parametrize("value", [0, -1, "5", True, float("nan"), 1e9])
def test_bad_peer_timeout_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="peer_timeout must be a number of seconds > 0"):
        ag.Guard(*tiny(), peer_timeout=value)


def test_peer_failure_error_is_exported_and_keeps_the_failed_ranks():
    err = ag.PeerFailureError("the audit at step 3 failed", ranks=(2, 3), step=3, what="audit")
    assert ag.PeerFailureError is __import__("ampguard.distributed").distributed.PeerFailureError
    assert err.ranks == [2, 3] and err.step == 3 and isinstance(err, RuntimeError)
    assert ag.PeerFailureError("plain message").ranks == []


def test_a_user_error_inside_the_guarded_block_is_not_a_peer_failure():
    from ampguard.distributed._peers import is_comm_error

    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_error(ValueError("gloo"))
    assert is_comm_error(
        RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7914")
    )


def test_bad_on_desync_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"on_desync must be one of \('raise', 'warn', 'repair'\)"):
        ag.Guard(*tiny(), on_desync="ignore")


def test_bad_process_group_string_is_a_value_error():
    with pytest.raises(ValueError, match="process_group must be None, 'local' or a ProcessGroup"):
        ag.Guard(*tiny(), process_group="world")


def test_single_process_guard_has_no_distributed_state():
    guard = ag.Guard(*tiny())
    assert guard.distributed is None
    assert guard.audit() == {}


def test_rank_zero_keeps_telemetry_and_other_ranks_drop_it():
    from ampguard.distributed import DistributedState, Topology, rank_telemetry

    def state(rank: int) -> DistributedState:
        top = Topology("ddp", None, rank, 2, (0, 1))
        return DistributedState(torch.nn.Linear(2, 2), top, torch.device("cpu"), 100, "raise")

    assert rank_telemetry(state(0), "runs/x") == "runs/x"
    assert rank_telemetry(state(1), "runs/x") is None


def test_a_rank_placeholder_in_the_run_folder_gives_every_rank_its_own_log():
    from ampguard.distributed import DistributedState, Topology, rank_telemetry

    top = Topology("ddp", None, 1, 2, (0, 1))
    st = DistributedState(torch.nn.Linear(2, 2), top, torch.device("cpu"), 100, "raise")
    assert rank_telemetry(st, "runs/x/rank{rank}") == "runs/x/rank1"


def test_distributed_demo_outside_torchrun_says_how_to_launch_it(monkeypatch):
    from ampguard.demo.distributed import run_distributed_demo

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2 -m ampguard demo"):
        run_distributed_demo("ddp", steps=2)


def test_distributed_demo_rejects_an_unknown_kind():
    from ampguard.demo.distributed import run_distributed_demo

    with pytest.raises(ValueError, match=r"kind must be one of \('ddp', 'fsdp2'\)"):
        run_distributed_demo("deepspeed", steps=2)


def test_param_checksum_is_equal_for_equal_parameters():
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    assert torch.equal(param_checksum(list(a.parameters())), param_checksum(list(b.parameters())))


def test_param_checksum_sees_a_one_bit_change():
    model = torch.nn.Linear(8, 8)
    before = param_checksum(list(model.parameters()))
    with torch.no_grad():
        w = model.weight.view(-1)
        w[5] = torch.nextafter(w[5], torch.tensor(float("inf")))
    assert not torch.equal(before, param_checksum(list(model.parameters())))


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_RunsCode.marker}",))


@pytest.mark.timeout(60)
def test_sharded_checkpoint_with_code_in_its_metadata_is_refused_without_running_it(
    world_of_one, tmp_path
):
    model = S.fsdp2(S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp16", scaler=S.SCALE)
    path = tmp_path / "ckpt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    _RunsCode.marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match="refused without executing anything"):
        ag.load_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    assert not Path(_RunsCode.marker).exists()


@pytest.mark.timeout(60)
def test_fsdp2_guard_records_a_run_log_of_its_shards(world_of_one, tmp_path):
    model = S.fsdp2(S.make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        scaler=S.SCALE,
        telemetry=tmp_path / "run",
    )
    for step in range(1, 4):
        S.window(guard, model, step, 0, 1)
    guard.close()
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert len(lines) >= 3


@pytest.mark.timeout(60)
def test_sharded_checkpoint_without_its_ampguard_file_is_a_checkpoint_error(world_of_one, tmp_path):
    model = S.fsdp2(S.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "ckpt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt)
    (path / "ampguard.pt").unlink()
    with pytest.raises(CheckpointError, match="ampguard.pt is missing"):
        ag.load_distributed_checkpoint(path, model=model, optimizer=opt)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fused", [False, True])
def test_consensus_adds_no_host_sync(world_of_one, fused):
    def syncs(process_group: str | None) -> int:
        model = torch.nn.parallel.DistributedDataParallel(S.make_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        guard = ag.Guard(
            model,
            opt,
            precision="fp16",
            scaler=S.SCALE,
            audit_every=None,
            process_group=process_group,
        )
        assert (guard.distributed is None) == (process_group == "local")
        with SyncCounter() as reads:
            for step in range(1, 4):
                S.window(guard, model, step, 0, 1)
        return reads.count

    assert syncs(None) == syncs("local")


def test_desync_finding_states_the_fix_once():
    from ampguard.distributed import DesyncError
    from ampguard.distributed._errors import DESYNC_FIX as _DESYNC_FIX

    err = DesyncError(
        f"audit at step 3: rank 1 differs. scale: 0=1.0, 1=2.0. Fix: {_DESYNC_FIX}",
        step=3,
        differences={"scale": {0: 1.0, 1: 2.0}},
        ranks=[1],
    )
    finding = err.finding
    assert finding.code == "AG130"
    assert "Fix:" not in finding.message
    assert finding.fix == _DESYNC_FIX
    assert str(err).endswith(_DESYNC_FIX)  # the exception itself still says what to do


@pytest.mark.timeout(60)
def test_consensus_is_needed_exactly_where_ranks_can_see_different_gradients(world_of_one):
    from ampguard.distributed.hooks import register_nonfinite_safe_hook

    ddp = torch.nn.parallel.DistributedDataParallel

    def needed(ignored: bool = False, **kwargs: object) -> bool:
        module = S.make_model()
        if ignored:  # a parameter of the model that DDP is told not to reduce
            module.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
            ddp._set_params_and_buffers_to_ignore_for_model(module, ["extra"])
        model = ddp(module)
        guard = ag.Guard(
            model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", **kwargs
        )
        return guard.distributed.consensus_needed

    assert not needed()  # plain DDP: every rank's own check agrees
    assert needed(contain_nonfinite_microbatches=True)
    assert needed(ignored=True)  # a parameter DDP does not reduce
    model = torch.nn.parallel.DistributedDataParallel(S.make_model())
    guard = ag.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    register_nonfinite_safe_hook(model)  # registered after the Guard: seen at the next window
    assert guard.distributed.consensus_needed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", traced(with_auto=False))
def test_plain_ddp_keeps_no_growing_per_window_state(world_of_one, precision):
    model = torch.nn.parallel.DistributedDataParallel(S.make_model())
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision=precision,
        scaler=S.SCALE if precision == "fp16" else None,
        audit_every=None,
    )
    for step in range(1, 4):
        S.window(guard, model, step, 0, 1)
    state = guard.distributed
    assert state.counters._finite == []  # drained every window (never filled without a scaler)
    assert len(state.counters._local) == (3 if precision == "fp16" else 0)  # folded at 64


@pytest.mark.timeout(60)
def test_only_communication_errors_inside_the_guard_become_peer_failures(world_of_one):
    model = torch.nn.parallel.DistributedDataParallel(S.make_model())
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", peer_timeout=3
    )
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        with guard.autocast():
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert not isinstance(info.value, ag.PeerFailureError)  # the user's own error, untouched
    with pytest.raises(ag.PeerFailureError, match="the forward's collectives at step 1") as info:
        with guard.autocast():
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert info.value.step == 1 and info.value.ranks == []  # one rank: nobody missing
    assert "Connection closed by peer" in str(info.value)  # gloo's words stay as the cause
