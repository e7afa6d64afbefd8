"""Distributed checkpoints attacked: a failed load changes nothing, a damaged shard never loads.

One gloo rank (a world of one) is enough: the checks run before any collective read, the same
on every rank.
"""

from __future__ import annotations

import copy

import _distributed_scenarios as S
import pytest
import torch
from torch import nn

import ampguard as ag


def live(wrap, seed=0, model=None):
    model = wrap(model if model is not None else S.make_model(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = ag.Guard(model, opt, precision="fp16", scaler=S.SCALE)
    for step in range(1, 3):
        S.window(guard, model, step + 10 * seed, 0, 1)
    return model, opt, guard


def local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(model, opt, guard):
    return {
        "model": {k: local(v).clone() for k, v in model.state_dict().items()},
        "opt": {
            id(p): {k: local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in opt.state.items()
        },
        "groups": copy.deepcopy(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        ),
        "guard": guard.state_dict(),
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(before, model, opt, guard):
    after = snapshot(model, opt, guard)
    for key, value in before["model"].items():
        assert torch.equal(value, after["model"][key]), key
    for pid, state in before["opt"].items():
        for k, v in state.items():
            got = after["opt"][pid][k]
            assert torch.equal(v, got) if isinstance(v, torch.Tensor) else v == got
    assert before["groups"] == after["groups"] and before["guard"] == after["guard"]
    assert torch.equal(before["rng"], after["rng"])


def wider() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 32), nn.GELU(), nn.Linear(32, 4)
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrap", [S.fsdp2, S.ddp], ids=["fsdp2", "ddp"])
def test_a_model_that_does_not_fit_is_refused_and_nothing_is_loaded(world_of_one, tmp_path, wrap):
    model, opt, guard = live(wrap)
    path = tmp_path / ("ckpt" if wrap is S.fsdp2 else "ckpt.pt")
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    other = live(wrap, seed=1, model=wider())
    before = snapshot(*other)
    with pytest.raises(ag.CheckpointError, match="does not fit") as info:
        ag.load_distributed_checkpoint(path, model=other[0], optimizer=other[1], guard=other[2])
    assert str(path) in str(info.value) and "shape" in str(info.value)
    assert_unchanged(before, *other)


@pytest.mark.timeout(60)
def test_a_flipped_byte_in_a_shard_file_is_refused_naming_the_file(world_of_one, tmp_path):
    model, opt, guard = live(S.fsdp2)
    path = tmp_path / "ckpt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    other = live(S.fsdp2, seed=1)
    before = snapshot(*other)
    with pytest.raises(ag.CheckpointError, match=rf"{shard.name} fails its CRC-32"):
        ag.load_distributed_checkpoint(path, model=other[0], optimizer=other[1], guard=other[2])
    assert_unchanged(before, *other)


@pytest.mark.timeout(60)
def test_a_crafted_guard_state_in_the_side_file_changes_nothing(world_of_one, tmp_path):
    model, opt, guard = live(S.fsdp2)
    path = tmp_path / "ckpt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    meta = torch.load(path / "ampguard.pt", weights_only=True)
    meta["guard"]["steps"] = "many"
    torch.save(meta, path / "ampguard.pt")
    other = live(S.fsdp2, seed=1)
    before = snapshot(*other)
    with pytest.raises(ag.CheckpointError, match=r"'steps' must be an int"):
        ag.load_distributed_checkpoint(path, model=other[0], optimizer=other[1], guard=other[2])
    assert_unchanged(before, *other)


@pytest.mark.timeout(60)
def test_a_crafted_rng_state_in_a_replicated_checkpoint_changes_nothing(world_of_one, tmp_path):
    model, opt, guard = live(S.ddp)
    path = tmp_path / "ckpt.pt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    data = torch.load(path, weights_only=True)
    data["extra"]["__ampguard_distributed__"]["rng"][0]["cpu"] = torch.zeros(7)
    torch.save(data, path)
    other = live(S.ddp, seed=1)
    before = snapshot(*other)
    with pytest.raises(ag.CheckpointError, match=r"rng\['cpu'\]"):
        ag.load_distributed_checkpoint(path, model=other[0], optimizer=other[1], guard=other[2])
    assert_unchanged(before, *other)


@pytest.mark.timeout(60)
def test_a_sharded_save_under_a_file_is_a_checkpoint_error_with_the_os_error(
    world_of_one, tmp_path
):
    model, opt, guard = live(S.ddp)
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(ag.CheckpointError, match="not a folder") as info:
        ag.save_distributed_checkpoint(
            tmp_path / "blocker" / "ckpt.pt", model=model, optimizer=opt, guard=guard
        )
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda path, meta: next(path.glob("*.distcp")).unlink(), r"__0_0.distcp is missing"),
        (
            lambda path, meta: meta["files"].update({"../../etc/passwd": [1, 2]}),
            r"lists '../../etc/passwd', which is not a file of this checkpoint",
        ),
        (lambda path, meta: meta["files"].update({"__0_0.distcp": "fine"}), r"not \[size, crc32\]"),
    ],
)
def test_a_damaged_shard_list_is_refused_and_changes_nothing(world_of_one, tmp_path, damage, match):
    model, opt, guard = live(S.fsdp2)
    path = tmp_path / "ckpt"
    ag.save_distributed_checkpoint(path, model=model, optimizer=opt, guard=guard)
    meta = torch.load(path / "ampguard.pt", weights_only=True)
    damage(path, meta)
    torch.save(meta, path / "ampguard.pt")
    other = live(S.fsdp2, seed=1)
    before = snapshot(*other)
    with pytest.raises(ag.CheckpointError, match=match):
        ag.load_distributed_checkpoint(path, model=other[0], optimizer=other[1], guard=other[2])
    assert_unchanged(before, *other)
