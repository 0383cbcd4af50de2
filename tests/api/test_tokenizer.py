"""The torch-free tokenizer and detokenizer agree with Hugging Face's."""

import random

import pytest
from transformers import AutoTokenizer

from protocol import SamplingParams
from services.api.detokenizer import IncrementalDetokenizer
from services.api.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space",
    "naïve café — ünïcødé 🚀 emoji",
    "line\nbreaks\n\n and\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizers(default_model):
    return Tokenizer(default_model.hf_dir), AutoTokenizer.from_pretrained(default_model.hf_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tokenizers, text):
    ours, hf = tokenizers
    assert ours.encode(text) == hf(text).input_ids


def test_chat_template_matches_hf(tokenizers):
    ours, hf = tokenizers
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    for add in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add
        )


def test_incremental_detokenization_equals_full_decode(tokenizers):
    ours, _ = tokenizers
    rng = random.Random(0)
    for text in TEXTS:
        ids = ours.encode(text) + [rng.randrange(ours.vocab_size) for _ in range(20)]
        detok = IncrementalDetokenizer(ours, SamplingParams())
        pieces = []
        for token_id in ids:
            detok.add_tokens([token_id])
            pieces.append(detok.take_delta(finished=False))
        pieces.append(detok.take_delta(finished=True))
        assert "".join(pieces) == detok.text == ours.decode(ids)


def test_stop_string_cuts_text_and_holds_back(tokenizers):
    ours, _ = tokenizers
    ids = ours.encode("The cat sat on the mat. Then it slept.")
    detok = IncrementalDetokenizer(ours, SamplingParams(stop=["on the mat"]))
    streamed, stopped_at = "", None
    for i, token_id in enumerate(ids):
        if detok.add_tokens([token_id]):
            stopped_at = i
            break
        streamed += detok.take_delta(finished=False)
        assert "on the" not in streamed  # held back while it could still match
    assert stopped_at is not None and detok.stop_string == "on the mat"
    assert detok.text == "The cat sat "
    assert streamed + detok.take_delta(finished=True) == "The cat sat "


def test_stop_string_included_when_asked(tokenizers):
    ours, _ = tokenizers
    detok = IncrementalDetokenizer(ours, SamplingParams(stop=["mat"], include_stop_str_in_output=True))
    assert detok.add_tokens(ours.encode("The cat sat on the mat. Then"))
    assert detok.text == "The cat sat on the mat"


def test_chat_template_missing_is_a_clear_error(tmp_path, default_model):
    (tmp_path / "tokenizer.json").write_bytes((default_model.hf_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory):
    """A WordPiece tokenizer (BERT's decoder puts a space before every token but
    a "##" piece, special ones too), written as a tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tok = HFTokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    folder = tmp_path_factory.mktemp("wordpiece")
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize(
    "skip,spaces,text",
    [
        (False, True, "[CLS] hello [SEP] [CLS] worlds [SEP]"),
        (False, False, "[CLS] hello [SEP][CLS] worlds [SEP]"),  # vLLM's fast detokenizer's output
        (True, False, "hello worlds"),  # nothing to join when special tokens are left out
    ],
)
def test_spaces_between_special_tokens(wordpiece_dir, skip, spaces, text):
    tok = Tokenizer(wordpiece_dir)
    ids = tok.encode("[CLS] hello [SEP] [CLS] worlds [SEP]", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == "[CLS] hello [SEP] [CLS] worlds [SEP]"
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(tok, params)
    for token_id in ids:
        detok.add_tokens([token_id])
    assert detok.text == text
