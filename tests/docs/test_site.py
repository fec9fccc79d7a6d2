"""The docs site builds in strict mode (no broken link or anchor, every page in the nav),
and the generated configuration reference is the one checked in."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from roseinfer.cli_args import add_engine_args
from roseinfer.config import EngineConfig
from scripts.gen_config_docs import OUT, render

ROOT = Path(__file__).resolve().parent.parent.parent


def test_mkdocs_strict_build(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-6000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_configuration_reference_is_up_to_date() -> None:
    assert OUT.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date: run `make config-docs`")


def test_configuration_reference_lists_every_option() -> None:
    """What the page is generated from: every EngineConfig field and every engine flag
    shows up (a generator that dropped rows would still match its own output)."""
    page = OUT.read_text(encoding="utf-8")
    for f in dataclasses.fields(EngineConfig):
        assert f"| `{f.name}` |" in page, f.name
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in page, flag
