"""The field table (services/api/field_table.py) against OpenAI's schema and the running app.

Every field of the ``openai`` package's request TypedDicts, and every field
the request Structs declare, is in the table; each entry behaves as it says
when its example is sent: honoured and no-effect fields are a 200, refused
ones a 400 naming the field. Entries owned by another piece of work (``owner``)
whose field this branch's Struct does not declare yet are unknown fields
until then, so they must be a 400 naming them; once declared, they are
checked like the rest.
"""

from __future__ import annotations

import typing

import msgspec
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params as responses_params

from services.api import field_table
from services.api.chat_args import ChatSettings
from services.api.field_table import CHAT, COMPLETIONS, HONOURED, NO_EFFECT, REFUSED, RESPONSES, FieldRule
from services.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from services.api.responses_schemas import ResponsesRequest
from tests.api.fake_engine_client import http_client, make_app
from tests.utils import REPO_ROOT

ENDPOINTS = {
    "completions": (
        "/v1/completions",
        COMPLETIONS,
        CompletionRequest,
        completion_params,
        {"prompt": "Hi", "max_tokens": 2},
    ),
    "chat": (
        "/v1/chat/completions",
        CHAT,
        ChatCompletionRequest,
        chat_params,
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
    "responses": (
        "/v1/responses",
        RESPONSES,
        ResponsesRequest,
        responses_params,
        {"input": "Hi", "max_output_tokens": 2},
    ),
}


def openai_fields(module) -> set[str]:
    """Every key of the module's CompletionCreateParams TypedDicts (streaming or not)."""
    names: set[str] = set()
    prefix = "Response" if module is responses_params else "Completion"
    for suffix in ("Base", "Streaming", "NonStreaming"):
        names |= set(typing.get_type_hints(getattr(module, f"{prefix}CreateParams{suffix}")))
    return names


def declared(struct: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def cases() -> list:
    return [
        pytest.param(endpoint, name, id=f"{endpoint}-{name}")
        for endpoint, (_, table, _, _, _) in ENDPOINTS.items()
        for name in table
    ]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_openai_and_declared_field_is_in_the_table(endpoint):
    _, table, struct, module, _ = ENDPOINTS[endpoint]
    assert openai_fields(module) - set(table) == set()
    assert declared(struct) - set(table) == set()
    assert all(rule.status in (HONOURED, REFUSED, NO_EFFECT) for rule in table.values())


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_only_owned_entries_may_be_missing_from_the_struct(endpoint):
    _, table, struct, _, _ = ENDPOINTS[endpoint]
    missing = set(table) - declared(struct)
    assert {name for name in missing if not table[name].owner} == set()


@pytest.fixture(scope="module")
def app():
    # A server that trusts request templates, so chat_template is served like the rest.
    return make_app(chat=ChatSettings(trust_request_chat_template=True))[0]


@pytest.mark.parametrize("endpoint, name", cases())
async def test_each_field_behaves_as_the_table_says(app, endpoint, name):
    path, table, struct, _, base = ENDPOINTS[endpoint]
    rule: FieldRule = table[name]
    body = {**base, **dict(rule.needs), name: rule.example}
    async with http_client(app) as http:
        response = await http.post(path, json=body)
    expected_refusal = rule.status == REFUSED or name not in declared(struct)
    if expected_refusal:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name
    else:
        assert response.status_code == 200, response.text


def test_the_readme_table_lists_every_field_with_its_status():
    text = field_table.markdown_table()
    for endpoint in (ENDPOINTS["completions"], ENDPOINTS["chat"]):
        for name, rule in endpoint[1].items():
            assert f"| `{name}` |" in text and rule.status in text
    responses = field_table.responses_markdown_table()
    for name, rule in RESPONSES.items():
        assert f"| `{name}` | {rule.status} |" in responses


def test_the_api_doc_shows_the_tables_as_the_code_has_them():
    text = (REPO_ROOT / "docs" / "api.md").read_text()  # the README links it
    assert field_table.markdown_table() in text
    assert field_table.responses_markdown_table() in text
