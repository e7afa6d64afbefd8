"""Telemetry's host staging: rows come back in order, buffers are reused, CUDA needs no wait."""

import pytest
import torch

from ampguard.telemetry._staging import HostStaging


def test_cpu_copies_are_ready_at_once_in_order_and_reuse_one_buffer():
    stage = HostStaging(8, torch.device("cpu"))
    src = torch.arange(8, dtype=torch.float32)
    stage.push(src[:3], "a")
    got = [(list(h), p) for h, p in stage.ready()]
    assert got == [([0.0, 1.0, 2.0], "a")] and stage.in_flight == 0
    src.add_(10)  # the copy was taken at push time
    stage.push(src[:2], "b")
    assert [(list(h), p) for h, p in stage.ready()] == [([10.0, 11.0], "b")]


def test_push_without_a_free_buffer_is_refused():
    stage = HostStaging(4, torch.device("cpu"))
    stage.push(torch.zeros(4), 1)
    with pytest.raises(RuntimeError, match="in flight"):
        stage.push(torch.zeros(4), 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_is_pinned_non_blocking_and_waited_for_only_when_asked():
    stage = HostStaging(1 << 20, torch.device("cuda"))
    assert stage.asynchronous
    src = torch.full((1 << 20,), 3.0, device="cuda")
    stage.push(src, "x")
    src.zero_()  # queued after the copy on the same stream
    rows = list(stage.ready(wait=True))
    assert rows[0][1] == "x" and float(rows[0][0].min()) == 3.0
