"""Shared fixtures: tiny random models built by the tests and the default model."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
