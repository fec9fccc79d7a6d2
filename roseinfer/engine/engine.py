"""LLMEngine: the synchronous core — schedule, run, sample, update (no I/O).

``step()`` does one iteration for all requests in flight: the scheduler picks
the tokens to compute, the model runner runs them in ONE forward, the sampler
picks one token per request whose tokens were all computed, the scheduler
appends them and finishes requests on EOS / stop ids / length, and the
detokenizers turn new ids into text deltas (finishing requests on stop strings).
A request with ``n > 1`` runs as n sequences that share the prompt's KV blocks
through the prefix cache; its outputs are grouped back under one request id.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from roseinfer.config import EngineConfig
from roseinfer.engine.block_manager import BlockManager
from roseinfer.engine.detokenizer import IncrementalDetokenizer
from roseinfer.engine.request import Request, RequestStatus
from roseinfer.engine.scheduler import Scheduler, SchedulerOutput
from roseinfer.engine.stats import EngineStats
from roseinfer.model.config import ModelConfig
from roseinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from roseinfer.runner.model_runner import ModelRunner, StepLogits, kv_bytes_per_block
from roseinfer.runner.sampler import Sampler, SamplingBatch
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(eq=False)
class _Group:
    """One user request: its n sequences, their detokenizers and what was sent so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    texts: list[str] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
        if model is None:
            from roseinfer.model.factory import load_model

            model, model_config, source = load_model(config.model, self.dtype, self.device)
            tokenizer = tokenizer or Tokenizer.from_model_path(source)
        elif model_config is None:
            raise ValueError("model_config is required when a model object is given")
        assert model_config is not None
        self.quantization = config.resolved_quantization(self.device.type)
        if self.quantization != "none":
            from roseinfer.model.quantize import quantize_model

            quantize_model(model, self.quantization)
        self.kv_dtype = _TORCH_DTYPES[config.resolved_kv_cache_dtype(self.device.type)]
        self.model_config = model_config
        self.tokenizer = tokenizer

        block_size = config.block_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            per_block = kv_bytes_per_block(model_config, block_size, self.kv_dtype)
            num_blocks = max(1, int(config.kv_cache_memory_gb * (1 << 30)) // per_block)
        capacity = num_blocks * block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings, capacity)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(model, model_config, num_blocks, block_size, self.kv_dtype,
                                  self.device)
        unseeded_rng = torch.Generator(device=self.device)
        unseeded_rng.manual_seed(config.seed)
        self.sampler = Sampler(unseeded_rng)  # RNG of requests without their own seed
        self.eos_token_ids: tuple[int, ...] = (
            tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        ) or tuple(model_config.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._counter = 0
        self.stats = EngineStats(num_total_blocks=num_blocks)

    # -------------------------------------------------------------- requests
    def next_request_id(self) -> str:
        self._counter += 1
        return f"req-{self._counter}"

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Queue a request; it joins the batch at the next step. Returns its prompt ids."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.encode_prompt(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children: list[Request] = []
        detoks: list[IncrementalDetokenizer | None] = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, prompt_ids, params, self.eos_token_ids, arrival, gen,
                                    group_id=request_id))
            detoks.append(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                       params.include_stop_str_in_output,
                                       params.skip_special_tokens)
                if self.tokenizer is not None else None
            )
        for child in children:
            self.scheduler.add_request(child)
        self._groups[request_id] = _Group(
            request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params,
            children, detoks, RequestMetrics(arrival), [""] * params.n,
            [None] if params.prompt_logprobs is not None else None,
        )
        self.stats.prompt_tokens_total += len(prompt_ids)
        return prompt_ids

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

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; return outputs of requests that changed."""
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            return []
        self.stats.computed_tokens_total += sched.num_tokens
        now = time.monotonic()
        for s in sched.scheduled:
            group = self._groups.get(_group_id(s.request))
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        logits = self.runner.execute(sched.scheduled)
        sampled = self._sample(sched, logits)
        self._record_prompt_logprobs(sched, logits)
        advanced = self.scheduler.update(sched, sampled)
        self.stats.generation_tokens_total += len(advanced)
        return self._make_outputs(advanced)

    def _sample(self, sched: SchedulerOutput, logits: StepLogits) -> list[int | None]:
        completing = [s.request for s in sched.scheduled if s.completes]
        result: list[int | None] = [None] * len(sched.scheduled)
        if not completing:
            return result
        suppress = [
            list(r.eos_token_ids if not r.params.ignore_eos else ()) + list(r.params.stop_token_ids)
            if r.num_output_tokens < r.params.min_tokens else []
            for r in completing
        ]
        batch = SamplingBatch.from_requests(
            [r.params for r in completing], [r.prompt_token_ids for r in completing],
            [r.output_token_ids for r in completing], [r.generator for r in completing],
            suppress, self.model_config.vocab_size, self.device,
        )
        out = self.sampler(logits.sample_logits, batch)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        tops = None
        if out.top_logprobs is not None:
            tops = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist())
        for k, req in enumerate(completing):
            if req.params.logprobs is not None and lps is not None:
                n = req.params.logprobs
                top = list(zip(tops[0][k][:n], tops[1][k][:n], strict=True)) if tops else []
                req.output_logprobs.append(self._logprob_entry(tokens[k], lps[k], top))
                req.cumulative_logprob += lps[k]
        it = iter(tokens)
        for i, s in enumerate(sched.scheduled):
            if s.completes:
                result[i] = next(it)
        return result

    def _record_prompt_logprobs(self, sched: SchedulerOutput, logits: StepLogits) -> None:
        for i, chunk_logits in logits.prompt_logits.items():
            req = sched.scheduled[i].request
            group = self._groups.get(_group_id(req))
            if group is None or group.prompt_logprobs is None or req is not group.children[0]:
                continue
            start = req.num_computed_tokens
            targets = req.all_token_ids[start + 1:start + 1 + chunk_logits.shape[0]]
            targets = targets[: max(0, req.num_prompt_tokens - start - 1)]
            if not targets:
                continue
            lp = torch.log_softmax(chunk_logits[: len(targets)], dim=-1)  # [n, V]
            tgt = torch.tensor(targets, device=lp.device)
            chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
            ranks = (lp > lp.gather(1, tgt[:, None])).sum(-1).add(1).tolist()
            n = req.params.prompt_logprobs or 0
            top_v, top_i = lp.topk(n, dim=-1) if n else (None, None)
            for j, tok in enumerate(targets):
                entry = {tok: Logprob(chosen[j], ranks[j], self._piece(tok))}
                if n:
                    for r, (tid, v) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist(),
                                                     strict=True)):
                        entry.setdefault(tid, Logprob(v, r + 1, self._piece(tid)))
                group.prompt_logprobs.append(entry)

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_outputs(self, advanced: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, dict[int, tuple[str, int]]] = {}
        for req in advanced:
            gid = _group_id(req)
            group = self._groups.get(gid)
            if group is None:
                continue
            index = group.children.index(req) if len(group.children) > 1 else 0
            delta = ""
            detok = group.detoks[index]
            if detok is not None:
                upd = detok.add_tokens([req.output_token_ids[-1]])
                delta = upd.delta
                if upd.stop_matched is not None and not req.is_finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    req.stop_reason = upd.stop_matched
                elif req.is_finished:
                    delta += detok.finish()
            group.texts[index] += delta
            if req.first_token_time is None:
                req.first_token_time = now
            touched.setdefault(gid, {})[index] = (delta, req.output_token_ids[-1])
        outputs = []
        for gid, deltas in touched.items():
            group = self._groups[gid]
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            finished = all(c.is_finished for c in group.children)
            outputs.append(self._group_output(group, deltas, finished, now))
            if finished:
                del self._groups[gid]
                for c in group.children:
                    self.stats.record_finish(c.finish_reason or "abort")
        return outputs

    def _group_output(self, group: _Group, deltas: dict[int, tuple[str, int]],
                      finished: bool, now: float) -> RequestOutput:
        outs = []
        for i, child in enumerate(group.children):
            delta_text, delta_tok = deltas.get(i, ("", None))
            logprobs = None
            delta_lp = None
            if child.params.logprobs is not None:
                logprobs = child.output_logprobs  # built once per token in _sample
                delta_lp = logprobs[-1:] if delta_tok is not None else []
            outs.append(CompletionOutput(
                index=i, text=group.texts[i], token_ids=child.output_token_ids,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=child.cumulative_logprob if logprobs is not None else None,
                delta_text=delta_text,
                delta_token_ids=[delta_tok] if delta_tok is not None else [],
                delta_logprobs=delta_lp,
            ))
        if finished:
            group.metrics.finished_time = now
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=outs, finished=finished,
            num_cached_tokens=group.children[0].num_cached_tokens, metrics=group.metrics,
            prompt_logprobs=group.prompt_logprobs,
        )

    def _logprob_entry(self, token_id: int, logprob: float,
                       top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """The sampled token's Logprob plus the top-N alternatives, keyed by token id."""
        rank_of = {tid: r + 1 for r, (tid, _) in enumerate(top)}
        entry = {token_id: Logprob(logprob, rank_of.get(token_id), self._piece(token_id))}
        for r, (tid, v) in enumerate(top):
            entry.setdefault(tid, Logprob(v, r + 1, self._piece(tid)))
        return entry

    def get_stats(self) -> EngineStats:
        """A snapshot of the counters and gauges (a copy: safe to hand to another thread)."""
        s = copy.copy(self.stats)
        s.finished = dict(self.stats.finished)
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_free_blocks = self.block_manager.num_free_blocks
        s.num_cached_blocks = self.block_manager.num_cached_blocks
        s.kv_cache_usage = self.block_manager.usage
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        return s


def _group_id(req: Request) -> str:
    return req.group_id
