"""The replica choice without Ray: prefix affinity, its load guard, round-robin; block hashes."""

from __future__ import annotations

import json

import pytest

from roseinfer.engine.block_manager import chain_hash
from roseinfer.ray_serve.prefix_keys import PrefixKeys, block_hashes
from roseinfer.ray_serve.routing_policy import AffinityTable, RoutingPolicy


def test_block_hashes_chain_full_blocks_only() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids, 16, 64)
    assert len(hashes) == 2  # 40 tokens: two full blocks of 16
    assert hashes[0] == chain_hash(None, tuple(range(16)))
    assert hashes[1] == chain_hash(hashes[0], tuple(range(16, 32)))
    assert block_hashes(ids, 16, 1) == hashes[:1]
    assert block_hashes(ids[:15], 16, 64) == ()
    other = [99] + ids[1:]  # a different first token changes every hash after it
    assert not set(block_hashes(other, 16, 64)) & set(hashes)


def test_table_longest_match_prefers_the_deepest_live_owner() -> None:
    table = AffinityTable()
    table.record("a", [1, 2])
    table.record("b", [1, 2, 3])  # b took the longer prompt later: block 1, 2 now b's
    assert table.longest_match([1, 2, 3, 4], ["a", "b"]) == ("b", 3)
    assert table.longest_match([1, 2, 3], ["a"]) == (None, 0)  # b is not alive
    assert table.longest_match([7], ["a", "b"]) == (None, 0)
    assert (table.owned("a"), table.owned("b")) == (0, 3)
    table.forget("b")
    assert len(table) == 0 and table.owned("b") == 0


def test_table_is_bounded() -> None:
    table = AffinityTable(capacity=3)
    table.record("a", [1, 2, 3, 4, 5])
    assert len(table) == 3 and table.owned("a") == 3
    assert table.longest_match([1], ["a"]) == (None, 0)  # the oldest went first
    assert table.longest_match([3, 4, 5], ["a"]) == ("a", 3)


def test_prefix_routing_sticks_to_the_owner_and_spreads_new_prefixes() -> None:
    policy = RoutingPolicy("prefix", imbalance_threshold=2)
    idle = {"a": 0, "b": 0}
    first = policy.rank(["b", "a"], idle, [10, 11])[0]
    policy.routed(first, [10, 11])
    second = policy.rank(["a", "b"], idle, [20, 21])[0]  # a new prefix, loads equal
    policy.routed(second, [20, 21])
    assert {first, second} == {"a", "b"}  # tie broken by fewer remembered blocks
    for _ in range(3):
        assert policy.rank(["a", "b"], idle, [10, 11, 12])[0] == first
        assert policy.rank(["a", "b"], idle, [20, 99])[0] == second  # shares block 20


def test_prefix_routing_falls_back_to_the_least_loaded_when_the_owner_is_busy() -> None:
    policy = RoutingPolicy("prefix", imbalance_threshold=2)
    policy.routed("a", [1, 2])
    assert policy.rank(["a", "b"], {"a": 2, "b": 0}, [1, 2]) == ["a", "b"]  # within 2
    assert policy.rank(["a", "b"], {"a": 3, "b": 0}, [1, 2]) == ["b", "a"]  # 3 above
    assert policy.rank(["a", "b"], {"a": 0, "b": 1}, []) == ["a", "b"]  # no prefix: load


def test_round_robin_ignores_prefixes() -> None:
    policy = RoutingPolicy("round_robin")
    firsts = [policy.rank(["a", "b", "c"], {}, [1, 2])[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    policy.routed("a", [1, 2])
    assert len(policy.table) == 0


def test_bad_policy_options() -> None:
    with pytest.raises(ValueError, match="routing"):
        RoutingPolicy("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="imbalance"):
        RoutingPolicy("prefix", imbalance_threshold=-1)


class _Tok:
    """Enough of a tokenizer for completions: one id per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_prefix_keys_of_completion_bodies() -> None:
    keys = PrefixKeys(_Tok(), block_size=4, max_blocks=8)  # type: ignore[arg-type]
    text = keys.for_body("/v1/completions", b'{"prompt": "abcdefghij", "max_tokens": 3}')
    assert text == block_hashes([1] + [ord(c) for c in "abcdefghij"], 4, 8)
    batch = keys.for_body("/v1/completions", b'{"prompt": ["abcdefghij", "zzzzzzzz"]}')
    assert batch == text  # a batch goes by its first prompt
    ids = keys.for_body("/v1/completions", b'{"prompt": [5, 6, 7, 8, 9]}')
    assert ids == block_hashes([5, 6, 7, 8], 4, 8)
    for path, body in [("/v1/completions", b"not json"), ("/v1/models", b""),
                       ("/v1/completions", b'{"prompt": 3}'),
                       ("/v1/chat/completions", b'{"messages": "x"}')]:
        assert keys.for_body(path, body) == ()


class _CountingTok(_Tok):
    """Counts the characters it was asked to encode."""

    def __init__(self) -> None:
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return super().encode(text, add_special_tokens)


def test_prefix_keys_bound_the_text_they_tokenize() -> None:
    tok = _CountingTok()
    keys = PrefixKeys(tok, block_size=4, max_blocks=8)  # type: ignore[arg-type]
    long = "abcdefgh" * 100_000  # 800,000 characters
    hashes = keys.for_body("/v1/completions", json.dumps({"prompt": long}).encode())
    assert tok.chars == keys.max_chars < len(long)
    assert hashes == block_hashes([1] + [ord(c) for c in long[:64]], 4, 8)  # still routed
    chat = {"messages": [{"role": "user", "content": long}]}
    assert keys.for_body("/v1/chat/completions", json.dumps(chat).encode()) == ()
    assert tok.chars == keys.max_chars  # the long chat was never rendered nor encoded
