"""Shared fixtures: tiny random models built by the tests and the default model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The weight cache (docs/performance.md, Startup) of this test session: not the user's, and shared
# by the servers the tests start (they inherit the environment).
_CACHE_PREFIX = "roseinfer-test-cache-"
os.environ.setdefault("ROSEINFER_CACHE_DIR", tempfile.mkdtemp(prefix=_CACHE_PREFIX))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session's weight cache made above (GBs of fp32 copies: left behind, every
    run filled /tmp), never a directory the user chose."""
    cache = Path(os.environ.get("ROSEINFER_CACHE_DIR", ""))
    if cache.name.startswith(_CACHE_PREFIX) and cache.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def private_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of this test alone (weights, tokenizers), the cache switched on."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROSEINFER_CACHE_DIR", str(cache))
    monkeypatch.delenv("ROSEINFER_WEIGHT_CACHE", raising=False)
    return cache
