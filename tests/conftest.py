"""Shared fixtures: tests are fast, offline and deterministic."""

from __future__ import annotations


import pytest
import torch

# Tests use tiny tensors: one thread avoids thread start-up overhead and oversubscription when
# the 2-core machine is busy (measured 10-20x slower tiny convolutions with 2 threads under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
