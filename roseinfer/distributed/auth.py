"""Who may take part in a tensor-parallel group: a per-engine secret and a signed store.

Rank 0's ``TCPStore`` has no access control of its own: anyone who reaches its port can
read and write any key.  So every value the ranks put in it - the worker spec, ``ready/N``,
``error/N``, ``go`` and gloo's own rendezvous keys - is written through ``SignedStore``:
``MAGIC | HMAC-SHA256(secret, key NUL value) | value``; a reader verifies the tag
(``hmac.compare_digest``) before using anything, and a value written by someone without
the secret is a ``StoreAuthError``.  The tag covers the key, so a signed value cannot be
moved to another key.  Values are JSON (ours) or gloo's raw address bytes, never pickles.

The secret: a fresh ``secrets.token_hex(32)`` per engine, given to the workers rank 0
starts in their environment (``ROSEINFER_TP_SECRET``, never the command line); with ranks
on other hosts the operator sets the same ``ROSEINFER_TP_SECRET`` for rank 0 and for each
``roseinfer tp-worker`` (or gives the worker ``--secret-file``).

What this does not stop (docs/scaling-out.md, Tensor parallel): a party that reaches the port can still
delete or overwrite keys, or connect and say nothing - the start fails or times out
(denial of service).  It cannot run code in a rank, change the model, the plan or any
other field of the spec, or claim that a rank is ready or failed.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch.distributed as dist

SECRET_ENV = "ROSEINFER_TP_SECRET"
MIN_SECRET_CHARS = 32
_MAGIC = b"rit1"  # roseinfer tensor-parallel, signed value, version 1
_TAG = hashlib.sha256().digest_size


class StoreAuthError(ValueError):
    """A value in rank 0's store is not signed with this group's secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def check_secret(secret: str, source: str) -> str:
    """``secret`` stripped, or ValueError if it is too short to be a secret."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the tensor-parallel secret from {source} must have at least "
                         f"{MIN_SECRET_CHARS} characters (e.g. python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'), got {len(secret)}")
    return secret


def read_secret(secret_file: str | None = None) -> str:
    """The secret of a joining worker: from ``secret_file`` if given, else from the
    ``ROSEINFER_TP_SECRET`` environment variable (removed from this process's environment
    once read, so nothing it starts inherits it)."""
    env = os.environ
    if secret_file is not None:
        env.pop(SECRET_ENV, None)
        return check_secret(Path(secret_file).read_text(), f"--secret-file {secret_file}")
    secret = env.pop(SECRET_ENV, None)
    if secret is None:
        raise ValueError(f"a tensor-parallel worker needs the group's secret: set {SECRET_ENV} "
                         "to rank 0's, or pass --secret-file")
    return check_secret(secret, SECRET_ENV)


def digest(text: str) -> str:
    """SHA-256 of ``text`` (hex): names one spec document in ``ready/N`` and ``go``."""
    return hashlib.sha256(text.encode()).hexdigest()


class SignedStore(dist.Store):
    """A store whose values are signed on ``set`` and verified on ``get``.

    A ``dist.Store`` itself, so gloo's rendezvous goes through it too (gloo uses only
    ``set`` / ``get`` / ``wait`` / ``check``).  Counters (``add``) cannot be signed and
    are refused."""

    def __init__(self, inner: dist.Store, secret: str) -> None:
        super().__init__()
        self.inner = inner
        self._key = secret.encode()

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, _MAGIC + self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        start = len(_MAGIC) + _TAG
        tag, data = raw[len(_MAGIC):start], raw[start:]
        if (not raw.startswith(_MAGIC) or len(tag) != _TAG
                or not hmac.compare_digest(tag, self._tag(key, data))):
            raise StoreAuthError(
                f"the value under {key!r} in rank 0's store is not signed with this group's "
                "secret: it was written by someone without the secret (or by a rank started "
                f"with a different {SECRET_ENV}); refused, nothing of it was used")
        return data

    def set_json(self, key: str, obj: Any) -> None:
        self.set(key, json.dumps(obj, separators=(",", ":"), sort_keys=True))

    def get_json(self, key: str) -> Any:
        data = self.get(key)
        try:
            return json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreAuthError(f"the signed value under {key!r} is not JSON: {exc}") from None

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError("a signed store holds no counters")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        raise NotImplementedError("a signed store has no compare-and-set")

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout
