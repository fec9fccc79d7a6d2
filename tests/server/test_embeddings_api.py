"""POST /v1/embeddings through a real uvicorn with the official openai client: strings,
lists, token ids, float and base64, ``dimensions``, and OpenAI-shaped errors."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from tests.engine.tiny_models import tiny_hf_llama
from tests.server.tokenizer_server import MAX_POSITIONS, MODEL_NAME, VOCAB_SIZE

HIDDEN = 64  # tiny_hf_llama's hidden size




def test_string_matches_hf_and_shape(ts, client):
    res = client.embeddings.create(model=MODEL_NAME, input="The quick brown fox",
                                   encoding_format="float")
    assert res.object == "list" and res.model == MODEL_NAME
    assert len(res.data) == 1 and res.data[0].object == "embedding" and res.data[0].index == 0
    ids = ts.engine.tokenizer.encode("The quick brown fox")
    assert res.usage.prompt_tokens == res.usage.total_tokens == len(ids)
    hf = tiny_hf_llama(vocab=VOCAB_SIZE, max_positions=MAX_POSITIONS)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    want = torch.nn.functional.normalize(h, dim=0)
    torch.testing.assert_close(torch.tensor(res.data[0].embedding), want, atol=1e-5, rtol=1e-4)


def test_list_token_ids_and_base64(ts, client):
    texts = ["hello there", "a second, longer input for the batch"]
    floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    b64 = client.embeddings.create(model=MODEL_NAME, input=texts)  # the SDK asks for base64
    assert [d.index for d in floats.data] == [0, 1]
    for f, b in zip(floats.data, b64.data, strict=True):
        assert len(f.embedding) == HIDDEN
        assert b.embedding == f.embedding  # float32 bytes decoded by the SDK: the same values
    ids = [ts.engine.tokenizer.encode(t) for t in texts]
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    assert one.data[0].embedding == floats.data[0].embedding
    assert [d.embedding for d in many.data] == [d.embedding for d in floats.data]
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_dimensions(client):
    full = client.embeddings.create(model=MODEL_NAME, input="truncate me",
                                    encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=MODEL_NAME, input="truncate me", dimensions=16,
                                     user="someone").data[0].embedding
    assert len(short) == 16
    norm = math.sqrt(sum(x * x for x in full[:16]))
    assert short == pytest.approx([x / norm for x in full[:16]], abs=1e-6)
    assert math.sqrt(sum(x * x for x in short)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [5] * MAX_POSITIONS}, "input"),
    ({"input": [VOCAB_SIZE]}, "input"),
    ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "pooling": "cls"}, "pooling"),
])
def test_errors(ts, body, param):
    r = httpx.post(f"{ts.url}/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_error_through_sdk(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL_NAME, input="")
    assert exc.value.body["param"] == "input"
