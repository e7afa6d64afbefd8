"""Guard(precision=certificate)'s re-check across a checkpoint: the "two in a row" drift count
(a layer the meter flagged once, not moved yet) and the moves so far are part of the Guard state
(``"fp8"``, version 2), so a run saved mid-drift and resumed moves the layer at the same step as
the uninterrupted run, with bitwise the same losses and the same AG114 findings. A moved layer
stays up (no demotion); a version-1 state (no drift count) still loads."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampguard as ag

pytest.importorskip("torchao")


class RowSpike(nn.Module):
    """Every 16th sample 300x the others (planted): NVFP4 ruins the next layer's gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.ones(x.shape[0], 1, dtype=x.dtype)
        s[::16] = 300.0
        return x * s


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            a=nn.Linear(64, 128), t=nn.GELU(), spike=RowSpike(), b=nn.Linear(128, 128),
            t2=nn.Tanh(), c=nn.Linear(128, 16),
        )
    )  # fmt: skip


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(64, 16, generator=gen) / 8
    return [
        (x, torch.tanh(x @ teacher)) for x in (torch.randn(32, 64, generator=gen) for _ in range(n))
    ]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]).float(), batch[1])


CERT = ag.RecipeCertificate(
    recipe={"a": "bf16", "b": "nvfp4", "c": "nvfp4"}, passed=True, loss_delta=0.0, noise=0.0,
    tolerance=0.0, flop_share={}, steps=1, seeds=(0, 1), recheck_every=2,
)  # fmt: skip


def _guard(model: nn.Module) -> ag.Guard:
    return ag.Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision=CERT)


def _train(guard: ag.Guard, model: nn.Module, batches, start: int, stop: int):
    losses, formats = [], []
    for batch in batches[start:stop]:
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
        losses.append(loss.detach().clone())
        formats.append(guard.fp8.formats())
    return losses, formats


def _moves(guard: ag.Guard) -> list[tuple[str, int]]:
    return [(f.evidence["module"], f.step) for f in guard.findings() if f.code == "AG114"]


def _resumed(tmp_path, batches, at: int, edit=None, warns: bool = False):
    """Train ``at`` steps, checkpoint, resume a fresh Guard from the file (``edit``: from the
    edited state in memory instead)."""
    model = _model()
    guard = _guard(model)
    _train(guard, model, batches, 0, at)
    path = ag.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=guard.optimizers[0],
                              guard=guard)  # fmt: skip
    state = guard.state_dict()
    model2 = _model()
    guard2 = _guard(model2)
    # a re-check that moved a layer: the saved formats differ from the certificate's
    expect = pytest.warns(RuntimeWarning, match="resuming with the saved formats")
    with expect if warns else contextlib.nullcontext():
        if edit is None:
            ag.load_checkpoint(path, model=model2, optimizer=guard2.optimizers[0], guard=guard2)
        else:
            ag.load_checkpoint(path, model=model2, optimizer=guard2.optimizers[0])
            guard2.load_state_dict(edit(state))
    return guard2, model2, state


def test_a_run_saved_mid_drift_moves_the_layer_at_the_same_step_as_an_uninterrupted_one(
    tmp_path,
):
    batches = _batches(8)
    model = _model()
    guard = _guard(model)
    losses, formats = _train(guard, model, batches, 0, 8)
    assert formats[2] == {"b": "nvfp4", "c": "nvfp4"}  # step 2 flagged b once: not moved
    assert formats[3] == {"b": "mxfp8", "c": "nvfp4"}  # step 4: the second in a row moves it
    assert _moves(guard) == [("b", 4), ("b", 8)]  # MXFP8 still ruins it: up to bf16 at 8

    guard2, model2, state = _resumed(tmp_path, batches, 3)  # saved after step 3: b pending
    assert state["fp8"]["version"] == 2 and state["fp8"]["strikes"] == {"b": 1}
    assert state["fp8"]["moves"] == []
    after, formats2 = _train(guard2, model2, batches, 3, 8)
    assert formats2 == formats[3:]
    assert _moves(guard2) == _moves(guard)
    assert all(torch.equal(x, y) for x, y in zip(after, losses[3:], strict=True))

    # saved after the move: the moves resume as findings, the strikes as they were
    guard3, model3, state = _resumed(tmp_path, batches, 5, warns=True)
    assert state["fp8"]["recipe"] == {"b": "mxfp8", "c": "nvfp4"}
    assert [m["module"] for m in state["fp8"]["moves"]] == ["b"]
    assert _moves(guard3) == [("b", 4)] and guard3.fp8.formats() == formats[4]
    after, formats3 = _train(guard3, model3, batches, 5, 8)
    assert formats3 == formats[5:] and _moves(guard3) == _moves(guard)
    assert all(torch.equal(x, y) for x, y in zip(after, losses[5:], strict=True))


def test_a_state_without_the_drift_count_forgets_it_and_a_version_1_state_still_loads(
    tmp_path,
):
    batches = _batches(6)

    def old(state):  # what a version-1 state held: the formats only
        state = dict(state, fp8={"format": "recipe", "recipe": state["fp8"]["recipe"]})
        return state

    guard, model, _ = _resumed(tmp_path, batches, 3, edit=old)
    _, formats = _train(guard, model, batches, 3, 6)
    # the pending drift is forgotten: step 4 is a first strike, the move waits for step 6
    assert formats[0] == {"b": "nvfp4", "c": "nvfp4"}
    assert formats[-1] == {"b": "mxfp8", "c": "nvfp4"} and _moves(guard) == [("b", 6)]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("strikes", {"zz": 1}, r"strikes.*'zz'"),
        ("strikes", {"b": 0}, r"strikes.*'b'.*positive int"),
        ("strikes", [1], r"strikes.*dict"),
        ("moves", [{"module": "b"}], r"moves"),
        (
            "moves",
            [{"module": "zz", "step": 4, "from": "nvfp4", "to": "mxfp8", "reason": ""}],
            r"moves.*'zz'",
        ),  # fmt: skip
        ("version", 3, r"version 3"),
    ],
)
def test_a_malformed_recheck_state_is_one_error_and_nothing_changes(field, value, message):
    model = _model()
    guard = _guard(model)
    state = guard.state_dict()
    state["fp8"] = dict(state["fp8"], **{field: value})
    with pytest.raises(ValueError, match=message):
        guard.load_state_dict(state)
    assert guard.fp8.formats() == {"b": "nvfp4", "c": "nvfp4"}
    assert guard.state_dict()["fp8"]["strikes"] == {}


def test_a_moved_layer_stays_up_even_when_its_old_format_would_read_healthy_again():
    from ampguard.fp8._fidelity import failing, gradient_fidelity

    model = _model()
    guard = _guard(model)
    batch = _batches(1)[0]
    moved = guard.fp8.recheck(loss_fn, [batch], step=2)
    assert [m["module"] for m in moved] == ["b"] and guard.fp8.formats()["b"] == "mxfp8"
    model.spike = nn.Identity()  # the drift is gone: b in NVFP4 would read healthy now
    meter = gradient_fidelity(model, loss_fn, [batch], {"b": "nvfp4", "c": "nvfp4"})
    assert "b" not in failing(meter)
    for step in (4, 6, 8):
        assert guard.fp8.recheck_step(loss_fn, batch, step) == []
    assert guard.fp8.formats() == {"b": "mxfp8", "c": "nvfp4"}  # no demotion
