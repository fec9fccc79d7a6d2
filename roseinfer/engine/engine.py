"""LLMEngine: the synchronous core — schedule, run, sample, update (no I/O).

``step()`` does one iteration for all requests in flight: the scheduler picks
the tokens to compute, the model runner runs them in ONE forward, the sampler
picks one token per request whose tokens were all computed (speculating: its
accepted drafts and one more), the scheduler
appends them and finishes requests on EOS / stop ids / length, and the
detokenizers turn new ids into text deltas (finishing requests on stop strings).
Constrained requests (``SamplingParams.structured_outputs``) get their logits rows
masked to what their grammar allows (``roseinfer.engine.structured``, masks computed
before or during the forward) and finish with ``"stop"`` once it is complete.
A request with ``n > 1`` runs as n sequences that share the prompt's KV blocks
through the prefix cache; its outputs are grouped back under one request id.
With ``speculative_config``, decoding requests draft tokens by n-gram lookup
(``roseinfer.engine.spec_decode``) and a step may give a request several tokens.
With ``enable_lora`` a request may name a LoRA adapter (``lora_request``): it waits in
``self.lora`` (``roseinfer.lora.admission``) until its adapter is resident, then runs
mixed with the others (``roseinfer.lora.forward``).
With ``tensor_parallel_size`` > 1 the runner is rank 0 of a tensor-parallel group
(``roseinfer.distributed``, built by ``runner_setup``): same ``execute``, workers
stopped by ``shutdown()``; any failure there is fatal (``ModelFailedError``).
An embedding request (``add_request(..., pooling=PoolingParams())``) only prefills, with
no prefix-cache hits, and finishes with its pooled final hidden state in
``RequestOutput.embedding`` (``roseinfer.engine.pooling``).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
import weakref

import torch
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.engine import pooling as pool
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.detokenizer import IncrementalDetokenizer
from roseinfer.engine.fault_isolation import describe, run_isolated
from roseinfer.engine.logprobs import LogprobBuilder
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.request_group import RequestGroup
from roseinfer.engine.runner_setup import build_runner
from roseinfer.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from roseinfer.engine.spec_decode import SpecDecoding
from roseinfer.engine.stats import EngineStats
from roseinfer.engine.step_sampler import StepSampler
from roseinfer.engine.structured import GrammarCompiler, StructuredDecoding
from roseinfer.engine.text_delta import text_delta
from roseinfer.engine.validation import InvalidRequestError, RequestValidator
from roseinfer.kvcache.tier import open_disk_tier
from roseinfer.lora.admission import LoRAAdmission, check_lora_request
from roseinfer.lora.request import LoRARequest
from roseinfer.lora.setup import setup_lora
from roseinfer.model.config import ModelConfig
from roseinfer.outputs import RequestMetrics, RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.runner.kv_backing import start_kv_backing
from roseinfer.runner.model_runner import StepLogits
from roseinfer.runner.sampler import Sampler
from roseinfer.sampling_params import SamplingParams
from roseinfer.speculative_config import SpeculativeConfig
from roseinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_TORCH_DTYPES = {**_TORCH_DTYPES, "int8": torch.int8}  # int8: roseinfer.model.kv_int8


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: nn.Module | None = None,
        model_config: ModelConfig | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        torch.set_num_threads(config.resolved_num_threads())
        self.device = resolve_device(config.device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.quantization = config.resolved_quantization(self.device.type)
        self.kv_dtype = _KV_TORCH_DTYPES[config.resolved_kv_cache_dtype(self.device.type)]
        block_size = config.block_size
        self.runner, model_config, tokenizer, weights = build_runner(
            config, self.device, self.dtype, self.quantization, self.kv_dtype, model,
            model_config, tokenizer)
        num_blocks = self.runner.num_blocks
        self.model_config = model_config
        self.tokenizer = tokenizer

        capacity = num_blocks * block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings, capacity)
        self.block_manager = bm = BlockManager(num_blocks, block_size,
                                               config.enable_prefix_caching)
        # Persistent prefix cache (kv_cache_dir): blocks spill to disk and come back.
        self.kv_disk = (open_disk_tier(config, self.runner.kv_caches, model_config, weights,
                                       self.quantization, self.dtype)
                        if config.kv_cache_dir is not None else None)
        if self.kv_disk is not None:
            self.block_manager.disk = self.kv_disk
            self._kv_disk_finalizer = weakref.finalize(self, self.kv_disk.close, 10.0)
        self.scheduler = sched = Scheduler(self.block_manager, config.max_num_seqs,
                                           config.max_num_batched_tokens, self.max_model_len)
        # The pool's next blocks backed ahead of use while idle (kv_backing.py; on CPU;
        # a tensor-parallel runner's workers back theirs when written).
        self.kv_backing = start_kv_backing(self.runner.kv_caches, block_size, num_blocks,
                                           lambda: bm.high_water, sched.has_unfinished,
                                           config.kv_cache_prefault_gb)
        if self.kv_backing is not None:
            weakref.finalize(self, self.kv_backing.stop)
        unseeded_rng = torch.Generator(device=self.device)
        unseeded_rng.manual_seed(config.seed)
        self.sampler = Sampler(unseeded_rng)  # RNG of requests without their own seed
        self.eos_token_ids: tuple[int, ...] = (
            tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        ) or tuple(model_config.eos_token_ids)
        # Structured outputs: grammars compiled before queueing (by the validator, on the
        # caller's thread) and cached here; masks and matcher updates once per step.
        self.grammars = GrammarCompiler(tokenizer, self.eos_token_ids)
        self.structured = StructuredDecoding(self.grammars, model_config.vocab_size, self.device)
        self.validator = RequestValidator(model_config.vocab_size, self.max_model_len,
                                          tokenizer is not None, self.grammars)
        self.logprobs = LogprobBuilder(tokenizer)
        self.step_sampler = StepSampler(self.sampler, self.logprobs, model_config.vocab_size,
                                        self.device)
        spec_config = SpeculativeConfig.coerce(config.speculative_config)
        self.spec = (SpecDecoding(spec_config, config.max_num_batched_tokens)
                     if spec_config is not None else None)
        self._groups: dict[str, RequestGroup] = {}
        self._counter = 0
        self.last_step_tokens = 0  # tokens the last step ran (0: nothing was schedulable)
        self._checked_params: SamplingParams | None = None  # the last params that passed
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self.lora: LoRAAdmission | None = (
            setup_lora(config, self.runner, model_config, self.device, self.dtype)
            if config.enable_lora else None)

    @property
    def failure(self) -> BaseException | None:
        """Why the model can no longer run, noticed between steps (a tensor-parallel
        worker that exited); None while it can.  Safe from any thread."""
        return self.runner.failure

    def shutdown(self) -> None:
        """Release the runner's processes (tensor-parallel workers) and write the prefix
        cache's blocks to ``kv_cache_dir`` (waits for the writes, at most 30 s);
        idempotent, also done when the engine is collected or the interpreter exits.
        Steps after it fail with ``ModelFailedError``."""
        if self.kv_disk is not None and self._kv_disk_finalizer.alive:
            self.block_manager.persist()
            self.kv_disk.close(30.0)
            self._kv_disk_finalizer.detach()
        if self.kv_backing is not None:
            self.kv_backing.stop()
        self.runner.shutdown()

    # -------------------------------------------------------------- requests
    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine has no tokenizer: give the prompt as token ids", "prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, if the engine can run this request; else
        ``InvalidRequestError`` naming the field."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", "params")
        prompt_ids = self.encode_prompt(prompt)
        self.validator.check_prompt(prompt_ids)
        if params is not self._checked_params:  # prompts of one batch share their params:
            self.validator.check_params(params)  # O(allowed ids + bias + stops) once
            self._checked_params = params
        return prompt_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> list[int]:
        """Queue a request; it joins the batch at the next step. Returns its prompt ids.

        Everything is checked before anything is queued (``InvalidRequestError``, a
        ``ValueError``, names the field): the prompt and ``params`` against the model
        (``self.validator``) and every sequence id against those in use. ``pooling``
        makes it an embedding request (``params``: one sequence, ``max_tokens=1``).
        """
        params = params or (SamplingParams(max_tokens=1) if pooling is not None
                            else SamplingParams())
        if pooling is not None:
            pool.check_request(pooling, params, self.config.tensor_parallel_size)
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      "request_id")
        prompt_ids = self.validate_request(prompt, params)
        self.check_lora(lora_request)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}"
                                                         for i in range(params.n)]
        taken = next((c for c in child_ids if c in self.scheduler.requests), None)
        if taken is not None:
            raise InvalidRequestError(f"sequence id {taken!r} (of request {request_id!r}) is "
                                      "already in use", "request_id")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        grammar = (self.validator.compile_grammar(params.structured_outputs)
                   if params.structured_outputs is not None else None)  # a cache hit
        children: list[Request] = []
        detoks: list[IncrementalDetokenizer | None] = []
        for i, child_id in enumerate(child_ids):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + i)
            child = Request(child_id, prompt_ids, params, self.eos_token_ids, arrival, gen,
                            group_id=request_id)
            child.grammar = grammar.new_matcher() if grammar is not None else None
            child.lora_request = lora_request
            child.pooling = pooling
            if i == 0 and params.prompt_logprobs is not None:
                child.records_prompt_logprobs = True
                child.num_prompt_logprobs = 1  # position 0 has no logprob
            children.append(child)
            detoks.append(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings,
                                       params.include_stop_str_in_output,
                                       params.skip_special_tokens,
                                       min_tokens=params.min_tokens)
                if self.tokenizer is not None and pooling is None else None
            )
        for child in children:
            if lora_request is not None and self.lora is not None:
                self.lora.add(child)  # joins the scheduler once its adapter is resident
            else:
                self.scheduler.add_request(child)
        self._groups[request_id] = RequestGroup(
            request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params,
            children, detoks, RequestMetrics(arrival), [""] * params.n, [0] * params.n,
            [None] if params.prompt_logprobs is not None else None,
        )
        self.stats.prompt_tokens_total += len(prompt_ids)
        return prompt_ids

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """InvalidRequestError (param ``lora_request``) unless this engine can run the
        adapter: LoRA enabled and the adapter checked against the model (nothing loaded)."""
        check_lora_request(self.lora, lora_request)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are freed at once."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for child in group.children:
            if not child.is_finished:
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.stats.record_finish(child.finish_reason or "abort")
        return True

    def abort_all(self) -> list[str]:
        ids = list(self._groups)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def hold(self, request_ids: frozenset[str]) -> None:
        """Backpressure: do not schedule these requests (their readers are behind) until
        the next ``hold``; they keep their KV blocks (see ``Scheduler``)."""
        self.scheduler.held = request_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return outputs of requests that changed.

        A failure that belongs to a request (its chunk makes the forward raise, its
        logits row is not finite, nothing can be sampled for it, its detokenizer
        raises) fails that request alone, with finish reason ``"error"``; the other
        requests of the step carry on unchanged. ``ModelFailedError`` means the model
        cannot run at all.
        """
        start = time.perf_counter()
        # Sequences whose adapter is now resident join; one that cannot be loaded fails.
        failed: dict[Request, str] = (self.lora.admit(self.scheduler) if self.lora is not None
                                      else {})
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts, taken by schedule()
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.num_tokens
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            return self._make_outputs([], self._fail(failed)) if failed else []
        self.stats.computed_tokens_total += sched.num_tokens
        now = time.monotonic()
        for s in sched.scheduled:
            group = self._groups.get(_group_id(s.request))
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        mask_job = self.structured.start(sched.scheduled)  # None: nothing constrained
        greedy = mask_job is None and self.greedy_step(sched.scheduled)
        scheduled, logits = self._execute(sched.scheduled, failed, greedy)
        masks = self.structured.finish(mask_job, failed) if mask_job is not None else None
        sampled = self.step_sampler.sample(scheduled, logits, failed, masks)
        if mask_job is not None:
            self.structured.advance(scheduled, sampled, failed)
        self._record_prompt_logprobs(scheduled, logits)
        if self.spec is not None:
            self.spec.record(scheduled, sampled, self.stats)
        embedded = pool.accumulate(scheduled, logits, failed)
        failed_groups = self._fail(failed)
        advanced = self.scheduler.update(SchedulerOutput(scheduled), sampled)
        advanced += pool.finish(self.scheduler, embedded)
        outputs = self._make_outputs(advanced, failed_groups)
        if self.spec is not None:  # what a step of this many rows costs: drafts' worth
            self.spec.observe_step(sched.num_tokens, time.perf_counter() - start)
        if self.kv_disk is not None and not self._groups:
            self.block_manager.persist()  # idle: the prefix cache goes to disk (background)
        return outputs

    def greedy_step(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether every row of an unconstrained step is its argmax (no speculation): the
        runner may then give the tokens alone (the same ones)."""
        return self.spec is None and self.step_sampler.greedy_only(scheduled)

    def _execute(self, scheduled: list[ScheduledRequest], failed: dict[Request, str],
                 greedy: bool = False) -> tuple[list[ScheduledRequest], StepLogits | None]:
        """The forward of the step; requests whose chunk makes it raise go to ``failed``."""
        execute = (functools.partial(self.runner.execute, greedy=True) if greedy
                   else self.runner.execute)
        ran, logits, errors = run_isolated(execute, scheduled, self.block_manager)
        for i, why in errors.items():
            failed[scheduled[i].request] = f"the model failed on this request: {why}"
        return ran, logits

    def _record_prompt_logprobs(self, scheduled: list[ScheduledRequest],
                                logits: StepLogits | None) -> None:
        if logits is None:
            return
        for i, chunk_logits in logits.prompt_logits.items():
            req = scheduled[i].request
            group = self._groups.get(_group_id(req))
            if group is not None and group.prompt_logprobs is not None:
                self.logprobs.record_prompt(req, chunk_logits, group.prompt_logprobs)

    def _fail(self, failed: dict[Request, str]) -> set[str]:
        """Finish every sequence of each failed request with ``"error"``; its blocks are
        freed at once. Returns the ids of the failed requests."""
        gids: set[str] = set()
        for req, why in failed.items():
            group = self._groups.get(_group_id(req))
            if group is None:
                continue
            logger.warning("request %s failed: %s", group.request_id, why)
            group.error = group.error or why
            gids.add(group.request_id)
            for child in group.children:
                if not child.is_finished:
                    self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
                    child.error = why
        return gids

    def _make_outputs(self, advanced: list[Request],
                      failed_groups: set[str] = frozenset()) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, dict[int, tuple[str, int]]] = {gid: {} for gid in failed_groups}
        late_failures: dict[Request, str] = {}
        for req in advanced:
            gid = _group_id(req)
            group = self._groups.get(gid)
            if group is None:
                continue
            index = group.children.index(req) if len(group.children) > 1 else 0
            sent = group.sent[index]
            try:
                delta = text_delta(req, group.detoks[index], sent,
                                   self.scheduler.finish_request)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                late_failures[req] = f"detokenizing failed: {describe(exc)}"
                delta = ""
            group.texts[index] += delta
            group.sent[index] = req.num_output_tokens
            self.stats.generation_tokens_total += req.num_output_tokens - sent
            if req.first_token_time is None:
                req.first_token_time = now
            touched.setdefault(gid, {})[index] = (delta, sent)
        for gid in self._fail(late_failures):
            touched.setdefault(gid, {})
        outputs = []
        for gid, deltas in touched.items():
            group = self._groups[gid]
            if group.metrics.first_token_time is None and deltas:
                group.metrics.first_token_time = now
            finished = all(c.is_finished for c in group.children)
            outputs.append(group.output(deltas, finished, now))
            if finished:
                del self._groups[gid]
                for c in group.children:
                    self.stats.record_finish(c.finish_reason or "abort")
        return outputs

    def get_stats(self) -> EngineStats:
        """A snapshot of the counters and gauges (a copy: safe to hand to another thread)."""
        s = copy.copy(self.stats)
        s.finished = dict(self.stats.finished)
        s.spec_decode_accepted_per_pos = list(self.stats.spec_decode_accepted_per_pos)
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting) + (  # sequences waiting for an adapter too
            len(self.lora.pending) if self.lora is not None else 0)
        s.num_held = self.scheduler.num_held
        s.num_free_blocks = self.block_manager.num_free_blocks
        s.num_cached_blocks = self.block_manager.num_cached_blocks
        s.kv_cache_usage = self.block_manager.usage
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        if self.kv_disk is not None:
            d = self.kv_disk.stats
            s.kv_disk_hit_tokens = d.hits * self.block_manager.block_size
            s.kv_disk_misses = d.misses
            s.kv_disk_read_bytes = d.read_bytes
            s.kv_disk_written_bytes = d.written_bytes
            s.kv_disk_rejected = d.rejected
        return s


def _group_id(req: Request) -> str:
    return req.group_id
