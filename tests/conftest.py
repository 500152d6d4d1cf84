"""Shared fixtures: tests are fast, offline and deterministic."""

from __future__ import annotations

import os

import pytest
import torch

# The machine has 2 cores; keep each test process to them and make runs repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
