"""Shared test settings: one intra-op thread keeps fp16 CPU runs deterministic and fast."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
