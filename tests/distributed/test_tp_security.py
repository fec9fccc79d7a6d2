"""Who can take part in a tensor-parallel group: rank 0's store listens on the init
method's address only, and nothing read from it is used unless it is signed with the
group's secret - a pickle or a forged spec never runs, a wrong secret is refused on both
sides, forged readiness is refused (docs/scaling-out.md, Tensor parallel: what an attacker can still
do)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from roseinfer.distributed.auth import SECRET_ENV, SignedStore, StoreAuthError, new_secret
from roseinfer.distributed.comm import Rendezvous
from roseinfer.distributed.pool import WorkerPool
from roseinfer.distributed.spec import SpecError, WorkerSpec
from roseinfer.distributed.step import ShardExecutor, StepMessage
from roseinfer.distributed.worker import SPEC_KEY
from roseinfer.model.attention_metadata import SeqSpec
from tests.distributed.helpers import PROMPTS, engine, generate, greedy, save_llama, workers
from tests.server.helpers import free_port

pytestmark = pytest.mark.timeout(120)
LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


def _listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def _client(rendezvous: Rendezvous) -> dist.TCPStore:
    """Anyone who reaches the port: a plain store client, no secret."""
    return dist.TCPStore(rendezvous.host, rendezvous.port, None, False,
                         timeout=datetime.timedelta(seconds=10))


def _tp_worker(address: str, rank: int, secret: str) -> subprocess.Popen[str]:
    env = dict(os.environ, **{SECRET_ENV: secret})
    return subprocess.Popen(
        [sys.executable, "-m", "roseinfer.cli", "tp-worker", "--distributed-init-method",
         address, "--rank", str(rank), "--host", "127.0.0.1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _spec(**changes: object) -> dict:
    doc = dict(version=1, model="/models/llama", size=2,
               shards=[[0, 0, 4, 0, 2, 0, 128, 0, 151], [1, 4, 6, 2, 3, 128, 224, 151, 301]],
               host="127.0.0.1", port=29500, dtype="float32", device="cpu",
               quantization="none", kv_dtype="float32", block_size=4, num_blocks=128,
               num_threads=1, timeout_s=60.0)
    doc.update(changes)
    return doc


def test_store_listens_on_the_init_method_address_only() -> None:
    store, rendezvous = Rendezvous("127.0.0.1", 0).serve(2, 10)
    try:
        mine = [ip for ip, port in _listening(os.getpid()) if port == rendezvous.port]
        assert mine == ["127.0.0.1"], mine  # torch's own listener: '::' (every interface)
    finally:
        del store


def test_every_rank_listens_on_loopback_only(llama: Path) -> None:
    """The store and gloo's pairs, on rank 0 and on the worker; the secret is never on a
    worker's command line."""
    eng = engine(llama, 2)
    try:
        store = eng.runner.executor.comm.store
        rank0 = _listening(os.getpid())
        assert store.inner.port in [port for _, port in rank0]
        (worker,) = workers()
        for pid in (os.getpid(), worker.pid):
            listening = _listening(pid)
            assert listening and {ip for ip, _ in listening} <= LOOPBACK, (pid, listening)
        secret = store._key.decode()
        assert secret not in " ".join(worker.cmdline())
        assert generate(eng, PROMPTS[:1], greedy(2))[0].finished
    finally:
        eng.shutdown()


class _Payload:
    """Unpickling this creates a file: what an attacker would put in the spec."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("forgery", ["pickle", "json-other-secret"])
def test_forged_spec_is_refused_and_nothing_runs(tmp_path: Path, forgery: str) -> None:
    """Someone without the secret writes the spec a worker reads: refused before use."""
    marker = tmp_path / "pwned"
    store, rendezvous = Rendezvous("127.0.0.1", 0).serve(2, 30)
    attacker = _client(rendezvous)
    if forgery == "pickle":
        attacker.set(SPEC_KEY, pickle.dumps(_Payload(marker)))
    elif forgery == "json-unsigned":
        attacker.set(SPEC_KEY, json.dumps(_spec(model=str(marker))))
    else:
        SignedStore(attacker, new_secret()).set_json(SPEC_KEY, _spec(model=str(marker)))
    worker = _tp_worker(f"tcp://127.0.0.1:{rendezvous.port}", 1, new_secret())
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode != 0, out
    assert "not signed with this group's secret" in out, out
    assert not marker.exists()
    # The refusal reaches rank 0, unsigned: it refuses it as such.
    with pytest.raises(StoreAuthError, match="error/1"):
        SignedStore(store, new_secret()).get("error/1")
    del store


def test_wrong_secret_is_refused_on_both_sides(llama: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, new_secret())
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = _tp_worker(address, 1, new_secret())  # not rank 0's
    try:
        with pytest.raises(StoreAuthError, match="'error/1'.*not signed"):
            engine(llama, 2, distributed_init_method=address, distributed_local_workers=0)
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode != 0
        assert f"'{SPEC_KEY}' in rank 0's store is not signed" in out, out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert not workers()


def test_remote_ranks_need_a_shared_secret(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        engine(llama, 2, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
               distributed_local_workers=0)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 32 characters"):
        engine(llama, 2, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
               distributed_local_workers=0)


@pytest.mark.parametrize("key", ["ready/1", "error/1"])
def test_forged_readiness_or_error_is_refused(key: str) -> None:
    raw, rendezvous = Rendezvous("127.0.0.1", 0).serve(2, 10)
    store = SignedStore(raw, new_secret())
    _client(rendezvous).set(key, json.dumps({"rank": 1, "spec": "x", "error": "forged"}))
    with pytest.raises(StoreAuthError, match=key):
        WorkerPool([], 2).wait_ready(store, "x", timeout_s=10)
    assert not raw.check(["go"])


def test_ready_for_another_spec_is_refused() -> None:
    raw, _ = Rendezvous("127.0.0.1", 0).serve(2, 10)
    store = SignedStore(raw, new_secret())
    store.set_json("ready/1", {"rank": 1, "spec": "an older spec"})
    with pytest.raises(RuntimeError, match="another spec"):
        WorkerPool([], 2).wait_ready(store, "this spec", timeout_s=10)


def test_signed_values_cannot_be_moved_or_altered() -> None:
    raw, _ = Rendezvous("127.0.0.1", 0).serve(1, 10)
    store = SignedStore(raw, new_secret())
    store.set_json("ready/1", {"rank": 1})
    assert store.get_json("ready/1") == {"rank": 1}
    raw.set("ready/2", raw.get("ready/1"))  # a valid value under another key
    with pytest.raises(StoreAuthError, match="ready/2"):
        store.get("ready/2")
    value = bytearray(raw.get("ready/1"))
    value[-2] ^= 1
    raw.set("ready/1", bytes(value))
    with pytest.raises(StoreAuthError, match="ready/1"):
        store.get("ready/1")


def test_spec_round_trips_and_malformed_specs_are_refused() -> None:
    spec = WorkerSpec.from_dict(_spec())
    assert WorkerSpec.from_json(spec.to_json()) == spec
    bad = [
        "not json", "[]", json.dumps(_spec(version=2)), json.dumps(_spec(extra=1)),
        json.dumps({k: v for k, v in _spec().items() if k != "num_blocks"}),
        json.dumps(_spec(size=1)), json.dumps(_spec(size=True)), json.dumps(_spec(port=0)),
        json.dumps(_spec(port="29500")), json.dumps(_spec(dtype="object")),
        json.dumps(_spec(quantization="pickle")), json.dumps(_spec(device="cuda; rm -rf")),
        json.dumps(_spec(num_blocks=-1)), json.dumps(_spec(timeout_s=float("inf"))),
        json.dumps(_spec(model=["/a"])), json.dumps(_spec(host="a b")),
        json.dumps(_spec(shards=[[0] * 9])), json.dumps(_spec(shards=[[0] * 9, [0] * 9])),
        json.dumps(_spec(shards=[[0] * 9, [1, -1] + [0] * 7])),
    ]
    for text in bad:
        with pytest.raises(SpecError):
            WorkerSpec.from_json(text)


def test_worker_refuses_step_messages_out_of_range() -> None:
    """A step's indices reach C++ kernels that do not check them: a worker checks each
    against its own vocabulary, pool and step before running it."""
    executor = ShardExecutor.__new__(ShardExecutor)  # only the limits matter here
    executor.vocab_sizes, executor.num_blocks, executor.block_size = (150, 151), 8, 4
    good = StepMessage([5, 6, 7, 300], [SeqSpec(0, 3, [1]), SeqSpec(4, 1, [2, 7])], [2, 3, 2])

    def check(message: StepMessage) -> None:
        header, payload = message.pack()
        executor._check_header(header)
        executor._check(StepMessage.unpack(header, payload))

    check(good)
    bad = [
        StepMessage([5, 6, 7, 301], good.seqs, good.rows),  # token outside the vocabulary
        StepMessage([5, 6, 7, -1], good.seqs, good.rows),
        StepMessage(good.token_ids, [SeqSpec(0, 3, [1]), SeqSpec(4, 1, [2, 8])], good.rows),
        StepMessage(good.token_ids, [SeqSpec(0, 3, [1]), SeqSpec(8, 1, [2, 7])], good.rows),
        StepMessage(good.token_ids, [SeqSpec(0, 3, [1]), SeqSpec(4, 1, [-2, 7])], good.rows),
        StepMessage(good.token_ids, [SeqSpec(0, 2, [1]), SeqSpec(4, 1, [2, 7])], good.rows),
        StepMessage(good.token_ids, good.seqs, [4]),  # a row the step does not have
        StepMessage(list(range(40)), [SeqSpec(0, 40, list(range(8)))], [0]),  # > the pool
    ]
    for message in bad:
        with pytest.raises(ValueError, match="out of range"):
            check(message)
