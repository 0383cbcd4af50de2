"""Incremental detokenization and stop strings, one request at a time.

Stop strings are the front end's job (the engine only knows token ids):
when one appears, the text is cut there and the caller aborts the request
in its engine. While streaming, the last ``max(len(stop)) - 1`` characters
are held back, since they could still turn into a stop string. As in vLLM,
stop strings are looked for only once the output has more than
``min_tokens`` tokens, and only in text that could end at the newest token.

With special tokens shown and ``spaces_between_special_tokens`` off, an
added token right after another one is shown as its own text, without the
space some decoders (WordPiece's) put in front of it, as vLLM does with
fast tokenizers.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from protocol import SamplingParams
from services.api.stop_matcher import matcher_for
from services.api.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        joined = not (params.skip_special_tokens or params.spaces_between_special_tokens)
        self._added = tokenizer.added_tokens if joined else None  # None: decode as the tokenizer does
        self._after_added = False  # the previous token was an added one
        self._stops = matcher_for(tuple(params.stop_strings))
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = self._stops.max_len
        self._hold_back = 0 if self._include_stop else max(0, self._max_stop_len - 1)
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self.text = ""
        self._sent = 0  # characters of ``text`` already handed out by ``take_delta``
        self.stop_string: str | None = None

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append the text of ``token_ids``; True when a stop string ended it."""
        for token_id in token_ids:
            self._num_tokens += 1
            piece = self._stream.step(self._tokenizer.backend, token_id)
            if self._added is not None:
                piece = self._joined(self._added, token_id, piece)
            if not piece:
                continue
            # A stop string may begin up to len(stop) - 1 characters back.
            start = max(0, len(self.text) - self._max_stop_len + 1)
            self.text += piece
            if self._stops and self._num_tokens > self._min_tokens and self._find_stop(start):
                return True
        return False

    def _joined(self, added_tokens: dict[int, str], token_id: int, piece: str | None) -> str | None:
        added = added_tokens.get(token_id)
        if added is not None and self._after_added:
            piece = added
        self._after_added = added is not None
        return piece

    def _find_stop(self, search_from: int) -> bool:
        hit = self._stops.earliest(self.text, search_from)
        if hit is None:
            return False
        index, stop = hit
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        self.stop_string = stop
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet, minus what could still become a stop string."""
        end = (
            len(self.text)
            if finished or self.stop_string
            else max(self._sent, len(self.text) - self._hold_back)
        )
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
