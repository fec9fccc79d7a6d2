"""The periodic stats log: vLLM's line when something happened, silence otherwise, and
a speculative-decoding line once drafts exist."""

from __future__ import annotations

import logging

import pytest

from roseinfer.engine.stats import EngineStats, log_stats


def test_stats_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("roseinfer.test-stats")
    s = EngineStats(num_total_blocks=8, prompt_tokens_total=100, generation_tokens_total=40)
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert log_stats(logger, s, 2.0, (100, 40)) == (100, 40)  # idle: nothing
        assert not caplog.records
        assert log_stats(logger, s, 2.0, (60, 20)) == (100, 40)
    assert len(caplog.records) == 1
    assert "prompt throughput: 20.0 tok/s, generation throughput: 10.0 tok/s" in caplog.text
    caplog.clear()
    s.record_spec_decode(4, 3)
    s.record_spec_decode(4, 1)
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_stats(logger, s, 1.0, (0, 0))
    assert "acceptance rate 50.0% (4 of 8 drafted tokens), mean accepted per draft: 2.00" \
        in caplog.text
