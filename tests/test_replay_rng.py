"""Forensics replays the step that failed: the RNG state is captured when the
forward starts and the replay starts from it, so dropout draws the failing step's mask; a replay
that does not reproduce the logged non-finite loss says so."""

from __future__ import annotations

import torch
from torch import nn

import ampguard as ag
from ampguard.forensics._live import reproduced

HOT = range(5, 17)  # steps whose batch has one unit at 40000: inf in fp16 iff dropout keeps it


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Dropout(0.5), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[:, 1:].normal_(0, 0.1)
        model[0].weight[0, 0] = 1.0  # unit 0 = x[:, 0]; dropout doubles it when kept
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(1, 4, generator=g)
    x[0, 0] = 40000.0 if step in HOT else 0.5  # 80000 after dropout's x2: beyond 65504
    return x, torch.zeros(1, 1)


def _loss(model, batch):
    return model(batch[0]).float().pow(2).mean()


def _train(seed: int = 1):
    model = _model()
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp16", forensics=True
    )
    torch.manual_seed(seed)
    failed = []
    for step in range(1, 21):
        batch = _batch(step)
        with guard.autocast():
            loss = _loss(model, batch)
        guard.backward(loss)
        if not torch.isfinite(loss):
            failed.append(step)
        guard.step(batch=batch, loss_fn=_loss)
    return guard, failed


def test_every_replayed_step_reproduces_its_dropout_mask_and_its_nan_loss():
    guard, failed = _train()
    assert len(failed) >= 3  # the mask matters: some hot steps fail, others do not
    assert len(failed) < len(HOT)
    found = [f for f in guard.findings() if f.code in ("AG300", "AG301")]
    (f,) = found  # one diagnosis, every replay: no "finite forward" for a step whose loss was inf
    assert (f.evidence["kind"], f.evidence["phase"]) == ("fp16_overflow", "forward")
    assert f.evidence["module"] == "1"  # the dropout doubled the kept unit past 65504
    assert f.evidence["stats"]["replay_reproduced"] is True
    # the first failure may be the scaler's start-up descent (not replayed); every later one is,
    # and no step whose training loss was finite is called a forward overflow (hot steps whose
    # mask dropped the unit skip on a benign backward probe: the scale, not the forward)
    assert set(failed[1:]) <= set(f.evidence["steps"]) <= set(failed)
    assert "did not reproduce" not in f.message


def test_a_replay_that_does_not_reproduce_the_nan_loss_says_so():
    model = _model()
    model.eval()  # no dropout: the batch with x0 = 0.5 is finite
    diag = ag.locate(model, _loss, _batch(1))
    assert diag.ok
    diag = reproduced(diag, logged_nonfinite=True)
    assert diag.stats["replay_reproduced"] is False
    assert diag.explain().startswith("The replay did not reproduce the failing step")


def test_locate_takes_an_rng_state_and_puts_the_callers_rng_back():
    model = _model()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    torch.manual_seed(7)
    after = torch.get_rng_state()
    a = ag.locate(model, _loss, _batch(5), rng_state=state)
    assert torch.equal(torch.get_rng_state(), after)  # training's RNG is untouched
    b = ag.locate(model, _loss, _batch(5), rng_state={"cpu": state})
    assert a.to_dict() == b.to_dict()
    try:
        ag.locate(model, _loss, _batch(5), rng_state=3)
    except TypeError as e:
        assert "rng_state must be torch.get_rng_state()" in str(e)
    else:
        raise AssertionError("rng_state=3 was accepted")
