"""The persistent prefix cache over HTTP (tiny model, in-process server): usage reports
``prompt_tokens_details.cached_tokens`` for memory hits and, after a restart on the same
``kv_cache_dir``, for blocks loaded from disk (same tokens); /metrics counts them."""

from __future__ import annotations

import random
from pathlib import Path

import openai

from tests.server.helpers import metric, scrape, tiny_server

PROMPT = [random.Random(4).randrange(3, 250) for _ in range(61)]
CACHED = (len(PROMPT) - 1) // 4 * 4  # block size 4: all full blocks but the last token's


def complete(url: str, stream: bool = False) -> tuple[list[str], int]:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0)
    if not stream:
        r = c.completions.create(**kw)
        return [r.choices[0].text], r.usage.prompt_tokens_details.cached_tokens
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    return ["".join(ch.choices[0].text for ch in chunks if ch.choices)], (
        usage.prompt_tokens_details.cached_tokens)


def test_cached_tokens_from_memory_then_from_disk(tmp_path: Path) -> None:
    with tiny_server(kv_cache_dir=str(tmp_path)) as s:
        text, cached = complete(s.url)
        assert cached == 0
        assert complete(s.url) == (text, CACHED)  # from memory
        s.async_engine.shutdown()  # writes the blocks
        assert metric(scrape(s.url), "roseinfer:kv_disk_cache_hits_total") == 0
    with tiny_server(kv_cache_dir=str(tmp_path)) as s:  # a restart
        assert complete(s.url, stream=True) == (text, CACHED)  # from disk
        samples = scrape(s.url)
        assert metric(samples, "roseinfer:kv_disk_cache_hits_total") == CACHED
        assert metric(samples, "roseinfer:kv_disk_cache_read_bytes_total") > 0
        assert metric(samples, "roseinfer:prefix_cache_hits_total") == CACHED
        s.async_engine.shutdown()
