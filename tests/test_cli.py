"""The roseinfer CLI: generate (plain, streamed, chat) and argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from roseinfer.cli import build_parser, engine_config_from_args


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "roseinfer.cli", *args], capture_output=True,
                          text=True, timeout=240, check=False)


@pytest.mark.slow  # loads the default model in a subprocess
def test_generate_two_prompts_and_stream() -> None:
    res = run_cli("generate", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
                  "--max-tokens", "6", "--num-threads", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("--- [") == 2
    res = run_cli("generate", "--prompt", "Say hi", "--chat", "--stream", "--max-tokens", "6",
                  "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                  "--num-threads", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


def test_engine_options_parse() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--block-size", "8", "--num-kv-blocks", "100",
         "--max-num-seqs", "4", "--no-enable-prefix-caching", "--dtype", "bfloat16"])
    cfg = engine_config_from_args(args)
    assert (cfg.block_size, cfg.num_kv_blocks, cfg.max_num_seqs) == (8, 100, 4)
    assert not cfg.enable_prefix_caching and cfg.dtype == "bfloat16"


def test_bad_sampling_value_is_a_clear_error() -> None:
    res = run_cli("generate", "--prompt", "x", "--top-p", "0", "--num-threads", "1")
    assert res.returncode != 0
    assert "top_p" in res.stderr and "Traceback" not in res.stderr


def test_unknown_model_path() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate"])  # --prompt is required
    res = run_cli("generate", "--prompt", "x", "--model", "/nonexistent/model.gguf")
    assert res.returncode != 0
    assert "/nonexistent/model.gguf" in res.stderr
