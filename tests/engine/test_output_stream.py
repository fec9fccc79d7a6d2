"""Engine outputs are deltas: what waits for a slow reader is linear in the output.

Every output of a running sequence carries only what is new (``delta_*``); the whole
text, ids and logprobs come once, when the sequence finished. A ``RequestStream`` whose
reader takes nothing merges the waiting outputs into one item per request.
"""

from __future__ import annotations

import asyncio

import torch

from roseinfer.config import EngineConfig
from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.engine import LLMEngine
from roseinfer.model.config import ModelConfig
from roseinfer.model.registry import create_model
from roseinfer.sampling_params import SamplingParams
from tests.engine.spec_helpers import CharTokenizer
from tests.engine.tiny_models import tiny_hf_llama

PROMPT = [5, 6, 7, 8, 9]


def char_engine() -> LLMEngine:
    hf = tiny_hf_llama()
    mcfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = create_model(mcfg, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    cfg = EngineConfig(num_threads=1, quantization="none", block_size=4, num_kv_blocks=512)
    return LLMEngine(cfg, model=model, model_config=mcfg,
                     tokenizer=CharTokenizer())  # type: ignore[arg-type]


def params(max_tokens: int, n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.8, seed=1,
                          ignore_eos=True, logprobs=1)


def queued_chars(engine: LLMEngine, max_tokens: int) -> tuple[int, int]:
    """Run one request to the end keeping every output (a reader that never reads):
    (characters held by all of them, characters of the final texts)."""
    engine.add_request("r", PROMPT, params(max_tokens))
    kept = []
    for _ in range(10 * max_tokens):
        kept += engine.step()
        if not engine.has_unfinished_requests():
            break
    final = kept[-1]
    assert final.finished
    for c in final.outputs:  # the deltas, joined, are the whole sequence
        assert "".join(o.outputs[c.index].delta_text for o in kept) == c.text
        assert [t for o in kept for t in o.outputs[c.index].delta_token_ids] == c.token_ids
        assert [e for o in kept for e in o.outputs[c.index].delta_logprobs] == c.logprobs
        assert len(c.token_ids) == max_tokens
    for out in kept[:-1]:  # nothing cumulative while running
        for c in out.outputs:
            assert c.finish_reason is not None or (c.text == "" and c.token_ids == []
                                                   and c.logprobs == [])
    # a finished sequence's text is one string, shared by the outputs after it
    texts = {id(c.text): len(c.text) for o in kept for c in o.outputs}
    held = sum(texts.values()) + sum(len(c.delta_text) for o in kept for c in o.outputs)
    return held, sum(len(c.text) for c in final.outputs)


def test_queued_outputs_are_linear_in_the_output():
    engine = char_engine()
    short_held, short_text = queued_chars(engine, 40)
    long_held, long_text = queued_chars(engine, 160)
    assert long_text > 3 * short_text > 0
    # each character once as a delta and once in the final text: linear (outputs with
    # the text so far would hold ~L^2/2: 4x the output, ~16x held)
    assert short_held == 2 * short_text and long_held == 2 * long_text


def test_unread_stream_merges_outputs_per_request():
    async def run() -> None:
        ae = AsyncEngine(char_engine(), max_unread_outputs=None)  # never held
        ae.start()
        try:
            stream = ae.add_request("r", PROMPT, params(120, n=3))
            for _ in range(500):  # let the engine finish while nobody reads
                if ae.stats().generation_tokens_total >= 360 and stream.pending_items:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert stream.pending_items == 1  # one merged item, not one per step
            pending = stream.pending_chars
            outs = [out async for out in stream]
            assert len(outs) == 1
            final = outs[0]
            assert final.finished and pending == sum(len(c.delta_text) for c in final.outputs)
            for c in final.outputs:  # the merged delta is the whole sequence
                assert c.delta_text == c.text and len(c.token_ids) == 120
                assert c.delta_token_ids == c.token_ids and c.delta_logprobs == c.logprobs
            assert stream.pending_items == 0
        finally:
            ae.shutdown()

    asyncio.run(run())
