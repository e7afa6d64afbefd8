"""``ag.autopsy`` on real CPU training runs: the replay is the run the Guard saw (gradient
accumulation), it must reproduce the step it explains, the data-or-update question comes before
dropping samples, and a removal has a margin.

Spikes are planted physically: a batch with confidently wrong outlier samples, or one window's
LR raised for one layer (its update makes the next window's loss spike).
"""

from __future__ import annotations

import math

import pytest
import torch

import ampguard as ag
from ampguard.guard._autopsy import _removes
from ampguard.reporting.postmortem import layer_kind

SPIKE = 80  # the planted spike's window (after the detector's 50-window warm-up)


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


class _Data:
    """A fixed, learnable classification task; batch ``step`` is the same on every call."""

    def __init__(self, size: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.size = size
        self.x = torch.randn(256, 16, generator=g)
        self.y = (self.x @ torch.randn(16, 4, generator=g)).argmax(dim=1)

    def batch(self, step: int, micro: int = 0, spike: bool = False) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 + 7 * step + micro)
        idx = torch.randint(0, 256, (self.size,), generator=g)
        x, y = self.x[idx].clone(), self.y[idx].clone()
        if spike:
            x[:3] *= 50.0  # three confidently wrong outlier samples carry the loss
            y[:3] = (y[:3] + 1) % 4
        return x, y


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 4)
    )


# ---------------------------------------------------------------------- what the Guard saw
def test_autopsy_replays_gradient_accumulation_and_verifies_an_outlier_micro_batch() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(
        model, opt, precision="bf16", accumulation_steps=2, on_spike="skip", snapshot_every=20
    )
    data = _Data(16)
    for step in range(1, SPIKE + 1):
        for micro in range(2):
            batch = data.batch(step, micro, spike=step == SPIKE and micro == 1)
            with guard.autocast():
                loss = _loss_fn(model, batch)
            guard.backward(loss)
            guard.step(batch=batch, loss_fn=_loss_fn)
    assert [e.step for e in guard.flight_recorder.events] == [SPIKE]
    (d,) = ag.autopsy(guard)
    assert d.verified, d.evidence
    assert d.mechanism == "outlier_batch" and d.evidence["removed_by"] == "drop_outliers"
    assert d.evidence["reproduced"] is True  # both micro-batches replayed, the recorded loss
    assert d.evidence["replayed_loss"] == d.evidence["loss"] or math.isclose(
        d.evidence["replayed_loss"], d.evidence["loss"], rel_tol=1e-3
    )


def test_autopsy_names_the_micro_batch_without_a_batch() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(
        model, opt, precision="bf16", accumulation_steps=2, on_spike="skip", snapshot_every=20
    )
    data = _Data(16)
    for step in range(1, SPIKE + 1):
        for micro in range(2):
            batch = data.batch(step, micro, spike=step == SPIKE and micro == 1)
            with guard.autocast():
                loss = _loss_fn(model, batch)
            guard.backward(loss)
            if micro == 0 and step == SPIKE - 1:
                guard.step()  # this micro-batch is not recorded
            else:
                guard.step(batch=batch, loss_fn=_loss_fn)
    (d,) = ag.autopsy(guard)
    assert not d.verified
    assert f"no batch recorded for step {SPIKE - 1}" in d.evidence["replay"]
    assert "every micro-batch" in d.evidence["replay"]


def test_a_replay_that_does_not_reproduce_the_step_verifies_nothing() -> None:
    """The loop draws from the global RNG outside the Guard right before window SPIKE - 1 (after
    the last snapshot): the replay's dropout masks differ there, and the autopsy says so instead
    of explaining a step it did not reproduce."""
    model = _model(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=SPIKE - 2)
    data = _Data()
    for step in range(1, SPIKE + 1):
        if step == SPIKE - 1:
            torch.rand(1)  # e.g. a data augmentation drawing from the global generator
        batch = data.batch(step, spike=step == SPIKE)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=_loss_fn)
    assert [e.step for e in guard.flight_recorder.events] == [SPIKE]
    (d,) = ag.autopsy(guard)
    assert not d.verified and "removed_by" not in d.evidence
    assert f"did not reproduce step {SPIKE - 1}" in d.evidence["replay"]


def test_a_reproduced_replay_says_so() -> None:
    model = _model(dropout=0.1)  # dropout: the replay restores the RNG of the snapshot
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=SPIKE - 10)
    data = _Data()
    for step in range(1, SPIKE + 1):
        batch = data.batch(step, spike=step == SPIKE)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=_loss_fn)
    (d,) = ag.autopsy(guard)
    assert d.evidence["reproduced"] is True and "replay" not in d.evidence
    assert d.verified and d.mechanism == "outlier_batch"


# ---------------------------------------------------------------------- data or update
def test_an_update_spike_is_not_blamed_on_the_batch() -> None:
    """A moderate outlier update of the output layer (its LR 400x for one window): dropping the
    highest-loss quarter of the next batch would bring its loss under the bound, but that batch
    does not spike at the weights from before the update, so the batch is not the suspect."""
    model = _model()
    head, body = list(model[3].parameters()), list(model[0].parameters())
    opt = torch.optim.SGD([{"params": body, "lr": 0.05}, {"params": head, "lr": 0.05}])
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=SPIKE - 2)
    data = _Data()
    for step in range(1, SPIKE + 1):
        opt.param_groups[1]["lr"] = 20.0 if step == SPIKE - 1 else 0.05
        batch = data.batch(step)
        with guard.autocast():
            loss = _loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=_loss_fn)
    assert [e.step for e in guard.flight_recorder.events] == [SPIKE]
    (d,) = ag.autopsy(guard)
    assert d.evidence["loss_before_update"] < d.evidence["bound"]
    assert "drop_outliers" in d.evidence["not_tried"]
    assert d.verified and d.mechanism == "output_logit_divergence" and d.layer == "3"


def test_bf16_optimizer_states_are_replayed_in_fp32_and_not_blamed_for_an_update() -> None:
    """A pure-bf16 model (its AdamW states in bf16): the autopsy tries the step with the states
    in fp32 (the intervention that verifies optimizer_state_rounding); the spike here comes from
    an outlier update of the output layer, so that replay keeps the spike and the update is
    named; the later replays load the states back in bf16."""

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y)

    model = _model().to(torch.bfloat16)
    head, body = list(model[3].parameters()), list(model[0].parameters())
    opt = torch.optim.AdamW([{"params": body, "lr": 3e-3}, {"params": head, "lr": 3e-3}])
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=SPIKE - 2)
    data = _Data()
    for step in range(1, SPIKE + 1):
        opt.param_groups[1]["lr"] = 3.0 if step == SPIKE - 1 else 3e-3
        batch = data.batch(step)
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
    (d,) = ag.autopsy(guard)
    tried = d.evidence["interventions"]
    assert tried["fp32_states"] > d.evidence["bound"]  # tried, and the spike stayed
    assert d.verified and d.mechanism == "output_logit_divergence" and d.layer == "3"
    assert all(
        v.dtype == torch.bfloat16
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()
    )


# ---------------------------------------------------------------------- verdicts
def test_a_removal_needs_a_margin_not_a_loss_just_under_the_bound() -> None:
    level, bound, spike = 1.0, 1.3, 2.0
    assert _removes(1.05, bound, level, spike)  # most of the excess gone
    assert not _removes(1.29, bound, level, spike)  # under the bound, but noise could flip it
    assert not _removes(1.5, bound, level, spike)
    assert not _removes(math.nan, bound, level, spike)


def test_only_query_key_projections_make_attention_logits() -> None:
    assert layer_kind("blocks.0.attn.q_proj", "lm_head") == "attention_logit_growth"
    assert layer_kind("transformer.h.0.attn.c_attn", "lm_head") == "attention_logit_growth"
    assert layer_kind("blocks.0.attn.v_proj", "lm_head") == "update_outlier"
    assert layer_kind("transformer.h.0.attn.c_proj", "lm_head") == "update_outlier"
    assert layer_kind("lm_head", "lm_head") == "output_logit_divergence"


# ---------------------------------------------------------------------- a batch provider
def _run_without_batches(guard: ag.Guard, data: _Data) -> None:
    for step in range(1, SPIKE + 1):
        batch = data.batch(step, spike=step == SPIKE)
        with guard.autocast():
            loss = _loss_fn(guard.model, batch)
        guard.backward(loss)
        guard.step()  # no batch= / loss_fn=


def test_a_batch_provider_lets_the_autopsy_replay_an_unrecorded_run() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=20)
    data = _Data()
    _run_without_batches(guard, data)
    (d,) = ag.autopsy(guard, batches=lambda s: data.batch(s, spike=s == SPIKE), loss_fn=_loss_fn)
    assert d.verified and d.mechanism == "outlier_batch" and d.evidence["reproduced"] is True
    # a provider that does not give what the run trained on is caught by the replay check
    (d,) = ag.autopsy(guard, batches=lambda s: data.batch(s + 1), loss_fn=_loss_fn)
    assert not d.verified and "did not reproduce step" in d.evidence["replay"]


def test_a_bad_batch_provider_is_named() -> None:
    model = _model()
    guard = ag.Guard(model, torch.optim.AdamW(model.parameters(), lr=3e-3), precision="bf16")
    with pytest.raises(TypeError, match="batches must be a callable"):
        ag.autopsy(guard, batches=[1, 2], loss_fn=_loss_fn)
    with pytest.raises(ValueError, match="batches= needs loss_fn="):
        ag.autopsy(guard, batches=lambda s: None)
    with pytest.raises(ValueError, match="loss_fn= goes with batches="):
        ag.autopsy(guard, loss_fn=_loss_fn)


# ---------------------------------------------------------------------- distributed
@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(150)
def test_under_ddp_the_autopsy_says_plainly_that_it_does_not_replay(tmp_path):
    import _distributed_scenarios as S
    import _spike_scenarios as P

    results = S.run_ranks(P.rank_main, 2, ["autopsy_under_ddp"], 120, str(tmp_path), 30.0)[
        "autopsy_under_ddp"
    ]
    assert sorted(results) == [0, 1], results
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        assert value["diagnoses"], value  # the ranks agreed on the spike: each has it
        for d in value["diagnoses"]:
            assert d["step"] == P.SPIKE and not d["verified"]
            assert "a distributed model is not replayed" in d["replay"]
