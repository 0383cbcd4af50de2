"""N-gram (prompt lookup) drafts: guess the next tokens by finding the context's
tail earlier in the context and copying what followed it there.

For one request, with ``L`` known tokens, the longest tail of ``n`` tokens
(``prompt_lookup_max`` down to ``prompt_lookup_min``) that also ends at an
earlier position ``e < L - 1`` wins, and among its earlier occurrences the most
recent one. The candidates are the earlier copies of the last token; they are
all scored at once, as the run of matches when walking back from each of them
and from the tail together (one ``[candidates, n_max]`` comparison). No Python
loop over tokens.

The copy starts after ``e``. When it reaches the end of the context it keeps
going with period ``L - 1 - e`` (the distance between the occurrence and the
tail), as the text would if it repeats; plain prompt lookup would propose
fewer tokens there.
"""

from __future__ import annotations

import numpy as np

from protocol import SpeculativeConfig

_EMPTY = np.zeros(0, dtype=np.int64)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens continuing ``tokens`` [L]; empty when no tail of
    at least ``min_n`` tokens occurs earlier."""
    length = tokens.shape[0]
    if k < 1 or length < min_n + 1:
        return _EMPTY
    max_n = min(max_n, length - 1)
    tokens = tokens.astype(np.int64, copy=False)
    # Candidate end positions: earlier copies of the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [m], ascending
    if ends.size == 0:
        return _EMPTY
    # Row i walks back from ends[i] as the tail walks back from L - 1; -1
    # (before the start) matches no token id.
    back = ends[:, None] - np.arange(max_n)  # [m, max_n]
    earlier = np.where(back >= 0, tokens[np.maximum(back, 0)], -1)
    equal = earlier == tokens[length - 1 - np.arange(max_n)]  # [m, max_n]
    match_len = np.cumprod(equal, axis=1).sum(axis=1)  # [m]
    best = int(match_len.max())
    if best < min_n:
        return _EMPTY
    end = int(ends[np.flatnonzero(match_len >= best)[-1]])  # the most recent such end
    period = length - 1 - end
    return tokens[end + 1 + np.arange(k) % period]


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, tokens: np.ndarray) -> list[int]:
        """Drafts for one request whose known tokens are ``tokens`` [L]."""
        # Positions past max_model_len do not exist; the scheduler also caps
        # the drafts by max_tokens, which only it knows.
        k = min(self.k, self.max_model_len - tokens.shape[0] - 1)
        return propose_ngram(tokens, self.min_n, self.max_n, k).tolist()
