"""ampguard.testing: the host-sync counter the other tests and the benchmarks rely on."""

from __future__ import annotations

import pytest
import torch

import ampguard as ag
from ampguard.testing import SyncCounter, count_syncs


def test_item_counts_one():
    t = torch.ones(3)
    with SyncCounter() as syncs:
        t.sum().item()
    assert syncs.count == 1


def test_tolist_counts_one():
    t = torch.arange(5)
    with SyncCounter() as syncs:
        t.tolist()
    assert syncs.count == 1


def test_pure_device_ops_count_zero():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    x = torch.randn(2, 4)
    with SyncCounter() as syncs:
        model(x).pow(2).mean().backward()
        opt.step()
        torch.where(torch.isfinite(x), x, torch.zeros_like(x)).add_(1)
    assert syncs.count == 0


def test_sync_counter_sees_item_and_tolist():
    # The instrument must be able to fail: both kinds of host read are counted.
    t = torch.ones(3)
    assert count_syncs(lambda: (t.sum().item(), t.tolist(), bool(t[0])), 1) == 3


def test_count_syncs_is_per_call():
    t = torch.ones(3)
    assert count_syncs(lambda: t.sum().item(), 4) == 1.0


def test_each_with_block_starts_from_zero():
    counter, t = SyncCounter(), torch.ones(1)
    with counter:
        t.item()
    with counter:
        pass
    assert counter.count == 0


@pytest.mark.parametrize("steps", [0, -1, 2.0, True])
def test_count_syncs_rejects_a_bad_steps(steps):
    with pytest.raises(ValueError, match="steps must be a positive int"):
        count_syncs(lambda: None, steps)


def test_sync_counter_is_exported():
    assert ag.SyncCounter is SyncCounter
