"""Ranks that join from another host: the engine starts only some workers itself
(``distributed_local_workers``) and the others run ``roseinfer tp-worker`` against its
``distributed_init_method``; here the "other host" is a separate process on loopback,
started the way an operator would start it on another machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roseinfer.config import EngineConfig
from roseinfer.distributed.auth import SECRET_ENV, new_secret
from tests.distributed.helpers import PROMPTS, engine, generate, greedy, save_llama, tokens
from tests.server.helpers import free_port

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """The operator's secret, set for rank 0 and (inherited) for each tp-worker."""
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    return secret


def _tp_worker(address: str, rank: int, secret_file: Path | None = None
               ) -> subprocess.Popen[bytes]:
    """With ``secret_file``: the secret from there, none in the worker's environment."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV or secret_file is None}
    extra = [] if secret_file is None else ["--secret-file", str(secret_file)]
    return subprocess.Popen(
        [sys.executable, "-m", "roseinfer.cli", "tp-worker", "--distributed-init-method",
         address, "--rank", str(rank), "--host", "127.0.0.1", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_rank_joining_from_another_host_matches_one_process(tmp_path: Path) -> None:
    path = save_llama(tmp_path / "llama")
    want = tokens(generate(engine(path, 1), PROMPTS, greedy(8)))
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = _tp_worker(address, 1)  # may start first: it waits for rank 0's store
    try:
        eng = engine(path, 2, distributed_init_method=address, distributed_local_workers=0)
        try:
            assert not eng.runner.pool.state.procs  # rank 1 is not this process's child
            assert tokens(generate(eng, PROMPTS, greedy(8))) == want
        finally:
            eng.shutdown()  # STOP reaches the remote rank through the group
        out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, out.decode(errors="replace")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_remote_ranks_need_an_address() -> None:
    with pytest.raises(ValueError, match="distributed_init_method"):
        EngineConfig(tensor_parallel_size=2, distributed_local_workers=0)
    with pytest.raises(ValueError, match="distributed_local_workers"):
        EngineConfig(tensor_parallel_size=2, distributed_local_workers=2,
                     distributed_init_method="tcp://127.0.0.1:1234")


def test_tp_worker_cli_checks_its_options() -> None:
    from roseinfer.cli import main

    assert main(["tp-worker", "--distributed-init-method", "udp://x:1", "--rank", "1"]) == 2
    assert main(["tp-worker", "--distributed-init-method", "tcp://127.0.0.1:1",
                 "--rank", "0"]) == 2


def test_killed_remote_rank_fails_the_engine_promptly(tmp_path: Path,
                                                       shared_secret: str) -> None:
    """Rank 0 cannot watch a remote rank's process: its death shows in the next
    collective (the socket closes), which fails the step with ModelFailedError.  This
    worker reads the secret from --secret-file."""
    import time

    from roseinfer.engine.fault_isolation import ModelFailedError

    path = save_llama(tmp_path / "llama")
    address = f"tcp://127.0.0.1:{free_port()}"
    secret_file = tmp_path / "secret"
    secret_file.write_text(shared_secret + "\n")
    worker = _tp_worker(address, 1, secret_file)
    try:
        eng = engine(path, 2, distributed_init_method=address, distributed_local_workers=0)
        try:
            generate(eng, PROMPTS[:1], greedy(2))
            worker.kill()
            worker.wait(10)
            eng.add_request("after", PROMPTS[0], greedy(4))
            start = time.monotonic()
            with pytest.raises(ModelFailedError):
                for _ in range(50):
                    eng.step()
            assert time.monotonic() - start < 30
            assert eng.failure is not None
        finally:
            eng.shutdown()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
