"""Shared test settings: one intra-op thread keeps fp16 CPU runs deterministic and fast."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo process group for the test (file store in tmp_path), destroyed after."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
