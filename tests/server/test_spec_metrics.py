"""Speculative decoding behind a real uvicorn server (tiny random engine): the vLLM
counters (drafts, drafted and accepted tokens, accepted per position) and the acceptance
rate are in /metrics, and streamed completions (several tokens per delta) add up to the
non-streamed one, logprobs included."""

from __future__ import annotations

import json

import httpx

from tests.server.helpers import metric, scrape, tiny_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "adaptive": False}
PROMPT = [5, 6, 7, 8, 9, 10, 11] * 3


def body(**kw: object) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, **kw}


def test_metrics_and_stream() -> None:
    with tiny_server(speculative_config=SPEC) as ts:
        before = scrape(ts.url)
        assert metric(before, "roseinfer:spec_decode_num_drafts_total") == 0
        full = httpx.post(f"{ts.url}/v1/completions", json=body(), timeout=60).json()
        choice = full["choices"][0]
        events = []
        with httpx.stream("POST", f"{ts.url}/v1/completions", json=body(stream=True),
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        after = scrape(ts.url)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed_lps = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed_lps == choice["logprobs"]["tokens"] and len(streamed_lps) == 40
    assert any(c["logprobs"] and len(c["logprobs"]["tokens"]) > 1 for c in chunks)
    drafts = metric(after, "roseinfer:spec_decode_num_drafts_total")
    drafted = metric(after, "roseinfer:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "roseinfer:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    first = metric(after, "roseinfer:spec_decode_num_accepted_tokens_per_pos_total",
                   position="0")
    assert 0 < first <= drafts
    rate = metric(after, "roseinfer:spec_decode_acceptance_rate")
    assert abs(rate - accepted / drafted) < 1e-9
    assert metric(after, "roseinfer:generation_tokens_total") == 80
