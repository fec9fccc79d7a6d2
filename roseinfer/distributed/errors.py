"""Errors of a tensor-parallel engine: every one is fatal (a ``ModelFailedError``).

A failed step leaves the ranks out of step (some inside a collective, some not), so it
is never retried or bisected (``fault_isolation.run_isolated`` re-raises it at once):
the engine stops its workers and fails every request; the server's ``/health`` turns
503 (``AsyncEngine.dead_reason``).
"""

from __future__ import annotations

from roseinfer.runner.errors import ModelFailedError


class TensorParallelError(ModelFailedError):
    """A tensor-parallel step failed (a collective errored or timed out, or a rank raised)."""


class WorkerDiedError(TensorParallelError):
    """A tensor-parallel worker process exited."""
