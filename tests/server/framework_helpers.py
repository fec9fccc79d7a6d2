"""What the agent-framework tests share: the default-model server's settings as the
frameworks pass them, a recorded tool, the structured answer's pydantic model, and the
clients each framework is given (one per test: an async client is bound to the event
loop it first ran in)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import openai
from agents import AgentHooks
from pydantic import BaseModel, Field

from tests.server.helpers import MODEL_NAME

MAX_TOKENS = 64
TOOL_RESULT = "sunny, 21 C"
PROMPT = "What is the weather in Paris?"


class Weather(BaseModel):
    """The structured answer: bounded, so any model completes it well within budget."""

    city: str = Field(max_length=12)
    temp: int = Field(ge=-50, le=50)


class WeatherTool:
    """A ``get_weather`` tool that records every execution."""

    def __init__(self) -> None:
        self.cities: list[str] = []

    def function(self) -> Callable[[Literal["Paris", "Rome"]], str]:
        def get_weather(city: Literal["Paris", "Rome"]) -> str:
            """Weather in a city."""
            self.cities.append(city)
            return TOOL_RESULT

        return get_weather


class ForceToolOnce(AgentHooks):
    """openai-agents' turns as pydantic-ai's ``_force_tool_once``: the named tool on a
    run's first turn, the answer (``tool_choice`` none) after the tool ran. The SDK's own
    reset leaves ``auto``, where the default model keeps calling the tool until
    ``max_turns`` (the model's choice, not the protocol's)."""

    def __init__(self, tool: str) -> None:
        self.tool = tool

    async def on_start(self, context: Any, agent: Any) -> None:
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=self.tool)

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")


def sampling(bias: dict[str, int]) -> dict[str, Any]:
    """Greedy, bounded, and no whitespace tokens: a small model may otherwise spend a
    JSON answer's budget on the whitespace JSON allows (sent as ``extra_body``)."""
    return {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"logit_bias": bias}}


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@contextmanager
def litellm_offline() -> Iterator[None]:
    """litellm reads its model-cost map from the package, never the network."""
    old = os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP")
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LITELLM_LOCAL_MODEL_COST_MAP", None)
        else:
            os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = old


__all__ = ["ForceToolOnce", "MAX_TOKENS", "MODEL_NAME", "PROMPT", "TOOL_RESULT", "Weather", "WeatherTool",
           "async_client", "litellm_offline", "sampling"]
