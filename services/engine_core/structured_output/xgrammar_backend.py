"""The default backend: xgrammar (pushdown automata with precomputed token masks).

xgrammar imports torch when it is imported, so this module is loaded only
when the first constrained request arrives; the scheduler itself stays
torch-free. Its C++ compiler and matchers release the GIL.

The vocabulary comes from the tokenizer files (``tokenizer.json``) through
the ``tokenizers`` library, not transformers: xgrammar only needs each id's
token string and how the tokenizer encodes bytes, which the same file says.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import tokenizers
import xgrammar as xgr

from protocol import StructuredOutputsParams
from services.engine_core.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: "; clients need only the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# A JSON object with any members: what OpenAI's json_object format promises.
_ANY_OBJECT = '{"type": "object"}'


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self._matcher.accept_token(t) for t in token_ids)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return token_ids[:accepted]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer_dir, vocab_size, stop_token_ids)
        # The manager caches compiled grammars itself (and shares in-flight
        # compiles); a second cache here would only hold memory.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=max(1, (os.cpu_count() or 2) // 2), cache_enabled=False
        )

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile(params)
        except RuntimeError as e:  # xgrammar reports bad input as RuntimeError
            raise ValueError(f"Invalid {params.kind}: {_clean(e)}") from None

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        # Exactly one field is set (StructuredOutputsParams checks it): the one that is, is the kind.
        any_whitespace = not params.disable_any_whitespace
        if params.json is not None:
            return self._compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
        if params.json_object:
            return self._compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=any_whitespace)
        if params.regex is not None:
            return self._compiler.compile_regex(params.regex)
        if params.choice is not None:
            return self._compiler.compile_grammar(choice_ebnf(params.choice))
        assert params.grammar is not None
        if is_ebnf(params.grammar):
            return self._compiler.compile_grammar(params.grammar)
        return self._compiler.compile_lark(params.grammar)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))


def is_ebnf(grammar: str) -> bool:
    """EBNF (GBNF) rules read ``name ::= ...``; otherwise the grammar is Lark."""
    return "::=" in grammar


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF's too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(
    tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar needs it, padded (or cut) to the model's
    ``vocab_size``: ids the tokenizer lacks stay empty and are never allowed."""
    tok = tokenizers.Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    encoded = [""] * vocab_size
    for token, token_id in tok.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    # How the file encodes bytes (byte-level, byte-fallback or raw) and whether
    # it adds a prefix space: xgrammar reads both from the serialized tokenizer.
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    stops = sorted({*stop_token_ids, *_file_eos_ids(tok, Path(tokenizer_dir))})
    return xgr.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stops or None,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _file_eos_ids(tok: tokenizers.Tokenizer, tokenizer_dir: Path) -> list[int]:
    """The tokenizer's own end token: the front end stamps it on requests as their EOS."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    if not config_path.exists():
        return []
    eos = json.loads(config_path.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    token_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    return [] if token_id is None else [token_id]


def _clean(error: Exception) -> str:
    return _LOCATION.sub("", str(error).strip())
