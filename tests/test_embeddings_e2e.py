"""POST /v1/embeddings end to end: ``weft serve`` on the real default model, the official client.

The session's shared server (``default_server``: one local engine core, pooler auto, so last
token for this decoder model). Vectors are checked for what they must be (unit length, the
model's width, the same text giving the same vector however it is sent), not against an oracle
(``tests/test_embeddings_oracle.py`` does that offline).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest

from services.api.limits import DEFAULT_MAX_PROMPTS
from services.api.tokenizer import Tokenizer
from services.model_files import resolve

pytestmark = pytest.mark.slow

MODEL = resolve(None)
HIDDEN_SIZE = MODEL.hf_config()["hidden_size"]
TEXTS = ["The capital of France is Paris.", "Bananas are yellow.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL.hf_dir)


def assert_same_vectors(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to the kernels' rounding: a batched step may run other kernels (int8 GEMMs on the
    quantized model) than a single prompt's, so the bits differ, the directions do not."""
    assert actual.shape == expected.shape
    cosine = np.sum(actual * expected, axis=-1)  # both unit length
    assert np.all(1.0 - cosine < 1e-4), cosine


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float32)


def test_one_input_gives_one_unit_vector_of_the_model_width(client, model, tokenizer):
    response = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert response.object == "list" and response.model == model
    assert [(d.object, d.index) for d in response.data] == [("embedding", 0)]
    vector = vectors(response)[0]
    assert vector.shape == (HIDDEN_SIZE,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    num_tokens = len(tokenizer.encode(TEXTS[0]))
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)


def test_a_batch_keeps_its_order_and_each_input_its_own_vector(client, model, tokenizer):
    batch = vectors(client.embeddings.create(model=model, input=TEXTS, encoding_format="float"))
    one = [vectors(client.embeddings.create(model=model, input=t, encoding_format="float"))[0] for t in TEXTS]
    assert_same_vectors(batch, np.stack(one))
    # Paraphrases lie closer together than unrelated sentences.
    assert batch[0] @ batch[2] > batch[0] @ batch[1]
    response = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    expected = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == expected


def test_base64_is_little_endian_float32_of_the_float_vector(client, model):
    # One input, alone in its steps, runs the same kernels each time: the bits must match. (Two
    # inputs may share a step or not, as they reach the engine: then only the directions must.)
    floats = vectors(client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float"))
    encoded = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(encoded.data[0].embedding), dtype="<f4")
    np.testing.assert_array_equal(decoded, floats[0])
    # The SDK's own default asks for base64 and decodes it.
    np.testing.assert_array_equal(vectors(client.embeddings.create(model=model, input=TEXTS[0])), floats)
    batch = client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in batch.data])
    floats = vectors(client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="float"))
    assert_same_vectors(decoded, floats)


def test_token_ids_embed_as_their_text(client, model, tokenizer):
    text = vectors(client.embeddings.create(model=model, input=TEXTS[:2], encoding_format="float"))
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    assert_same_vectors(vectors(one)[0], text[0])
    several = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert_same_vectors(vectors(several), text)
    assert several.usage.prompt_tokens == sum(len(i) for i in ids)


def test_dimensions_at_the_model_width_and_user_are_accepted(client, model):
    response = client.embeddings.create(
        model=model, input=TEXTS[0], dimensions=HIDDEN_SIZE, user="alice", encoding_format="float"
    )
    assert len(response.data[0].embedding) == HIDDEN_SIZE


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["x"] * (DEFAULT_MAX_PROMPTS + 1)}, "input"),
        ({"input": "x", "dimensions": 16}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "model": "not-this-one"}, "model"),
        ({"input": [10**6]}, "input"),
    ],
    ids=["empty", "empty-list", "empty-ids", "too-many", "dimensions", "encoding", "model", "token-id"],
)
def test_bad_requests_are_400s_naming_the_field(client, model, kwargs, param):
    kwargs.setdefault("model", model)
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(**kwargs)
    assert error.value.body["param"] == param, error.value.message


def test_an_unknown_field_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=model, input="x", extra_body={"pooling": "cls"})
    assert "pooling" in error.value.message


def test_embeddings_and_a_completion_in_flight_together(default_server, model):
    async def scenario():
        client = openai.AsyncOpenAI(
            base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        stream = await client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=48,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = stream.__aiter__()
        first = await chunks.__anext__()  # the completion is running in the engine now
        embedding = await client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        rest = [chunk async for chunk in chunks]
        await client.close()
        return first, rest, embedding

    first, rest, embedding = asyncio.run(scenario())
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert text
    assert len(embedding.data) == len(TEXTS)
    assert all(np.linalg.norm(d.embedding) == pytest.approx(1.0, abs=1e-5) for d in embedding.data)
