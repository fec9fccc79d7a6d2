"""Fault isolation for one step's forward: find the request(s) that make it fail.

When the model forward of a step raises, ``run_isolated`` bisects the step's chunks
(re-running each half; K/V writes are idempotent, every chunk writes only its own
slots) until it has the smallest set of chunks that fail on their own, then runs
the rest again as one batch. Those culprits fail alone; the others carry on with
outputs as if nothing had happened. If every chunk fails on its own, a one-token
probe tells a broken model (``ModelFailedError``: the engine cannot serve) from
requests that are each bad.  A ``ModelFailedError`` raised by the runner itself (a
tensor-parallel step: the ranks are out of step after any failure) is never bisected
or retried: it goes straight up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.runner.errors import ModelFailedError as ModelFailedError  # re-export
from roseinfer.runner.errors import describe as describe  # re-export
from roseinfer.runner.model_runner import StepLogits
from roseinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Execute = Callable[[list[ScheduledRequest]], StepLogits]


def run_isolated(
    execute: Execute, scheduled: list[ScheduledRequest], block_manager: BlockManager,
) -> tuple[list[ScheduledRequest], StepLogits | None, dict[int, str]]:
    """Run ``scheduled``; on failure, isolate the culprits.

    Returns (chunks that ran, their logits, {index in ``scheduled``: error}) — the
    logits are None when nothing ran.  Raises ``ModelFailedError`` when the model
    cannot run at all, and re-raises when the failure cannot be pinned on requests
    (every part runs alone but the whole does not).
    """
    try:
        return scheduled, execute(scheduled), {}
    except ModelFailedError:
        raise  # the runner says the model cannot run (a dead tensor-parallel rank): no retry
    except Exception as exc:  # noqa: BLE001 - isolated below
        first_error = exc
    logger.warning("step forward failed (%s); isolating the request(s) at fault",
                   describe(first_error))
    failed = _bisect(execute, list(range(len(scheduled))), scheduled, first_error)
    if len(failed) == len(scheduled) and not _model_runs(execute, block_manager):
        raise ModelFailedError(f"the model cannot run: {describe(first_error)}") from first_error
    survivors = [s for i, s in enumerate(scheduled) if i not in failed]
    if not survivors:
        return [], None, failed
    return survivors, execute(survivors), failed  # raises if the failure needs the mix


def _bisect(execute: Execute, indices: list[int], scheduled: Sequence[ScheduledRequest],
            error: BaseException) -> dict[int, str]:
    """{index: error} of the chunks among ``indices`` that fail on their own; ``indices``
    as a whole is known to fail with ``error``."""
    if len(indices) == 1:
        return {indices[0]: describe(error)}
    mid = len(indices) // 2
    failed: dict[int, str] = {}
    for half in (indices[:mid], indices[mid:]):
        try:
            execute([scheduled[i] for i in half])
        except ModelFailedError:
            raise
        except Exception as exc:  # noqa: BLE001 - narrowed down recursively
            failed.update(_bisect(execute, half, scheduled, exc))
    return failed


def _model_runs(execute: Execute, block_manager: BlockManager) -> bool:
    """Run one token (id 0) through the model in a borrowed KV block."""
    probe = Request("__roseinfer-probe__", [0], SamplingParams(max_tokens=1))
    if not block_manager.allocate(probe, 1):
        return True  # no block to probe with: do not declare the model dead
    try:
        execute([ScheduledRequest(probe, 1)])
        return True
    except Exception:  # noqa: BLE001 - the answer is the point
        logger.exception("the model failed a one-token probe")
        return False
    finally:
        block_manager.free(probe)
