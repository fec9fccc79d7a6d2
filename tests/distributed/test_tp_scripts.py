"""Tensor parallelism from a plain script, and workers that fail to start: local workers
are ``roseinfer tp-worker`` subprocesses, which never import the user's ``__main__``, and
a worker's own error (its traceback, or its stderr when it died before reaching the
store) is in rank 0's exception."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.distributed.helpers import PROMPTS, engine, generate, greedy, save_llama, tokens, workers
from tests.server.helpers import wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.mark.slow  # a fresh interpreter and engine, ~10-40 s here
def test_script_without_main_guard_runs_tensor_parallel(llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(f"""\
        from roseinfer.llm import LLM
        from roseinfer.sampling_params import SamplingParams

        print("module body runs", flush=True)
        llm = LLM({str(llama)!r}, tensor_parallel_size=2, num_threads=1, quantization="none",
                  weight_cache=False, num_kv_blocks=64, block_size=4)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        out = llm.generate([{PROMPTS[0]!r}], params)
        print("TOKENS", list(out[0].outputs[0].token_ids), flush=True)
        """))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("module body runs") == 1, run.stdout  # not re-run by a worker
    want = tokens(generate(engine(llama, 1), PROMPTS[:1], greedy(6)))[0]
    assert f"TOKENS {want}" in run.stdout, run.stdout + run.stderr


def _broken_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Workers (processes running tp-worker) run ``body`` at interpreter start-up."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\nif 'tp-worker' in sys.argv:\n" + textwrap.indent(body, "    "))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))


def test_worker_failing_to_load_shows_its_traceback(llama: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Its signed error/<rank>: the worker's own traceback."""
    _broken_workers(tmp_path, monkeypatch, textwrap.dedent("""\
        import roseinfer.distributed.shard as shard

        def load_shard(*args, **kwargs):
            raise OSError("injected: cannot read this rank's shard")

        shard.load_shard = load_shard
        """))
    with pytest.raises(RuntimeError, match="rank 1 failed to start") as info:
        engine(llama, 2)
    assert "Traceback" in str(info.value)
    assert "OSError: injected: cannot read this rank's shard" in str(info.value)
    assert not workers()


def test_worker_dying_before_the_store_shows_its_stderr(llama: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dead before it could report anything: the tail of its stderr."""
    _broken_workers(tmp_path, monkeypatch, 'raise SystemExit("injected: worker cannot start")')
    with pytest.raises(RuntimeError, match="rank 1 .* exited while starting") as info:
        engine(llama, 2)
    assert "injected: worker cannot start" in str(info.value)
    assert not workers()


@pytest.mark.slow  # a fresh interpreter and engine
def test_workers_exit_when_rank0_is_killed(llama: Path, tmp_path: Path) -> None:
    """SIGKILL leaves rank 0 no chance to stop its workers: they notice on their own."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""\
        import time

        import psutil

        from roseinfer.llm import LLM

        llm = LLM({str(llama)!r}, tensor_parallel_size=2, num_threads=1, quantization="none",
                  weight_cache=False, num_kv_blocks=64, block_size=4)
        print("WORKERS", *[p.pid for p in psutil.Process().children()], flush=True)
        time.sleep(120)
        """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the engine has started
        assert line.startswith("WORKERS "), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 1
    finally:
        proc.kill()
        proc.wait(10)

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_until(lambda: all(gone(p) for p in pids), 15)
