"""The xgrammar backend on the default model's real vocabulary (no weights needed)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import tokenizers

from protocol import SamplingParams, StructuredOutputsParams
from services.engine_core.request import Request
from services.engine_core.structured_output import StructuredOutputManager
from services.engine_core.structured_output.backend import bitmask_words
from services.engine_core.structured_output.xgrammar_backend import XgrammarBackend, choice_ebnf
from tests.engine_core.fakes import make_config

pytestmark = pytest.mark.slow

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(default_model) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(default_model.hf_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def backend(default_model) -> XgrammarBackend:
    return XgrammarBackend(default_model.hf_dir, VOCAB, [EOS])


def matcher(backend: XgrammarBackend, **kwargs):
    return backend.new_grammar(backend.compile(StructuredOutputsParams(**kwargs)))


def allowed(grammar, vocab: int = VOCAB) -> np.ndarray:
    bitmask = np.zeros((1, bitmask_words(vocab)), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    return np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))


def accepts(grammar, tokenizer, text: str) -> bool:
    """The grammar takes ``text`` (tokenized as the model would write it) and then ends."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return grammar.accept_tokens(ids) and grammar.accept_tokens([EOS]) and grammar.is_terminated()


@pytest.mark.parametrize(
    "kwargs, good, bad",
    [
        ({"regex": r"\d{4}-\d{2}-\d{2}"}, "2024-01-31", "2024-1-31"),
        ({"choice": ["Positive", "Negative"]}, "Negative", "Neutral"),
        (
            {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            '{"n": 42}',
            '{"n": "42"}',
        ),
        ({"json_object": True}, '{"any": [1, 2]}', "[1, 2]"),
        ({"grammar": 'root ::= num ("+" num)*\nnum ::= [0-9]+'}, "12+3+45", "12++3"),
        ({"grammar": 'start: NUM ("*" NUM)*\nNUM: /[0-9]+/'}, "6*7", "6*"),  # Lark
    ],
)
def test_each_kind_takes_good_text_and_refuses_bad(backend, tokenizer, kwargs, good, bad):
    assert accepts(matcher(backend, **kwargs), tokenizer, good)
    assert not accepts(matcher(backend, **kwargs), tokenizer, bad)


def test_choices_with_quotes_newlines_and_unicode(backend, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "héllo wörld"]
    assert choice_ebnf(['a"b']) == 'root ::= "a\\"b"'
    for choice in choices:
        assert accepts(matcher(backend, choice=choices), tokenizer, choice)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": "[a-"}, "Invalid regex: Regex parsing error at position 4: Unclosed '['"),
        ({"json": {"type": "foo"}}, 'Invalid json: Unsupported type "foo"'),
        (
            {"grammar": "root ::= missing"},
            'Invalid grammar: EBNF parser error at line 1, column 10: Rule "missing" is not defined',
        ),
    ],
)
def test_invalid_constraints_raise_clean_value_errors(backend, kwargs, message):
    with pytest.raises(ValueError) as info:
        backend.compile(StructuredOutputsParams(**kwargs))
    assert str(info.value) == message  # no "[hh:mm:ss] /path/file.cc:NN:" prefix


def test_a_finished_grammar_allows_only_the_stop_token(backend, tokenizer):
    grammar = matcher(backend, regex="ab")
    assert grammar.accept_tokens(tokenizer.encode("ab", add_special_tokens=False).ids)
    assert allowed(grammar).tolist() == [EOS]
    assert not grammar.is_terminated()
    assert grammar.accept_tokens([EOS]) and grammar.is_terminated()


def test_validate_and_rollback_leave_the_state_as_it_was(backend, tokenizer):
    grammar = matcher(backend, regex="abc")
    a, b, c = (tokenizer.token_to_id(ch) for ch in "abc")
    x = tokenizer.token_to_id("x")
    assert grammar.validate_tokens([a, b, x, c]) == [a, b]
    assert a in allowed(grammar) and b not in allowed(grammar)
    assert grammar.accept_tokens([a, b])
    grammar.rollback(2)
    assert a in allowed(grammar)
    grammar.accept_tokens([a])
    grammar.reset()
    assert a in allowed(grammar)


def test_compact_json_has_no_free_whitespace(backend, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spaced = matcher(backend, json=schema)
    compact = matcher(backend, json=schema, disable_any_whitespace=True)
    newline = tokenizer.token_to_id("Ċ")  # "\n" in the byte-level vocabulary
    for grammar in (spaced, compact):
        assert grammar.accept_tokens(tokenizer.encode("{", add_special_tokens=False).ids)
    assert newline in allowed(spaced) and newline not in allowed(compact)


def test_ids_past_the_tokenizer_are_never_allowed(default_model):
    padded = XgrammarBackend(default_model.hf_dir, VOCAB + 64, [EOS])
    grammar = padded.new_grammar(padded.compile(StructuredOutputsParams(json_object=True)))
    ids = allowed(grammar, VOCAB + 64)
    assert ids.size > 0 and ids.max() < VOCAB


def test_the_manager_compiles_on_its_pool_with_the_configured_tokenizer(default_model):
    config = make_config()
    config = msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, tokenizer=str(default_model.hf_dir), vocab_size=VOCAB),
    )
    manager = StructuredOutputManager(config)
    try:
        request = Request(
            "r",
            [1],
            SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps({"type": "boolean"}))),
            0.0,
            eos_token_id=EOS,
        )
        manager.add_request(request)
        request.structured_output.job.future.result(timeout=60)
        ready, failed, pending = manager.split_compiled([request])
        assert ready == [request] and not failed and not pending
        ids, bitmask = manager.grammar_bitmask([request], {"r": 1}, {})
        assert ids == ["r"] and bitmask.shape == (1, VOCAB // 32)
        stats = manager.make_stats()
        assert stats.num_requests == 1 and sum(stats.compile_counts) == 1 and stats.compile_seconds > 0
    finally:
        manager.shutdown()
