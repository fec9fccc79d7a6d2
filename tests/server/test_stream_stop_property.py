"""Property: a streamed completion is exactly its non-streamed twin, and both follow the
stop-string rule (vLLM semantics), on the default model through the session server.

References are greedy completions (fp16, so batch independent) whose texts hold
multi-byte UTF-8 characters split across tokens (CJK, emoji) and accented words. For
hypothesis-drawn stop strings (substrings of a reference, ones across token
boundaries or around a multi-byte character, random strings), with or without
``include_stop_str_in_output`` and ``min_tokens``:

* the concatenated stream deltas equal the non-stream text, with the same
  finish_reason;
* both equal the reference truncated at the first stop occurrence that completes in
  the text visible after token number j > min_tokens (cut before it, or after it with
  include_stop_str_in_output) with finish_reason "stop" -- also when j is the last
  allowed token; with no such occurrence, the whole reference and "length".

"The text visible after token j" is what an incremental detokenizer can show: the
decode of the longest prefix of the first j tokens that does not end inside a
character (the whole text at the last token, which flushes).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from roseinfer.sampling_params import SamplingParams
from tests.server.helpers import MODEL_NAME, ServerProcess
from tests.server.reliability_helpers import Outcome, request

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MAX_TOKENS = 24
REPLACEMENT = "\ufffd"
# (endpoint, prompt): greedy outputs with CJK / emoji split over tokens and accents.
CASES = (
    ("completions", "Chinese: 你好世界。 English: hello world. Chinese: 我爱"),
    ("completions", "Emoji: 🍕 pizza, 🍔 burger, 🍟"),
    ("completions", "Crème brûlée, façade, naïve, déjà vu, résumé,"),
    ("chat", "How do you say 'thank you' in Japanese?"),
)
EXTRA_ALPHABET = "abc ,.\"'\n界你🍕🍟éà"


@dataclass(frozen=True)
class Reference:
    endpoint: str
    prompt: str
    token_ids: tuple[int, ...]
    text: str
    visible_end: tuple[int, ...]  # [j - 1]: characters visible after token j

    def token_of(self, end: int) -> int:
        """The token (1-based) after which text[:end] is first visible."""
        return next(j for j, v in enumerate(self.visible_end, 1) if v >= end)

    @property
    def boundaries(self) -> list[int]:
        return sorted({v for v in self.visible_end if 0 < v < len(self.text)})

    @property
    def multibyte_positions(self) -> list[int]:
        return [i for i, ch in enumerate(self.text) if ord(ch) > 127 and ch != REPLACEMENT]


def visible_ends(tokenizer: Any, ids: list[int], text: str) -> tuple[int, ...]:
    ends, shown = [], 0
    for j in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:j])
        if j == len(ids):
            decoded = text  # the last token flushes whatever is left
        if not decoded.endswith(REPLACEMENT):
            assert text.startswith(decoded), (decoded, text)
            shown = len(decoded)
        ends.append(shown)
    return tuple(ends)


def expected(ref: Reference, stops: list[str], include: bool,
             min_tokens: int) -> list[tuple[str, str]]:
    """The allowed (text, finish_reason) results (several only when two stop strings
    complete in the same token: vLLM takes them in list order, an earliest-ending
    match is equally valid)."""
    found = []  # (token, end, start, list index) of each stop's first counted occurrence
    for k, stop in enumerate(stops):
        start = ref.text.find(stop)
        while start >= 0:
            end = start + len(stop)
            token = ref.token_of(end)
            if token > min_tokens:
                found.append((token, end, start, k))
                break
            start = ref.text.find(stop, start + 1)
    if not found:
        return [(ref.text, "length")]
    first_token = min(f[0] for f in found)
    same = [f for f in found if f[0] == first_token]
    picks = {min(same, key=lambda f: f[3]), min(same, key=lambda f: (f[1], f[2]))}
    return sorted({(ref.text[:end] if include else ref.text[:start], "stop")
                   for _, end, start, _ in picks})


def body(ref: Reference, stream: bool, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True, "stream": stream, **extra}
    if ref.endpoint == "chat":
        b["messages"] = [{"role": "user", "content": ref.prompt}]
    else:
        b["prompt"] = ref.prompt
    return b


def path_of(ref: Reference) -> str:
    return "/v1/chat/completions" if ref.endpoint == "chat" else "/v1/completions"


def stream_result(out: Outcome) -> tuple[str, str | None]:
    assert out.status == 200 and not out.error, (out.status, out.error, out.body[:300])
    assert out.events and out.events[-1] == b"[DONE]", out.events[-3:]
    text, finish = [], None
    for data in out.events[:-1]:
        event = json.loads(data)
        assert "error" not in event, event
        for choice in event["choices"]:
            assert finish is None, "a chunk after the finish_reason"
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def json_result(out: Outcome) -> tuple[str, str | None]:
    assert out.status == 200 and not out.error, (out.status, out.error, out.body[:300])
    (choice,) = json.loads(out.body)["choices"]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, choice["finish_reason"]


async def both(url: str, ref: Reference, **extra: Any) -> tuple[Outcome, Outcome]:
    s, j = await asyncio.gather(
        request(url, path_of(ref), body(ref, True, **extra), timeout=120.0),
        request(url, path_of(ref), body(ref, False, **extra), timeout=120.0))
    return s, j


@pytest.fixture(scope="module")
def references(server: ServerProcess, offline_llm: Any) -> list[Reference]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tok = offline_llm.tokenizer
    refs = []
    for endpoint, prompt in CASES:
        if endpoint == "chat":
            out = offline_llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
        else:
            out = offline_llm.generate(prompt, params)[0].outputs[0]
        ids = list(out.token_ids)
        assert len(ids) == MAX_TOKENS and not set(ids) & set(tok.eos_token_ids), out
        refs.append(Reference(endpoint, prompt, tuple(ids), out.text,
                              visible_ends(tok, ids, out.text)))
    # The server agrees with the offline engine before any stop is involved.
    for ref in refs:
        s, j = asyncio.run(both(server.url, ref))
        assert stream_result(s) == json_result(j) == (ref.text, "length"), ref
    assert any(REPLACEMENT in tok.decode(r.token_ids[:k]) for r in refs
               for k in range(1, MAX_TOKENS)), "no character is split across tokens"
    return refs


@st.composite
def stop_string(draw: Any, ref: Reference) -> str:
    text = ref.text
    kind = draw(st.sampled_from(["substring", "boundary", "multibyte", "random"]))
    if kind == "substring":
        start = draw(st.integers(0, len(text) - 1))
        out = text[start:start + draw(st.integers(1, 8))]
    elif kind == "boundary" and ref.boundaries:
        b = draw(st.sampled_from(ref.boundaries))
        out = text[max(0, b - draw(st.integers(1, 4))):b + draw(st.integers(1, 4))]
    elif kind == "multibyte" and ref.multibyte_positions:
        c = draw(st.sampled_from(ref.multibyte_positions))
        out = text[max(0, c - draw(st.integers(0, 3))):c + 1 + draw(st.integers(0, 3))]
    else:
        alphabet = sorted(set(text.replace(REPLACEMENT, "")) | set(EXTRA_ALPHABET))
        out = draw(st.text(alphabet=alphabet, min_size=1, max_size=4))
    out = out.replace(REPLACEMENT, "")
    hypothesis.assume(out)
    return out


@st.composite
def scenarios(draw: Any, refs: list[Reference]) -> tuple[Reference, dict[str, Any]]:
    ref = draw(st.sampled_from(refs))
    stops = draw(st.lists(stop_string(ref), min_size=1, max_size=3, unique=True))
    extra: dict[str, Any] = {"stop": stops}
    if draw(st.booleans()):
        extra["include_stop_str_in_output"] = True
    min_tokens = draw(st.sampled_from([0, 0, 0, 1, 3, 8, 16, MAX_TOKENS]))
    if min_tokens:
        extra["min_tokens"] = min_tokens
    return ref, extra


def check_case(url: str, ref: Reference, extra: dict[str, Any]) -> tuple[str, str | None]:
    s, j = asyncio.run(both(url, ref, **extra))
    streamed, non_streamed = stream_result(s), json_result(j)
    allowed = expected(ref, extra["stop"], bool(extra.get("include_stop_str_in_output")),
                       extra.get("min_tokens", 0))
    assert streamed == non_streamed, (streamed, non_streamed, ref.text)
    assert non_streamed in allowed, (non_streamed, allowed, ref.text)
    return non_streamed


def test_stop_on_the_last_allowed_token_and_min_tokens_edges(
        server: ServerProcess, references: list[Reference]) -> None:
    """A stop string completed by token max_tokens finishes "stop" (min_tokens =
    max_tokens - 1 leaves only that token to count); min_tokens = max_tokens lets
    no occurrence count."""
    last_token_stops = 0
    for ref in references:
        last, before = ref.visible_end[-1], ref.visible_end[-2]
        tail = ref.text[max(0, before - 2):last].replace(REPLACEMENT, "")
        if last > before and tail:
            for include in (False, True):
                extra = {"stop": [tail], "min_tokens": MAX_TOKENS - 1,
                         "include_stop_str_in_output": include}
                last_token_stops += check_case(server.url, ref, extra)[1] == "stop"
        first = ref.text[:3].replace(REPLACEMENT, "")
        text, finish = check_case(server.url, ref, {"stop": [first], "min_tokens": MAX_TOKENS})
        assert (text, finish) == (ref.text, "length")
    assert last_token_stops >= 2, "no reference ends with text a stop string can catch"


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck),
                     phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
@hypothesis.given(data=st.data())
def test_stream_equals_non_stream_and_follows_stop_rule(server: ServerProcess,
                                                        references: list[Reference],
                                                        data: Any) -> None:
    ref, extra = data.draw(scenarios(references), label="scenario")
    _, finish = check_case(server.url, ref, extra)
    hypothesis.event(f"finish_reason={finish}")
    include = bool(extra.get("include_stop_str_in_output"))
    if extra.get("min_tokens") and expected(ref, extra["stop"], include, 0) != expected(
            ref, extra["stop"], include, extra["min_tokens"]):
        hypothesis.event("min_tokens changed the result")
