"""Nothing a client sends gets a 5xx: 1,000 random and malformed bodies."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.api.api_options import APIOptions
from tests.api.fake_engine_client import MODEL_NAME, engine_config, http_client, make_app

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

# Kept small so that the valid bodies among the random ones finish fast.
FUZZ_MAX_MODEL_LEN = 64

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, ""])
)
json_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)

_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool"]),
            "content": st.text(max_size=30)
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2
            ),
        }
    ),
    min_size=1,
    max_size=3,
)

# Values each field may validly hold (some still refused in combination,
# e.g. min_tokens > max_tokens); the junk branch below covers the rest.
FIELDS = {
    "model": st.just(MODEL_NAME),
    "prompt": st.text(min_size=1, max_size=40)
    | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
    | st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=3),
    "messages": _messages,
    "max_tokens": st.integers(1, 30) | st.none(),
    "max_completion_tokens": st.integers(1, 30) | st.none(),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.integers(0, 20) | st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 60000), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "priority": st.just(0),
    "cache_salt": st.text(min_size=1, max_size=5),
    "user": st.text(max_size=5),
    "unknown_extra": json_values,
}
_junk = json_values | st.integers(-100, 100) | st.floats().filter(lambda x: x == x and abs(x) != float("inf"))
_field_names = sorted(FIELDS)

# A body both endpoints accept (each ignores the other's prompt field).
VALID = {
    "model": MODEL_NAME,
    "prompt": "Hello",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 4,
}


def _body(changes: dict, dropped: set, stream: bool = False) -> bytes:
    body = {**VALID, "stream": stream, **changes}
    return json.dumps({k: v for k, v in body.items() if k not in dropped}).encode()


def field_changes(fields: dict) -> st.SearchStrategy[dict]:
    """Up to six of ``fields``, each with a value from its strategy."""
    # Drawn in sorted order: a set's order follows PYTHONHASHSEED, and a derandomized
    # fuzz must draw the same requests every run.
    return st.sets(st.sampled_from(sorted(fields)), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in sorted(keys)})
    )


_changes = field_changes(FIELDS)
_plausible = st.builds(_body, _changes, st.sets(st.sampled_from(sorted(VALID)), max_size=1), st.booleans())
# Plausible, but one field holds any JSON value at all.
_one_junk_field = st.builds(
    lambda changes, key, junk: _body({**changes, key: junk}, set()),
    _changes,
    st.sampled_from(_field_names),
    _junk,
)

bodies = st.one_of(
    _plausible,  # listed thrice: one_of picks a branch uniformly, and these reach the engine
    _plausible,
    _plausible,
    _one_junk_field,
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.sampled_from(
        [
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "max_tokens": 1e999}',
            b'{"prompt": "x", "n": 1' + b"0" * 400 + b"}",
            b'{"prompt": "\\ud800"}',
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            b"[" * 5000 + b"]" * 5000,
        ]
    ),
)


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def client():
    # Each body goes to both endpoints with both prompt fields, so the server
    # takes unknown fields (the lenient decoding is then fuzzed too); the
    # strict refusal has its own tests (tests/api/test_field_table.py).
    app, _ = make_app(
        config=engine_config(max_model_len=FUZZ_MAX_MODEL_LEN), options=APIOptions(allow_unknown_fields=True)
    )
    return http_client(app)


def check(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text
    else:
        assert response.json()["choices"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_random_bodies_never_get_a_5xx(runner, client, body):
    for path in ENDPOINTS:
        check(runner.run(client.post(path, content=body, headers={"content-type": "application/json"})))
