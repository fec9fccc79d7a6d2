"""One chat turn, whatever API it came through, -> a validated request in the engine.

``ChatTurn`` is the API-neutral form of a chat request: OpenAI-shaped message dicts
(assistant ``tool_calls``, ``tool`` results, ``reasoning_content``), tool dicts,
``tool_choice``, one structured-output constraint, SamplingParams fields and the chat
template's options. Each HTTP API (chat completions, Responses, Anthropic Messages)
maps its body onto a ``ChatTurn``; ``prepare_chat`` then does, for all of them, what
must happen before the engine sees anything: the prompt's size bound, the tool plan and
its grammar, the chat template, the context check, SamplingParams and the grammar's
compilation. Every failure is an ``APIError`` (400) naming the field through
``ChatTurn.fields``, so an API that calls its messages ``input`` can say so.
``submit_chat`` queues it; ``roseinfer.server.chat_events`` turns its outputs into
API-neutral events.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roseinfer.engine.request_stream import PendingRequest, RequestStream
from roseinfer.lora.request import LoRARequest
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.chat_reader import thinking_start
from roseinfer.server.errors import APIError
from roseinfer.server.prompt_gate import PromptGate, conversation_chars
from roseinfer.server.state import ServerState, make_params
from roseinfer.server.structured import compile_constraint
from roseinfer.server.tools import constrain_tools, plan_tool_dicts
from roseinfer.structured_outputs import StructuredOutputsParams
from roseinfer.tool_calls import ToolPlan

# Template inputs the request sets itself (or that would change how it is rendered).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


@dataclass(frozen=True)
class FieldNames:
    """The request fields errors name (each API's own words)."""

    messages: str = "messages"
    tools: str = "tools"
    tool_choice: str = "tool_choice"
    structured: str = "response_format"  # the field carrying ``ChatTurn.structured``


@dataclass
class ChatTurn:
    """An API-neutral chat request.

    ``messages``: dicts ``{"role": system|developer|user|assistant|tool, "content": str |
    None, "name"?, "tool_call_id"?, "tool_calls"?: [{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}], "reasoning_content"?}``. ``tools``: OpenAI-shaped
    ``{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}``. ``tool_choice``: ``"none" | "auto" | "required" | {"type": "function",
    "function": {"name"}}`` (None: auto with tools). ``sampling``: SamplingParams keyword
    arguments other than ``max_tokens``, ``logprobs`` and ``structured_outputs`` (e.g.
    temperature, top_p, top_k, n, stop, seed, logit_bias). ``max_tokens`` None: what fits.
    ``logprobs``: None for none, else how many top alternatives per token (0: the chosen
    token's only).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    structured: StructuredOutputsParams | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    strict_tool_arguments: bool | None = None  # None: the server's default
    fields: FieldNames = FieldNames()


@dataclass
class PreparedChat:
    """A checked chat request, ready to queue: its prompt, params and how to read its
    output (tool calls when ``plan.active``; reasoning when ``reasoning`` is set)."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    top_n: int | None  # logprobs: alternatives per token (None: no logprobs)
    reasoning: bool = False  # a thinking model: a <think> block opening the output is reasoning
    thinking_open: bool = False  # the prompt ended inside <think>: the output starts as reasoning
    arrival: float = field(default_factory=time.monotonic)

    @property
    def tools_active(self) -> bool:
        return self.plan.active

    @property
    def n(self) -> int:
        return self.params.n


def _check_turn(state: ServerState, gate: PromptGate, turn: ChatTurn) -> ToolPlan:
    """The checks before any template or grammar work: size, options, the tool plan."""
    names = turn.fields
    gate.check_chars(state, conversation_chars(turn.messages, turn.tools), names.messages)
    reserved = set(turn.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}: "
                       "the request's own fields do", param="chat_template_kwargs")
    if turn.continue_final_message and turn.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                       "be true", param="continue_final_message")
    if turn.continue_final_message and (not turn.messages
                                        or turn.messages[-1].get("role") != "assistant"):
        raise APIError(400, "continue_final_message needs an assistant message last",
                       param="continue_final_message")
    return plan_tool_dicts(turn.tools, turn.tool_choice, turn.parallel_tool_calls, names)


async def _render(state: ServerState, gate: PromptGate, turn: ChatTurn,
                  plan: ToolPlan) -> tuple[list[int], str]:
    return await gate.render_conversation(
        state, turn.messages, tools=plan.tools if plan.active else None,
        param=turn.fields.messages, add_generation_prompt=turn.add_generation_prompt,
        continue_final_message=turn.continue_final_message,
        template_kwargs=turn.chat_template_kwargs)


async def count_chat_tokens(state: ServerState, gate: PromptGate, turn: ChatTurn) -> int:
    """The prompt tokens ``turn`` would have (its tools shown as ``prepare_chat`` shows
    them); nothing is compiled nor queued."""
    plan = _check_turn(state, gate, turn)
    ids, _ = await _render(state, gate, turn, plan)
    return len(ids)


async def prepare_chat(state: ServerState, gate: PromptGate, turn: ChatTurn,
                       arrival: float | None = None) -> PreparedChat:
    """``turn`` checked, rendered and compiled (an ``APIError`` 400 on any problem);
    nothing is queued yet. ``arrival``: when the request came (default: now)."""
    names = turn.fields
    plan = _check_turn(state, gate, turn)
    strict = state.settings.strict_tool_arguments if turn.strict_tool_arguments is None \
        else turn.strict_tool_arguments
    constraints = dict(turn.sampling)
    if turn.structured is not None:  # compiled alone first: its errors name its field
        await compile_constraint(state, turn.structured, names.structured)
        constraints["structured_outputs"] = turn.structured
    constraints = await constrain_tools(plan, state.validator, constraints, names,
                                        strict=strict, other_param=names.structured,
                                        tokenizer=state.engine.engine.tokenizer)
    prompt_ids, prompt_text = await _render(state, gate, turn, plan)
    max_tokens = state.check_prompt(prompt_ids, turn.max_tokens, names.messages)
    params = make_params(SamplingParams, max_tokens=max_tokens, logprobs=turn.logprobs,
                         **constraints)
    reasoning, inside = thinking_start(state.engine.engine.tokenizer, prompt_text)
    return PreparedChat(prompt_ids, params, plan, turn.logprobs, reasoning, inside,
                        time.monotonic() if arrival is None else arrival)


def submit_chat(state: ServerState, prepared: PreparedChat, request_id: str,
                lora_request: LoRARequest | None = None) -> RequestStream:
    """Queue ``prepared`` as ``request_id`` (503 when the queue is full), with the LoRA
    adapter its ``model`` named (``routes_lora.resolve_model``; None: the base model)."""
    return state.submit([PendingRequest(request_id, prepared.prompt_ids, prepared.params,
                                        arrival_time=prepared.arrival,
                                        lora_request=lora_request)])
