"""Sliding-window attention: the per-step window view, and whole engines (chunked prefill,
prefix caching, a tiny KV pool that preempts) generating exactly transformers' greedy
tokens with prompts far longer than an 8-token window."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from family_helpers import hf_model  # noqa: E402

from roseinfer.llm import LLM  # noqa: E402
from roseinfer.model.attention_metadata import SeqSpec, build_attention_metadata  # noqa: E402
from roseinfer.model.sliding_window import sliding_window_view  # noqa: E402
from roseinfer.sampling_params import SamplingParams  # noqa: E402
from tests.engine.tiny_models import engine_from_hf  # noqa: E402
from tests.hf_reference import hf_greedy  # noqa: E402


def test_window_view_lists_exactly_the_window() -> None:
    bs = 4
    seqs = [SeqSpec(9, 1, [7, 3, 5]), SeqSpec(2, 1, [1]), SeqSpec(6, 5, [0, 2, 4])]
    meta = build_attention_metadata(seqs, bs, torch.device("cpu"))
    assert sliding_window_view(meta, 12) is None  # no position reaches 12: plain attention
    view = sliding_window_view(meta, 4)
    assert view is not None
    slots, rows, lens = view.kernel_tables()

    def slot(table: list[int], p: int) -> int:
        return table[p // bs] * bs + p % bs

    for t, (s, p) in enumerate([(0, 9), (1, 2)] + [(2, q) for q in range(6, 11)]):
        keys = list(range(max(0, p - 3), p + 1))
        assert int(rows[t]) == t and int(lens[t]) == len(keys)
        assert slots[t, :len(keys)].tolist() == [slot(seqs[s].block_table, k) for k in keys]
    decode = view.decode_mask()  # decodes see positions 6..9 and 0..2
    assert decode[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert decode[1].nonzero().flatten().tolist() == [0, 1, 2]
    mask = view.prefill_mask(0, meta.prefills[0])  # queries 6..10 over keys 0..10
    assert mask is not None
    assert [row.nonzero().flatten().tolist() for row in mask] == [
        [3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9], [7, 8, 9, 10]]


@pytest.mark.parametrize("case", ["mistral_window", "gemma2", "gemma3"])
def test_engine_greedy_matches_hf_past_the_window(case: str) -> None:
    hf = hf_model(case)
    engine = engine_from_hf(hf, block_size=4, max_num_batched_tokens=16, num_kv_blocks=12)
    llm = LLM.from_engine(engine)
    shared = list(range(10, 30))  # a 20-token prefix: prefix-cache hits span past the window
    prompts = [shared + [40 + i] * (i + 1) for i in range(4)] + [[50, 51, 52]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == want
    hits = engine.get_stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert again == want
    assert engine.get_stats().prefix_cache_hits > hits > 0
    assert engine.get_stats().num_preemptions > 0  # 12 blocks: requests were recomputed
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
