"""OpTrace's batched hunt: the first op that made a non-finite value is still the one named
when several do, when it comes after many candidates, and with far fewer host syncs."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampguard.forensics._optrace import HUNT_BATCH, OpTrace, is_new
from ampguard.testing import SyncCounter

W = 16


class Branches(nn.Module):
    """``a`` and ``b`` both overflow fp16 on their own (finite inputs, inf outputs); ``a`` runs
    first, so it is the first op to make a non-finite value."""

    def __init__(self, depth: int = 0) -> None:
        super().__init__()
        self.pre = nn.Sequential(*(nn.Linear(W, W) for _ in range(depth)))
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)
        with torch.no_grad():
            self.a.weight.fill_(1e4)
            self.b.weight.fill_(2e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.pre(x))
        return self.a(h) + self.b(h)


def traced(model: nn.Module) -> OpTrace:
    trace = OpTrace(model, numerics=True)
    with trace.session("forward"), torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.rand(8, W))
    with trace.session("backward"):
        F.mse_loss(out.float(), torch.zeros(8, W)).backward()
    return trace


def first_new(trace: OpTrace, phase: str = "forward"):
    stats = trace.stats()
    return next(
        e
        for e in trace.events
        if e.phase == phase and e.row is not None and is_new(stats[e.row], e.intentional)
    )


def test_first_of_several_nonfinite_ops_is_named_and_rerun():
    trace = traced(Branches())
    first = first_new(trace)
    assert (first.module, first.op) == ("a", "aten.addmm")
    assert trace.shadow[first.index] > 65504  # rerun from fp32 inputs: the value that did not fit
    later = [e for e in trace.events if e.module == "b" and e.op == "aten.addmm"]
    assert later and later[0].index not in trace.shadow  # only the first one is rerun
    row = trace.stats()[first.row]
    assert row[4] > 0 and row[3] == 0  # inf count measured, no NaN


def test_first_nonfinite_op_after_more_than_one_batch_of_candidates():
    model = Branches(depth=HUNT_BATCH)  # > HUNT_BATCH fp16 ops before ``a``
    with SyncCounter() as counter:
        trace = traced(model)
    first = first_new(trace)
    assert (first.module, first.op) == ("a", "aten.addmm")
    assert trace.shadow[first.index] > 65504
    low_ops = sum(1 for e in trace.events if e.out_dtype == torch.float16)
    # one read per batch of candidates, not one per fp16 op
    assert counter.count < low_ops / 8


def test_an_input_changed_in_place_later_is_not_rerun():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Linear(W, W)
            with torch.no_grad():
                self.big.weight.fill_(1e4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.half()
            y = self.big(h)
            h.mul_(0)  # the op's input changes before its numbers are read
            return y

    trace = OpTrace(InPlace(), numerics=True)
    with trace.session("forward"), torch.autocast("cpu", dtype=torch.float16):
        trace.model(torch.rand(4, W))
    first = first_new(trace)
    assert first.module == "big"
    assert trace.shadow[first.index] is None  # not rerun from values it never saw
