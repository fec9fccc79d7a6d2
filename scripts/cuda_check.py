"""Checks of the engine on a CUDA GPU that are no pytest suite (docs/testing.md, On a GPU).

For a session that has a GPU, beside ``tests/device`` and the engine suites run with
``ROSEINFER_TEST_DEVICE=cuda``. It prints one line per check and exits 1 if any failed:

- every GGUF format (random blocks, a small Llama shape, a byte-level vocabulary) loads
  on CUDA and gives the exact fp32 CPU engine's greedy tokens;
- whether a request's logits on CUDA are bitwise the same alone and in a batch of 16
  (reported, not required: the promise holds for the CPU kernels, docs/CONTRACTS.md);
- ``roseinfer serve --device cuda`` on 127.0.0.1 answers ``/v1/completions`` and
  ``/generate``.

    python -m scripts.cuda_check [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from tokenizers.pre_tokenizers import ByteLevel

FORMATS = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
           "Q4_K_M", "Q2_K", "Q3_K")
PROMPTS = ["hello world", "The quick brown fox", "x"]


def _tokenizer_metadata() -> dict[str, object]:
    tokens = ["<unk>", "<s>", "</s>"] + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["h e", "l l", "he ll"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def _small_gguf(path: Path, fmt: str) -> Path:
    from roseinfer.bench.random_gguf import ModelShape, write_random_gguf

    shape = ModelShape("small", "llama", 512, 2, 8, 2, 1024, tied=False, context=2048)
    return write_random_gguf(path, shape, fmt, seed=0, tokenizer=_tokenizer_metadata())


def _greedy(path: Path, device: str) -> list[list[int]]:
    from roseinfer.llm import LLM
    from roseinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device=device, quantization="none", num_kv_blocks=64) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def check_formats(tmp: Path) -> bool:
    ok = True
    for fmt in FORMATS:
        path = _small_gguf(tmp / f"small-{fmt}.gguf", fmt)
        try:
            cpu, cuda = _greedy(path, "cpu"), _greedy(path, "cuda")
            same = cpu == cuda
            print(f"gguf {fmt}: cuda tokens {'==' if same else '!='} cpu tokens", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, then the next format
            same = False
            print(f"gguf {fmt}: FAILED {type(exc).__name__}: {exc}", flush=True)
        ok &= same
    return ok


def report_invariance() -> None:
    """The target request alone, then with 15 others: are its logits rows bitwise equal?"""
    from tests.engine.invariance_helpers import (
        Arrival,
        greedy,
        make_engine,
        random_prompt,
        run_schedule,
        tiny_gqa_llama,
    )

    rng = random.Random(0)
    target = Arrival(0, "target", random_prompt(rng, 50), greedy(16))
    others = [Arrival(0, f"o{i}", random_prompt(rng, rng.randint(1, 90)), greedy(20))
              for i in range(15)]
    for dtype in ("float32", "bfloat16"):
        runs = [run_schedule(make_engine(tiny_gqa_llama(), "none", device="cuda",
                                         dtype=dtype), arrivals)
                for arrivals in ([target], [target, *others])]
        rows = [r.rows("target") for r in runs]
        equal = all(torch.equal(a, b) for a, b in zip(*rows, strict=True))
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(*rows, strict=True))
        print(f"invariance on cuda ({dtype}): alone vs batch of 16 bitwise {equal}, "
              f"max |diff| {diff:.3g}, same tokens {runs[0].tokens['target'] == runs[1].tokens['target']}",
              flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def check_server(path: Path, out: Path) -> bool:
    port = _free_port()
    log = (out / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "roseinfer.cli", "serve", "--model", str(path),
                             "--device", "cuda", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    print("serve on cuda: FAILED, exited (serve.log)", flush=True)
                    return False
                time.sleep(0.5)
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        comp = _post(base + "/v1/completions", {"model": model, "prompt": "hello",
                                                "max_tokens": 8, "temperature": 0})
        gen = _post(base + "/generate", {"prompt": "hello", "max_new_tokens": 8,
                                         "temperature": 0})
        same = comp["choices"][0]["text"] == gen["text"]
        print(f"serve on cuda: completions {comp['usage']}, /generate text equal: {same}",
              flush=True)
        return same
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        print(f"serve on cuda: FAILED {type(exc).__name__}: {exc}", flush=True)
        return False
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.gettempdir())))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ok = check_formats(tmp)
        report_invariance()
        ok &= check_server(tmp / "small-Q4_K_M.gguf", args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
