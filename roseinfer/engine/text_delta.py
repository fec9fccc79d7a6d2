"""One sequence's text delta after a step, under vLLM's stop rules.

``text_delta`` feeds a sequence's new tokens to its ``IncrementalDetokenizer`` one by
one and applies the stop rules: the text of a stop token id / EOS that ended the
sequence is left out (unless ``include_stop_str_in_output``), and a stop string ends
the sequence with ``"stop"`` even on its last allowed token. A stop string completed by
one of several new tokens (accepted drafts) ends the sequence there: the tokens after
it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from roseinfer.engine.detokenizer import IncrementalDetokenizer
from roseinfer.engine.request import Request, RequestStatus

FinishFn = Callable[[Request, RequestStatus], None]  # Scheduler.finish_request


def text_delta(req: Request, detok: IncrementalDetokenizer | None, sent: int,
               finish: FinishFn) -> str:
    """The text of ``req``'s tokens after its first ``sent`` outputs; ``finish`` ends a
    still-running sequence that a stop string stopped."""
    if detok is None:
        return ""
    stopped_by_token = (req.status is RequestStatus.FINISHED_STOPPED
                        and not req.stopped_by_grammar)  # a grammar's last token is text
    new = req.output_token_ids[sent:]
    if stopped_by_token and not req.params.include_stop_str_in_output:
        new = new[:-1]
    delta, matched = "", None
    for j, token in enumerate(new):
        upd = detok.add_tokens([token])
        delta, matched = delta + upd.delta, upd.stop_matched
        if matched is not None:
            req.truncate_output(sent + j + 1)
            break
    if matched is not None:
        if req.is_finished:  # by length, or by a stop id whose text is kept
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            finish(req, RequestStatus.FINISHED_STOPPED)
        req.stop_reason = matched
    elif req.is_finished:
        delta += detok.finish()
    return delta
