"""A request's logits do not depend on how many threads the kernels run on: the default
model's sampled logits at every step (prefill chunks, then decode batches of three
requests) are bitwise the same with 1 and 2 threads, in the default format and over the
int8 KV cache (docs/CONTRACTS.md: ranges of work decide which thread runs an item,
never a value)."""

from __future__ import annotations

import pytest
import torch

from scripts.isa_variants import step_logits

pytestmark = pytest.mark.slow  # default model: `make test-fast` skips it


def _step_logits(threads: int, kv: str) -> list[torch.Tensor]:
    """Every step's sampled logits of three greedy chats, prompts in 16-token chunks."""
    logits = step_logits("auto", kv, max_tokens=12, num_threads=threads)
    assert torch.get_num_threads() == threads
    return logits


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_logits_do_not_depend_on_thread_count(kv: str) -> None:
    before = torch.get_num_threads()
    try:
        one, two = _step_logits(1, kv), _step_logits(2, kv)
    finally:
        torch.set_num_threads(before)
    assert len(one) == len(two) > 12
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        assert torch.equal(a, b), f"step {step} differs between 1 and 2 threads"
