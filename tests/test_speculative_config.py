"""SpeculativeConfig: vLLM's dict, validated (errors name the field), on EngineConfig,
the LLM constructor and the CLI flag; off by default."""

from __future__ import annotations

import pytest

from roseinfer.cli import build_parser, engine_config_from_args
from roseinfer.config import EngineConfig
from roseinfer.speculative_config import SpeculativeConfig


def test_off_by_default() -> None:
    assert EngineConfig().speculative_config is None


def test_vllm_dict() -> None:
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert cfg.speculative_config == SpeculativeConfig(5, "ngram", 4, 2)


def test_lookup_bounds_default_to_each_other() -> None:
    f = SpeculativeConfig.from_dict
    assert (f({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_min,
            f({"method": "ngram", "num_speculative_tokens": 3}).prompt_lookup_max) == (5, 5)
    one = f({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    other = f({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (other.prompt_lookup_min, other.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(("options", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_model": "x"}, "draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"}, "adaptive"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
])
def test_bad_values_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        EngineConfig(speculative_config=options)


def test_json_text_and_cli_flag() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    assert EngineConfig(speculative_config=text).speculative_config == SpeculativeConfig(
        4, "ngram", 3, 3)
    for command in (["generate", "--prompt", "x"], ["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, "--speculative-config", text])
        assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{nope")
