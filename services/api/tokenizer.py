"""A torch-free tokenizer: HF ``tokenizers`` for the text, jinja2 for chat.

transformers' AutoTokenizer imports torch, which the API process must not
load, so this reads the same files (tokenizer.json, tokenizer_config.json,
chat_template.jinja) directly and renders the chat template the way
transformers does (``services.api.chat_template``).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import tokenizers

from services.api.chat_template import ChatTemplateError, render

# decode_batch costs twice what decode does on one token, and a short list
# holds the GIL for microseconds anyway.
_DECODE_OFF_GIL_FROM = 1024


class Tokenizer:
    def __init__(self, hf_dir: str | Path) -> None:
        hf_dir = Path(hf_dir)
        self._tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        config_path = hf_dir / "tokenizer_config.json"
        self._config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = hf_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.exists() else self._config.get("chat_template")
        )
        self.eos_token = self._special_token("eos_token")
        self.bos_token = self._special_token("bos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def _special_token(self, key: str) -> str | None:
        value = self._config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with ``chat_template`` in place of the model's (``--chat-template``)."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Token id -> text of the tokens added to the model's vocabulary (the special ones among them)."""
        return {token_id: token.content for token_id, token in self._tok.get_added_tokens_decoder().items()}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # The batch calls, with a batch of one: unlike encode/decode they release
    # the GIL while they work, so a huge prompt tokenized on a worker thread
    # (services.api.offload) does not stop the event loop's thread too.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) < _DECODE_OFF_GIL_FROM:  # the hot path (one token's logprob text)
            return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text; ``chat_template`` replaces the model's (see ``chat_template.render``)."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ChatTemplateError("This model's tokenizer has no chat template; use completions instead.")
        return render(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )
