"""Work before admission, through a real uvicorn (tiny model, real tokenizer): a prompt
longer than 16 characters per token of max_model_len is a 400 naming its field before
anything tokenizes or templates it, on every route that takes text; and at most
``PromptGate.slots`` prompts are tokenized at once, off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from roseinfer.server.prompt_gate import MAX_PROMPT_CHARS_PER_TOKEN, default_slots
from tests.server.helpers import TinyServer
from tests.server.tokenizer_server import MODEL_NAME


class Spy:
    """Counts calls into the tokenizer (encode, chat template) and how many overlap."""

    def __init__(self, tok: Any, delay_s: float = 0.0) -> None:
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        self.delay_s = delay_s
        tok.encode = self.wrap(tok.encode)
        tok.apply_chat_template = self.wrap(tok.apply_chat_template)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.calls += 1
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            try:
                time.sleep(self.delay_s)
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.active -= 1

        return spied



@pytest.fixture
def spy(ts: TinyServer) -> Iterator[Spy]:
    tok = ts.engine.tokenizer
    saved = tok.__dict__.copy()
    try:
        yield Spy(tok)
    finally:
        tok.__dict__.clear()
        tok.__dict__.update(saved)


def limit(ts: TinyServer) -> int:
    return MAX_PROMPT_CHARS_PER_TOKEN * ts.engine.max_model_len


def cases(ts: TinyServer) -> list[tuple[str, dict[str, Any], str]]:
    big = "a" * (limit(ts) + 1)
    half = "b" * (limit(ts) // 2 + 1)  # two of them: over the limit together
    chat = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    return [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": big, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": ["hi", big], "max_tokens": 1},
         "prompt"),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": chat, "max_tokens": 1},
         "messages"),
        ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": half}] * 2}]}, "messages"),
        ("/generate", {"prompt": big, "max_new_tokens": 1}, "prompt"),
        ("/tokenize", {"model": MODEL_NAME, "prompt": big}, "prompt"),
        ("/tokenize", {"model": MODEL_NAME, "messages": chat}, "messages"),
    ]


def test_oversized_prompts_are_refused_before_tokenizing(ts: TinyServer, spy: Spy) -> None:
    for path, body, param in cases(ts):
        start = time.monotonic()
        r = httpx.post(ts.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "characters" in err["message"], (path, err)
        assert time.monotonic() - start < 5
    assert spy.calls == 0, "an oversized prompt reached the tokenizer"
    r = httpx.post(ts.url + "/detokenize", timeout=60,
                   json={"model": MODEL_NAME, "tokens": [17] * (limit(ts) + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(ts.url + "/detokenize", json={"model": MODEL_NAME, "tokens": [17] * 3})
    assert r.status_code == 200 and r.json()["prompt"]
    bm = ts.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompts_under_the_bound_are_tokenized_and_checked_in_tokens(ts: TinyServer,
                                                                      spy: Spy) -> None:
    text = "word " * (limit(ts) // 5)  # within the character bound, over the context
    r = httpx.post(ts.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": text, "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = httpx.post(ts.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello there"})
    assert r.status_code == 200 and r.json()["count"] > 0
    assert spy.calls == 2


def test_tokenization_is_bounded_and_off_the_event_loop(ts: TinyServer, spy: Spy) -> None:
    spy.delay_s = 1.0  # 6 prompts over at most 4 slots: at least 2 s in all

    async def burst() -> tuple[list[int], float]:
        async with httpx.AsyncClient(base_url=ts.url, timeout=60) as c:
            posts = [asyncio.create_task(c.post("/tokenize", json={
                "model": MODEL_NAME, "prompt": f"text number {i}"})) for i in range(6)]
            await asyncio.sleep(0.2)
            health = await c.get("/health")  # the loop answers while prompts wait
            assert health.status_code == 200
            pending = sum(not p.done() for p in posts)
            return [(await p).status_code for p in posts], pending

    codes, pending = asyncio.run(burst())
    assert codes == [200] * 6
    assert spy.max_active <= default_slots() < 6
    assert pending > 0, "/health waited for the tokenizer"

