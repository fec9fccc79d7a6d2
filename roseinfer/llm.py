"""LLM: the offline batch API over the engine (``LLM(model).generate(prompts, params)``).

Constrained outputs go through ``SamplingParams`` like everything else::

    from roseinfer.structured_outputs import StructuredOutputsParams
    params = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"name": {"type": "string"}}}))
    llm.chat([{"role": "user", "content": "Who are you? Answer in JSON."}], params)

A schema / regex / grammar that cannot be compiled raises ``InvalidRequestError``
(``param == "structured_outputs"``) before any prompt is queued.

Embeddings: ``llm.embed(prompts, PoolingParams(pooling="last"))`` pools each prompt's
final hidden states (mean by default, L2-normalized) into ``EmbeddingOutput.embedding``.

Tools are OpenAI-shaped, as on the server (``roseinfer.tool_calls``)::

    out = llm.chat(messages, params, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {...}}}], tool_choice="required")
    out[0].outputs[0].tool_calls  # (ToolCall(id, name, arguments: JSON text), ...)

LoRA adapters (PEFT directories; ``enable_lora=True``), one per prompt or one for all,
None for the base model; a batch mixes them (docs/lora.md)::

    llm = LLM(model, enable_lora=True, max_loras=4)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from roseinfer.config import EngineConfig
from roseinfer.engine.engine import LLMEngine
from roseinfer.lora.request import LoRARequest
from roseinfer.outputs import EmbeddingOutput, RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.tool_calls import Tool, chat_prompt_ids, plan_tools, tool_constraint, with_tool_calls

Prompt = str | list[int]
Message = Mapping[str, Any]


class LLM:
    """Offline inference: ``LLM(model=None, **engine_options)``.

    ``model`` is an HF directory, a .gguf or a .pt file; None serves the bundled
    SmolLM2-135M-Instruct. Engine options are the fields of ``EngineConfig``
    (``tensor_parallel_size=2`` splits the model over two processes;
    ``kv_cache_dir="~/.cache/roseinfer/kv"`` keeps prompt prefixes on disk across runs:
    ``shutdown()``, or ``with LLM(...)``, waits for their writes).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size`` > 1); idempotent.
        Also done when the engine is collected or at exit, and by ``with LLM(...)``."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):  # noqa: ANN201 - the model's Tokenizer (or None)
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuously batched); outputs in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt.

        Every prompt is validated before any is queued. A request that fails while
        stepping comes back with finish reason ``"error"`` and ``.error`` set; the
        others are unaffected.
        """
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        for prompt, p, lora in zip(prompt_list, param_list, lora_list, strict=True):
            self.engine.validate_request(prompt, p)  # every prompt before any is queued
            self.engine.check_lora(lora)
        return self._run(prompt_list, param_list, lora_list, None)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """The embedding of every prompt (batched like ``generate``), in prompt order.
        Raises ``RuntimeError`` if a prompt failed in the engine."""
        prompt_list = _as_prompt_list(prompts)
        pooling = pooling or PoolingParams()
        params = SamplingParams(max_tokens=1)
        for prompt in prompt_list:
            self.engine.validate_request(prompt, params)
        outs = self._run(prompt_list, [params] * len(prompt_list), [None] * len(prompt_list),
                         pooling)
        result = []
        for out in outs:
            if out.embedding is None:
                raise RuntimeError(f"embedding {out.request_id} failed: {out.error}")
            result.append(EmbeddingOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                          out.embedding))
        return result

    def _run(self, prompt_list: list[Prompt], param_list: Sequence[SamplingParams],
             lora_list: Sequence[LoRARequest | None],
             pooling: PoolingParams | None) -> list[RequestOutput]:
        """Queue every request, step until all finished; aborts them all on an error."""
        ids = []
        try:
            for prompt, p, lora in zip(prompt_list, param_list, lora_list, strict=True):
                rid = self.engine.next_request_id()
                self.engine.add_request(rid, prompt, p, lora_request=lora, pooling=pooling)
                ids.append(rid)
            finals: dict[str, RequestOutput] = {}
            while len(finals) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [finals[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate.

        ``tools`` (OpenAI's ``{"type": "function", "function": {"name", "description",
        "parameters"}}``), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls``
        work as on the server: the tools are shown to the model, calls are constrained to
        ``<tool_call>`` blocks whose arguments match the tool's schema, and each output
        carries ``tool_calls`` (``text`` is the content outside them; ``finish_reason``
        is ``"tool_calls"`` when it stopped after making calls). Messages may be
        assistant turns with ``tool_calls`` and ``tool`` turns with ``tool_call_id``.
        Bad tools, or tools with ``params.structured_outputs``, raise
        ``InvalidRequestError`` naming ``tools`` / ``tool_choice``.
        """
        conversations = ([messages] if messages and isinstance(messages[0], Mapping)
                         else messages)
        plan = plan_tools(tools, None if not tools and tool_choice == "auto" else tool_choice,
                          parallel_tool_calls)
        param_list = _as_param_list(params, len(conversations))
        constrained = any(p.structured_outputs is not None for p in param_list)
        spec = tool_constraint(plan, self.engine.validator.compile_grammar,
                               "SamplingParams.structured_outputs" if constrained else None)
        if spec is not None:  # one constrained copy of each distinct params
            swapped = {id(p): replace(p, structured_outputs=spec) for p in param_list}
            param_list = [swapped[id(p)] for p in param_list]
        shown = plan.tools if plan.active else None
        prompts = [self.render_chat(conv, shown) for conv in conversations]  # type: ignore[arg-type]
        outs = self.generate(prompts, param_list)
        return [with_tool_calls(o) for o in outs] if plan.active else outs

    def render_chat(self, messages: Sequence[Message],
                    tools: Sequence[Tool] | None = None) -> list[int]:
        """Prompt ids of a conversation (with ``tools`` shown to the model)."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return chat_prompt_ids(self.engine.tokenizer, messages, tools)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as they are produced.

        Other requests already in the engine keep running alongside it.
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() takes one sequence: SamplingParams.n must be 1")
        rid = self.engine.next_request_id()
        self.engine.add_request(rid, prompt, params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.error is not None:
                        done = True
                        raise RuntimeError(f"request {rid} failed: {out.error}")
                    if out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
                    done = out.finished
        finally:
            if not done:
                self.engine.abort_request(rid)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]  # one prompt of token ids
    return prompts  # type: ignore[return-value]


def _as_param_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
                  ) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA requests for {n} prompts")
    return lora
