"""The router's view of a prompt: chain hashes of its first full KV blocks.

The ingress turns each request body into the token ids the engine will see, with
roseinfer's own request models, tokenizer and chat template (the same calls as
``routes_openai``: a chat is rendered with its tools, a text prompt is encoded with
special tokens), and hashes the first ``max_blocks`` full blocks of ``block_size``
tokens with the block manager's ``chain_hash``. Two prompts share their first k
hashes exactly when they share their first k blocks, which is what a replica's
prefix cache can reuse; so the router can send a request where its longest
prefix went before.

A body the replica would reject (bad JSON, unknown fields, a prompt that does not
render) gets no hashes: the router then balances load only, and the replica answers
the 400 as usual.

The ingress does this work before any replica bounds the prompt, so it is bounded
here: a text prompt is cut to ``MAX_CHARS_PER_TOKEN`` characters per hashed token
before it is encoded (only its first ``max_blocks`` blocks are hashed; a cut can only
change the tokens of the last characters kept), and a chat whose text is longer than
that gets no hashes at all (its template must see every message).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from roseinfer.engine.block_manager import chain_hash
from roseinfer.tokenizer import Tokenizer

DEFAULT_MAX_BLOCKS = 64  # 1024 tokens with 16-token blocks: enough to tell prompts apart
MAX_CHARS_PER_TOKEN = 32  # text looked at per hashed token (BPE tokens are rarely longer)
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({"/v1/completions", "/generate"})


def block_hashes(ids: Sequence[int], block_size: int, max_blocks: int) -> tuple[int, ...]:
    """Chain hashes of the first ``max_blocks`` full blocks of ``ids``."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(min(len(ids) // block_size, max_blocks)):
        parent = chain_hash(parent, tuple(ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return tuple(hashes)


class PrefixKeys:
    """Request body -> prefix block hashes (blocking: call it off the event loop)."""

    def __init__(self, tokenizer: Tokenizer, block_size: int = 16,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    @property
    def max_chars(self) -> int:
        """Characters of prompt text this router tokenizes at most."""
        return self.max_blocks * self.block_size * MAX_CHARS_PER_TOKEN

    def for_body(self, path: str, body: bytes) -> tuple[int, ...]:
        if path != CHAT_PATH and path not in COMPLETION_PATHS:
            return ()
        try:
            payload = json.loads(body)
            ids = self._chat_ids(payload) if path == CHAT_PATH else self._prompt_ids(payload)
        except Exception:  # noqa: BLE001 - the replica answers the error, not the router
            return ()
        return block_hashes(ids, self.block_size, self.max_blocks)

    def _chat_ids(self, payload: Any) -> list[int]:
        from roseinfer.server.protocol import ChatCompletionRequest
        from roseinfer.server.tools import message_dicts, plan_tools
        from roseinfer.tool_calls import chat_prompt_ids

        if not isinstance(payload, dict) or _text_chars(payload.get("messages")) \
                + _text_chars(payload.get("tools")) > self.max_chars:
            return []  # too long to render here: load balancing only
        body = ChatCompletionRequest.model_validate(payload)
        plan = plan_tools(body)
        return chat_prompt_ids(self.tokenizer, message_dicts(body.messages),
                               plan.tools if plan.active else None, True)

    def _prompt_ids(self, payload: Any) -> list[int]:
        """The first prompt of a completion (a batch is routed by its first prompt)."""
        prompt = payload.get("prompt") if isinstance(payload, dict) else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt[:self.max_chars])
            if len(prompt) > self.max_chars:  # the cut may have split the last tokens
                ids = ids[:len(ids) - len(ids) % self.block_size - self.block_size]
            return ids
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []


def _text_chars(value: Any) -> int:
    """Characters of all strings inside a JSON value (message contents, tool schemas)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) + len(k) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0
