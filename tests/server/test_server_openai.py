"""The default model behind a real `roseinfer serve` process, through the official
`openai` SDK (sync and async) and raw HTTP: texts equal the offline engine's,
streams equal non-streams, usage is right, 32 concurrent streams are unaffected by
each other, a disconnect frees its blocks, and /generate, /tokenize and /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from roseinfer.sampling_params import SamplingParams
from tests.server.helpers import MODEL_NAME, metric, scrape, wait_until

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def aclient(server) -> openai.AsyncOpenAI:  # noqa: ANN001
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_served_names(server) -> None:
    ids = [m.id for m in client(server).models.list().data]
    assert ids == [MODEL_NAME, "other-alias"]


def test_chat_equals_offline_stream_and_usage(server, offline_llm) -> None:
    ref = offline_llm.chat(CHAT, SamplingParams(**GREEDY))[0]
    c = client(server)
    r = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY)
    assert r.object == "chat.completion" and r.model == MODEL_NAME
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ("length" if ref.outputs[0].finish_reason == "length"
                                          else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ref.prompt_token_ids), len(ref.outputs[0].token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(c.chat.completions.create(model="other-alias", messages=CHAT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == r.choices[0].message.content
    assert body[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (
        r.usage.prompt_tokens, r.usage.completion_tokens)
    # The same prompt again: every full block but the last token's is a prefix-cache hit.
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


@pytest.mark.parametrize("extra", [{}, {"stop": [" and"], "max_tokens": 24}],
                         ids=["plain", "stop-string"])
def test_completions_async_stream_equals_non_stream_and_offline(server, offline_llm,
                                                                extra) -> None:
    params = {**GREEDY, **extra}
    ref = offline_llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0]

    async def run() -> tuple:
        c = aclient(server)
        full = await c.completions.create(model=MODEL_NAME, prompt=PROMPT, **params)
        stream = await c.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                            **params)
        parts = [ch async for ch in stream]
        await c.close()
        return full, parts

    full, parts = asyncio.run(run())
    assert full.choices[0].text == ref.text
    assert "".join(p.choices[0].text for p in parts) == ref.text
    assert parts[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage.completion_tokens == len(ref.token_ids)


def test_completions_batch_n_echo_logprobs_and_token_ids(server) -> None:
    c = client(server)
    prompts = ["The capital of France is", "def add(a, b):"]
    r = c.completions.create(model=MODEL_NAME, prompt=prompts, n=2, echo=True, logprobs=2,
                             temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    by_index = {ch.index: ch for ch in r.choices}
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["tokens"]
           for p in prompts]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    assert r.usage.completion_tokens == 4 * 6
    for i, prompt in enumerate(prompts):
        a, b = by_index[2 * i], by_index[2 * i + 1]
        assert a.text == b.text and a.text.startswith(prompt)
        lp = a.logprobs
        assert len(lp.tokens) == len(ids[i]) + 6 == len(lp.token_logprobs) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset)
        assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    # Token ids as the prompt give the same completion as the text.
    by_ids = c.completions.create(model=MODEL_NAME, prompt=ids[0], temperature=0, max_tokens=6,
                                  extra_body={"ignore_eos": True})
    assert prompts[0] + by_ids.choices[0].text == by_index[0].text


def test_chat_logprobs_and_raw_sse_framing(server) -> None:
    payload = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "temperature": 0,
               "logprobs": True, "top_logprobs": 3, "stream": True}
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=payload, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in chunks[0]
    content = [ch["choices"][0]["logprobs"]["content"][0] for ch in chunks[1:-1]]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}


def test_32_concurrent_streams_equal_alone(server, offline_llm) -> None:
    subjects = ["cats", "the ocean", "Paris", "music", "winter", "robots", "coffee", "trees",
                "the moon", "rivers", "bread", "chess", "rain", "birds", "Python", "history"]
    prompts = [f"{i + 1}. A short fact about {s}:" for i, s in enumerate(subjects)]
    prompts += [f"Q: Why do people like {s}?\nA:" for s in subjects]
    params = {"temperature": 0.0, "max_tokens": 8}
    alone = [offline_llm.generate(p, SamplingParams(**params))[0].outputs[0].text
             for p in prompts]

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                            **params)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run() -> list[str]:
        c = aclient(server)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    assert asyncio.run(run()) == alone


def test_disconnect_mid_stream_frees_blocks_within_a_second(server) -> None:
    before = metric(scrape(server.url), "roseinfer:request_success_total", finished_reason="abort")
    payload = {"model": MODEL_NAME, "prompt": PROMPT * 8, "max_tokens": 400, "temperature": 0,
               "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=payload, timeout=60) as s:
        data = (ln for ln in s.iter_lines() if ln.startswith("data: "))
        for _ in range(3):
            next(data)
        busy = scrape(server.url)
        assert metric(busy, "roseinfer:num_requests_running") == 1
        assert metric(busy, "roseinfer:kv_cache_free_blocks") < metric(
            busy, "roseinfer:kv_cache_total_blocks")

    def freed() -> bool:
        m = scrape(server.url)
        return (metric(m, "roseinfer:kv_cache_free_blocks")
                == metric(m, "roseinfer:kv_cache_total_blocks")
                and metric(m, "roseinfer:num_requests_running") == 0
                and metric(m, "roseinfer:request_success_total", finished_reason="abort")
                == before + 1)

    assert wait_until(freed, 1.0, interval=0.05)


def test_generate_endpoint(server, offline_llm) -> None:
    ref = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0]
    body = {"prompt": PROMPT, "max_new_tokens": 10, "do_sample": False}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json() == {"text": ref.outputs[0].text}
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      timeout=60) as s:
        assert s.headers["content-type"].startswith("text/plain")
        parts = list(s.iter_text())
    assert len([p for p in parts if p]) > 1 and "".join(parts) == ref.outputs[0].text


def test_tokenize_detokenize(server, offline_llm) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == offline_llm.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == offline_llm.render_chat(CHAT)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}


def test_metrics_prefix_cache_and_stats_log(server) -> None:
    c = client(server)
    before = scrape(server.url)
    for _ in range(2):  # the second request reuses the first one's full prompt blocks
        c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0)
    after = scrape(server.url)
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "time_to_first_token_seconds_count",
             "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"]
    for name in names:
        metric(after, f"roseinfer:{name}")
    assert metric(after, "roseinfer:request_success_total", finished_reason="length") >= 2
    assert metric(after, "roseinfer:prefix_cache_hits_total") > metric(
        before, "roseinfer:prefix_cache_hits_total")
    assert metric(after, "roseinfer:e2e_request_latency_seconds_count") == metric(
        before, "roseinfer:e2e_request_latency_seconds_count") + 2
    # Busy for over a second (the server logs stats every 1 s while busy).
    c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0,
                         extra_body={"ignore_eos": True})
    assert wait_until(lambda: "prefix cache hit rate" in server.log.read_text(), 5)
