"""SpecDecoding: the engine's drafter for n-gram speculative decoding, and its bookkeeping.

One engine step with speculation on::

    spec.propose(scheduler.running)     # Request.spec_token_ids of each decoding request
    sched = scheduler.schedule()        # a decode takes the drafts that fit: 1 + d tokens
    ... runner.execute(...)             # logits of all 1 + d positions
    sampled = step_sampler.sample(...)  # RejectionSampler: accepted drafts + one token
    spec.record(sched.scheduled, sampled, stats)   # acceptance: counters, adaptivity
    scheduler.update(...)               # appends them, rolls back rejected slots

Who drafts: a running request whose next step is a decode, without a structured-output
constraint (its grammar's mask holds for the next token only). Penalties, min_tokens,
logit_bias and seeds are handled exactly by the verifier (``roseinfer.runner.
rejection_sampler``), so those requests draft too. A request with no n-gram match
decodes plainly.

Adaptive (``SpeculativeConfig.adaptive``, on by default), two parts:

* per request, an exponentially decayed estimate of how often a drafted token is
  accepted, given the drafts before it were (``SpecState.rate``: accepted / verified
  over recent verifications). Drafts the step does not feed still count: they are kept
  as a *shadow* and compared with the tokens the request then generates, so the
  estimate stays current at no cost while a request is not drafting, and a request
  starts drafting again as soon as its text becomes predictable;
* per step, ``spec_budget.plan_drafts`` keeps the drafts worth their rows: draft i of a
  request is accepted with chance ``rate ** i``, and a step's time by rows is learned
  online (``StepCostModel``), so drafts are cut where extra rows cost more than they
  are expected to earn (a compute-bound batch, a weight format whose 2-row GEMM costs
  much more than its 1-row one, text with nothing to copy). When the step without
  drafts has not been timed lately (at this batch size), one runs plain to time it
  (at most one step in ``_EXPLORE_GAP``).

With ``adaptive`` off every proposed draft is fed.
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.engine.ngram import NgramIndex
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest
from roseinfer.engine.spec_budget import StepCostModel, plan_drafts
from roseinfer.engine.spec_state import SpecState as SpecState  # re-export
from roseinfer.engine.stats import EngineStats
from roseinfer.speculative_config import SpeculativeConfig

_EXPLORE_GAP = 16  # steps between two plain steps run to time the step without drafts


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int) -> None:
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = StepCostModel()
        self._since_plain = _EXPLORE_GAP  # steps since a plain step was run to time it

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of every running request: its drafts for this step
        ([] unless it decodes, may draft, its last n-gram occurred before, and, when
        adaptive, the drafts are worth their rows)."""
        cfg = self.config
        limit = cfg.disable_by_batch_size
        off = limit is not None and len(running) > limit
        base_rows = num_sampled = 0
        chances: list[list[float]] = []
        planned: list[tuple[Request, list[int]]] = []
        for req in running:
            req.spec_token_ids = []
            pending = req.num_tokens - req.num_computed_tokens
            base_rows += pending
            if pending != 1:
                continue
            num_sampled += 1
            if off or req.grammar is not None:
                continue
            state = req.spec
            if state is None:
                state = req.spec = SpecState(NgramIndex(cfg.prompt_lookup_min,
                                                        cfg.prompt_lookup_max))
            state.check_shadow(req.output_token_ids)
            k = min(cfg.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1)
            drafts = state.index.propose(req.all_token_ids, k) if k > 0 else []
            if not drafts:
                continue
            if not cfg.adaptive:
                req.spec_token_ids = drafts
            else:
                planned.append((req, drafts))
                chances.append([state.rate ** (i + 1) for i in range(len(drafts))])
        if not planned:
            return
        budget = self.max_num_batched_tokens
        base_rows = min(base_rows, budget)
        self._since_plain += 1
        if not self.cost.fresh(base_rows) and self._since_plain >= _EXPLORE_GAP:
            self._since_plain = 0  # time the step without drafts: every plan compares to it
            counts = [0] * len(planned)
        else:
            counts = plan_drafts(self.cost, base_rows, num_sampled, chances, budget)
        for (req, drafts), n in zip(planned, counts, strict=True):
            state = req.spec
            assert state is not None
            if n:
                req.spec_token_ids = drafts[:n]
                state.shadow = None  # a real verification says more
            elif state.shadow is None:
                state.shadow, state.shadow_at = drafts, req.num_output_tokens

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The time of a step that computed ``num_tokens`` tokens (drafts included)."""
        self.cost.observe(num_tokens, seconds)

    def record(self, scheduled: Sequence[ScheduledRequest], sampled: Sequence[Sequence[int]],
               stats: EngineStats) -> None:
        """Count each verification (``stats``) and feed it to the request's estimate."""
        for s, tokens in zip(scheduled, sampled, strict=True):
            drafted = len(s.spec_token_ids)
            if not drafted or not tokens:
                continue
            accepted = min(len(tokens) - 1, drafted)
            stats.record_spec_decode(drafted, accepted)
            if s.request.spec is not None:
                s.request.spec.observe(drafted, accepted)
