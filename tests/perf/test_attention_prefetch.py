"""The float / fp16 attention kernel's prefetches and thread splits change only when data
arrives and who computes what: streaming the next sequence into L2 (on by default on AMD
CPUs, ``ROSEINFER_F16_SEQ_PREFETCH``), at batch 1 on one thread its first KV head
fetching every head's rows (``ROSEINFER_ATTN_WIDE_PF``), and batch 1 on several threads
cut by positions, then by head dims (attention_one_row.h): the op's bits are the same
each way, and the same as each row alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from roseinfer.kernels import cpu_kernels_available

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels unavailable")

# Decode rows of 40 sequences (several per thread, lengths 1 to 300) then a prefill chunk,
# block sizes 16 and 5, fp32 and fp16 caches: sha256 of the outputs, and whether every
# row equals itself alone.
_LOAD = "from roseinfer.kernels import cpu_kernels_available\nassert cpu_kernels_available()\n"
_SCRIPT = """
import hashlib, torch
h = hashlib.sha256()
alone_ok = True
gen = torch.Generator().manual_seed(5)
for dtype in (torch.float32, torch.float16):
    for bs in (16, 5):
        width, heads, hkv, dh = 64 if bs == 5 else 20, 9, 3, 64
        n = 41
        tables = torch.randperm(n * width, generator=gen).view(n, width).to(torch.int32)
        cache = torch.randn(2, n * width * bs, hkv, dh, generator=gen).to(dtype)
        lens = torch.randint(1, 301, (40,), generator=gen, dtype=torch.int32)
        seq = list(range(40)) + [40] * 6
        lens = torch.cat([lens, torch.arange(60, 66, dtype=torch.int32)])
        seq = torch.tensor(seq, dtype=torch.int32)
        q = torch.randn(len(seq), heads, dh, generator=gen)
        out = torch.ops.roseinfer.paged_attention(q, cache, tables, seq, lens, bs, dh**-0.5)
        h.update(out.numpy().tobytes())
        for i in range(0, 40, 7):
            one = torch.ops.roseinfer.paged_attention(q[i:i + 1], cache, tables, seq[i:i + 1],
                                                      lens[i:i + 1], bs, dh**-0.5)
            alone_ok &= torch.equal(one[0], out[i])
print(h.hexdigest(), alone_ok)
"""


# One row at a time (batch 1), contexts up to 3,000, KV heads 3 (the default model), 8,
# 1 and 5, head dims 32 to 256, fp32 and fp16 caches, block sizes 16 and 5.
_SINGLE = """
import hashlib, torch
h = hashlib.sha256()
gen = torch.Generator().manual_seed(7)
for dtype in (torch.float32, torch.float16):
    for bs in (16, 5):
        for heads, hkv, dh in ((9, 3, 64), (32, 8, 64), (4, 1, 128), (6, 3, 32), (10, 5, 256)):
            width = 3000 // bs + 1
            tables = torch.randperm(width, generator=gen).view(1, width).to(torch.int32)
            cache = torch.randn(2, width * bs, hkv, dh, generator=gen).to(dtype)
            for n in (1, 37, 600, 3000):
                q = torch.randn(1, heads, dh, generator=gen)
                out = torch.ops.roseinfer.paged_attention(
                    q, cache, tables, torch.zeros(1, dtype=torch.int32),
                    torch.tensor([n], dtype=torch.int32), bs, dh**-0.5)
                h.update(out.numpy().tobytes())
print(h.hexdigest(), True)
"""


def _run(var: str, value: str, script: str = _SCRIPT, threads: int = 2) -> tuple[str, str]:
    env = {**os.environ, var: value, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _LOAD + script],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    digest, alone = proc.stdout.split()
    return digest, alone


def test_next_sequence_stream_changes_no_bits() -> None:
    on, off = _run("ROSEINFER_F16_SEQ_PREFETCH", "1"), _run("ROSEINFER_F16_SEQ_PREFETCH", "0")
    assert on[1] == "True" and off[1] == "True"
    assert on[0] == off[0]


def test_batch1_wide_prefetch_changes_no_bits() -> None:
    on = _run("ROSEINFER_ATTN_WIDE_PF", "1", _SINGLE)
    off = _run("ROSEINFER_ATTN_WIDE_PF", "0", _SINGLE)
    assert on[0] == off[0]


def test_batch1_split_over_threads_changes_no_bits() -> None:
    """One row on 2, 3 or 4 threads (scores by positions, P.V by KV heads and head-dim
    parts) gives the one-thread items path's bits."""
    one = _run("ROSEINFER_ATTN_WIDE_PF", "1", _SINGLE, threads=1)
    for threads in (2, 3, 4):
        assert _run("ROSEINFER_ATTN_WIDE_PF", "1", _SINGLE, threads=threads)[0] == one[0]
