"""Stop semantics as vLLM's, end to end through the engine (tiny random Llama with a
one-letter-per-token tokenizer): stop ids and EOS leave their text out unless
include_stop_str_in_output; a stop string ends with "stop" even on the last allowed
token; min_tokens holds stop strings back too."""

from __future__ import annotations

import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.llm import LLM
from roseinfer.model.config import ModelConfig
from roseinfer.model.registry import create_model
from roseinfer.sampling_params import SamplingParams
from tests.engine.tiny_models import tiny_hf_llama

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PROMPT = [5, 9, 14, 3, 22, 7]


class LetterTokenizer:
    """Token t decodes to one letter; the EOS ids decode to '' when special tokens
    are skipped."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if skip_special_tokens and t in self.eos_token_ids
                       else LETTERS[t % 26] for t in ids)


def engine_with(tokenizer: LetterTokenizer) -> LLMEngine:
    hf = tiny_hf_llama()
    mcfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(mcfg, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    cfg = EngineConfig(num_threads=1, quantization="none", block_size=4)
    return LLMEngine(cfg, model=model, model_config=mcfg, tokenizer=tokenizer)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return engine_with(LetterTokenizer((2,)))


def run(engine: LLMEngine, **kw):  # noqa: ANN201
    params = SamplingParams(temperature=0.0, **{"max_tokens": 12, "ignore_eos": True, **kw})
    return LLM.from_engine(engine).generate([PROMPT], params)[0].outputs[0]


@pytest.fixture(scope="module")
def free_run(engine: LLMEngine) -> list[int]:
    return run(engine).token_ids


def first_new(tokens: list[int], start: int = 1) -> int:
    """Index of the first token from ``start`` on whose letter did not occur before."""
    for k in range(start, len(tokens)):
        if LETTERS[tokens[k] % 26] not in {LETTERS[t % 26] for t in tokens[:k]}:
            return k
    pytest.skip("the tiny model repeats itself too much for this case")


def text(tokens: list[int]) -> str:
    return "".join(LETTERS[t % 26] for t in tokens)


def test_stop_token_id_text_left_out_unless_asked(engine, free_run) -> None:  # noqa: ANN001
    k = first_new(free_run)
    stop_id = free_run[k]
    out = run(engine, stop_token_ids=[stop_id])
    assert out.token_ids == free_run[:k + 1]
    assert (out.text, out.finish_reason, out.stop_reason) == (text(free_run[:k]), "stop", stop_id)
    kept = run(engine, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert (kept.text, kept.finish_reason) == (text(free_run[:k + 1]), "stop")


def test_eos_text_left_out_even_when_special_tokens_are_kept(free_run) -> None:  # noqa: ANN001
    k = first_new(free_run)
    eos_engine = engine_with(LetterTokenizer((free_run[k],)))
    out = run(eos_engine, ignore_eos=False, skip_special_tokens=False)
    assert out.token_ids == free_run[:k + 1]
    assert (out.text, out.finish_reason, out.stop_reason) == (text(free_run[:k]), "stop", None)
    kept = run(eos_engine, ignore_eos=False, skip_special_tokens=False,
               include_stop_str_in_output=True)
    assert kept.text == text(free_run[:k + 1])


def test_stop_string_on_the_last_allowed_token_is_stop(engine, free_run) -> None:  # noqa: ANN001
    k = first_new(free_run)
    stop = text(free_run[k:k + 1])
    out = run(engine, max_tokens=k + 1, stop=[stop])
    assert (out.text, out.finish_reason, out.stop_reason) == (text(free_run[:k]), "stop", stop)
    assert out.token_ids == free_run[:k + 1]


def test_min_tokens_holds_stop_strings_back(engine, free_run) -> None:  # noqa: ANN001
    stop = text(free_run[:1])
    later = next((j for j in range(2, len(free_run)) if text(free_run[j:j + 1]) == stop), None)
    out = run(engine, stop=[stop], min_tokens=2)
    if later is None:
        assert (out.text, out.finish_reason) == (text(free_run), "length")
    else:
        assert (out.text, out.finish_reason) == (text(free_run[:later]), "stop")
    plain = run(engine, stop=[stop])
    assert (plain.text, plain.finish_reason) == ("", "stop")


def test_stream_deltas_add_up_with_stops(engine, free_run) -> None:  # noqa: ANN001
    k = first_new(free_run)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            stop=[text(free_run[k:k + 2])], stop_token_ids=[free_run[-1]])
    streamed = "".join(LLM.from_engine(engine).stream(PROMPT, params))
    final = LLM.from_engine(engine).generate([PROMPT], params)[0].outputs[0]
    assert streamed == final.text
