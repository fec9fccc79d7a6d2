"""Structured outputs on the real default model (LLM() with defaults).

Twenty-odd JSON schemas (nested objects, arrays with minItems / maxItems, enums, string
patterns, number bounds, anyOf, additionalProperties: false) run as ONE batch: every
output must be complete, parse, and validate with ``jsonschema``; a few also run through
``LLM.stream``, whose deltas must add up to the generated text; and the CLI flags work
(each parsed into its constraint; the command itself runs once).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from roseinfer.cli import _sampling_params as cli_sampling_params
from roseinfer.cli import build_parser
from roseinfer.llm import LLM
from roseinfer.outputs import RequestOutput
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.slow  # default model or real servers: `make test-fast` skips it

MAX_TOKENS = 160


def obj(props: dict[str, Any], required: list[str] | None = None, **extra) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": NAME, "country": NAME,
                    "population": {"type": "integer", "minimum": 0, "maximum": 50000000}})),
    ("a colour", obj({"colour": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("three fruits", obj({"fruits": {"type": "array", "items": NAME, "minItems": 3,
                                     "maxItems": 3}})),
    ("a book", obj({"title": NAME, "author": obj({"first": NAME, "last": NAME}),
                    "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a yes or no answer", obj({"answer": {"type": "boolean"}})),
    ("a shopping list", obj({"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                       "items": obj({"item": NAME, "qty": {
                                           "type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("a point", obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                     "y": {"type": "integer", "minimum": -100, "maximum": 100}})),
    ("an id or null", obj({"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                              "maximum": 9999}, {"type": "null"}]}})),
    ("a status", obj({"status": {"enum": ["ok", "error", "pending"]},
                      "code": {"type": "integer", "minimum": 100, "maximum": 599}})),
    ("a date", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("an animal", obj({"animal": NAME, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                       "can_fly": {"type": "boolean"}})),
    ("a movie rating", obj({"movie": NAME, "stars": {"type": "number", "minimum": 0,
                                                     "maximum": 5}})),
    ("two tags", obj({"tags": {"type": "array", "items": {"enum": ["news", "sport", "tech",
                                                                     "art"]},
                               "minItems": 2, "maxItems": 2}})),
    ("a user", obj({"user": obj({"name": NAME, "email": {
        "type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}),
        "active": {"type": "boolean"}})),
    ("a price", obj({"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                     "currency": {"enum": ["USD", "EUR", "GBP"]}})),
    ("a matrix", obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
    ("a value that is a word or a number", obj({"value": {"anyOf": [
        NAME, {"type": "integer", "minimum": 0, "maximum": 100}]}})),
    ("a country with optional capital", obj({"country": NAME, "capital": NAME},
                                            required=["country"])),
    ("weather", obj({"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                     "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                     "humid": {"type": "boolean"}})),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def params_for(schema: dict[str, Any], compact: bool = True) -> SamplingParams:
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)


def conversation(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me {what} as JSON."}]


@pytest.fixture(scope="module")
def batch(llm: LLM) -> list[RequestOutput]:
    """Every schema's conversation in ONE batch (every fourth in the default JSON
    whitespace, the others compact)."""
    return llm.chat([conversation(what) for what, _ in SCHEMAS],
                    [params_for(schema, compact=i % 4 != 0)
                     for i, (_, schema) in enumerate(SCHEMAS)])


def test_twenty_schemas_in_one_batch_all_validate(batch: list[RequestOutput]) -> None:
    assert len(SCHEMAS) >= 20
    for (what, schema), out in zip(SCHEMAS, batch, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (what, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_stream_equals_generate(llm: LLM, batch: list[RequestOutput]) -> None:
    """The stream's deltas add up to the text generated in the batch (the same prompt and
    parameters: the default engine is batch invariant)."""
    for i in (0, 8, 16):
        what, schema = SCHEMAS[i]
        prompt = llm.render_chat(conversation(what))
        full = batch[i].outputs[0]
        assert list(batch[i].prompt_token_ids) == list(prompt)
        assert "".join(llm.stream(prompt, params_for(schema, compact=False))) == full.text
        jsonschema.validate(json.loads(full.text), schema)


def test_regex_choice_and_sampling(llm: LLM) -> None:
    prompt = llm.render_chat([{"role": "user", "content": "Is the sky blue?"}])
    outs = llm.generate([prompt] * 3, [
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0.8, seed=1, max_tokens=16, n=4,
                       structured_outputs=StructuredOutputsParams(regex=r"(Yes|No), [a-z ]{3,20}\.")),
        SamplingParams(temperature=0.0, max_tokens=32,
                       structured_outputs=StructuredOutputsParams(json_object=True))])
    assert outs[0].outputs[0].text in ("yes", "no")
    for c in outs[1].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"(Yes|No), [a-z ]{3,20}\.", c.text)
    if outs[2].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].outputs[0].text), dict)


def test_cli_flags(llm: LLM, tmp_path) -> None:  # noqa: ANN001
    """Each flag gives its constraint (parsed by the CLI's own parser into its sampling
    parameters, run on the module's engine); the command runs end to end once (the
    schema read from a file); a bad regex is a usage error."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[2][1]))
    checks = [(["--choice", "yes", "no"], lambda t: t in ("yes", "no")),
              (["--regex", "[0-9]{2}"], lambda t: re.fullmatch("[0-9]{2}", t)),
              (["--json-schema", str(schema)],
               lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2][1]) is None)]
    command = ["generate", "--chat", "--prompt", "Pick one.", "--max-tokens", "24"]
    prompt = llm.render_chat([{"role": "user", "content": "Pick one."}])
    for flags, check in checks:
        params = cli_sampling_params(build_parser().parse_args([*command, *flags]))
        text = llm.generate([prompt], params)[0].outputs[0].text
        assert check(text.strip()), (flags, text)
    flags, check = checks[-1]
    res = subprocess.run([sys.executable, "-m", "roseinfer.cli", *command, *flags],
                         capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr
    assert check(res.stdout.strip()), res.stdout
    res = subprocess.run([sys.executable, "-m", "roseinfer.cli", "generate", "--prompt", "x",
                          "--regex", "a(b"], capture_output=True, text=True, timeout=240,
                         check=False)
    assert res.returncode == 2 and "structured_outputs" in res.stderr
