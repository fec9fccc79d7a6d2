"""How a model runner fails: ``ModelFailedError`` when the model itself cannot run.

Below the engine and the tensor-parallel runner (``roseinfer.distributed.errors``
subclasses it), so both raise and catch it without importing each other;
``engine/fault_isolation.py`` tells it from a failure of one request.
"""

from __future__ import annotations


class ModelFailedError(RuntimeError):
    """The model itself cannot run (a one-token probe failed, or the runner says so, e.g.
    a tensor-parallel worker died): no request can be served."""


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and message."""
    return f"{type(exc).__name__}: {exc}"
