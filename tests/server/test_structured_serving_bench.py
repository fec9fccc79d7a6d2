"""The structured-output serving benchmark in its quick mode against the real test server:
both sides run, the table and the JSON come out, and every constrained output that
finished on its own parses and validates against its schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_serving.py"


def test_quick_run(server, tmp_path: Path) -> None:
    out = tmp_path / "structured_serving.json"
    cmd = [sys.executable, str(SCRIPT), "--url", server.url, "--concurrency", "1", "2",
           "--rounds", "1", "--requests", "2", "--max-tokens", "48", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| concurrency | requests/run | unconstrained tok/s | json_schema tok/s |" in (
        proc.stdout)
    result = json.loads(out.read_text())
    assert [row["concurrency"] for row in result["levels"]] == [1, 2]
    for row in result["levels"]:
        for side in ("unconstrained", "json_schema"):
            stats = row[side]
            assert stats["requests"] == stats["ok"] == 2 and not stats["errors"]
            assert stats["tok_s_median"] > 0 and 0 < stats["tokens_per_request"] <= 48
        assert row["json_schema"]["valid"] == row["json_schema"]["stopped"]
        assert row["ratio"] > 0
    assert result["config"]["max_tokens"] == 48 and result["table"] in proc.stdout
