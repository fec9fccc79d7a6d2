"""Engine logprobs -> OpenAI shapes (chat ``logprobs.content`` and legacy completions).

The engine gives, per token, ``{token_id: Logprob(logprob, rank, decoded_token)}``
holding the chosen token and the top-N alternatives (ranks 1..N).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from roseinfer.outputs import Logprob
from roseinfer.server.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

Entry = dict[int, Logprob]
Decode = Callable[[int], str]


def token_decoder(tokenizer: Any) -> Decode:
    """One token id's text with ``tokenizer`` (the id itself without one)."""
    if tokenizer is None:
        return str
    return lambda tid: tokenizer.decode([tid], skip_special_tokens=False)


def _text(token_id: int, lp: Logprob | None, decode: Decode) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


def _top(entry: Entry, n: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], top_n: int,
                  decode: Decode) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tid)
        text = _text(tid, chosen, decode)
        tops = [TopLogprob(token=(t := _text(i, lp, decode)), logprob=lp.logprob,
                           bytes=list(t.encode("utf-8")))
                for i, lp in _top(entry, top_n)]
        content.append(TokenLogprob(
            token=text, logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=list(text.encode("utf-8")), top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Entry | None], top_n: int,
                        decode: Decode, offset: int = 0,
                        into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Append tokens to ``into`` (or a new object); ``offset`` is the text offset of the
    first token. An entry of None (the first prompt token) has no logprob."""
    out = into or CompletionLogprobs()
    for tid, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tid) if entry is not None else None
        text = _text(tid, chosen, decode)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(chosen.logprob if chosen is not None else None)
        tops = {_text(i, lp, decode): lp.logprob for i, lp in _top(entry, top_n)}
        if chosen is not None:
            tops.setdefault(text, chosen.logprob)
        out.top_logprobs.append(tops)
    return out
