"""Startup cost: the CLI and the offline API import only what the command needs.

Each check runs in a fresh interpreter and reads ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Heavy packages (import time on the 2-core machine): transformers ~1-2 s, the server
# stack (fastapi, uvicorn, starlette, pydantic) ~0.5 s, openai, llguidance, jinja2.
SERVER_AND_HF = ("transformers", "fastapi", "uvicorn", "starlette", "openai", "llguidance")


def _imported(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("code", [
    "import roseinfer",
    "import roseinfer.cli",
    "import roseinfer.cli\nroseinfer.cli.build_parser().parse_args(['generate', '--prompt', 'hi'])",
])
def test_cli_imports_nothing_heavy(code: str) -> None:
    found = _imported(code) & {*SERVER_AND_HF, "torch", "jinja2", "pydantic", "numpy"}
    assert not found, f"{code!r} imported {sorted(found)}"


def test_offline_api_does_not_import_transformers_or_the_server() -> None:
    found = _imported("from roseinfer import LLM, SamplingParams\nLLM, SamplingParams") & set(
        SERVER_AND_HF)
    assert not found, f"roseinfer.llm imported {sorted(found)}"
