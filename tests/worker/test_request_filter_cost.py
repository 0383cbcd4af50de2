"""One request must not slow its co-batched neighbours (issue 44, item 4).

The attack: a request with a full-vocabulary logit_bias and allowed_token_ids (n=16) made a
neighbour's 16-token request take 25.5 s instead of 1.2 s, since the lists became tensors
again at every step and bad-word prefixes were sliced every step. Now each request's
filters are built once, kept with the request in the worker, and a step looks only at
the bad words whose prefix ends with the token just produced. These tests count that
work, never time it.
"""

from __future__ import annotations

import torch

from protocol import SamplingParams
from services.worker import sampling_metadata
from services.worker.input_batch import CachedRequestState
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import RequestSamplingInput, build_sampling_metadata, cached_filters

V = 4096
STEPS = 20


class CountingList(list):
    """A list that counts the times its elements are walked."""

    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()


def _step(state: CachedRequestState, logits: torch.Tensor, sampler: Sampler) -> int:
    inputs = [
        RequestSamplingInput(
            state.sampling_params,
            state.prompt_token_ids,
            state.output_token_ids,
            cached_filters(state, V, "cpu"),
            filters_given=True,
        )
    ]
    meta = build_sampling_metadata(inputs, vocab_size=V, eos_token_id=None)
    token = int(sampler(logits, meta).token_ids[0])
    state.output_token_ids.append(token)
    return token


def test_a_requests_filters_become_tensors_once_not_every_step(monkeypatch):
    builds = []
    build = sampling_metadata.TokenFilters.build.__func__

    def counting_build(cls, *args, **kwargs):
        builds.append(args[0])
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(sampling_metadata.TokenFilters, "build", classmethod(counting_build))
    allowed = CountingList(range(0, V, 2))  # even tokens only
    # Bad words: the one-token word 10 always; 13 after 12 (a two-token word); 1000 words more
    # whose prefixes end in tokens the output never holds.
    words = [[10], [12, 13], *([3001 + 2 * i, 9] for i in range(500)), *([7, 5, 3] for _ in range(500))]
    params = SamplingParams(
        temperature=0.0,
        allowed_token_ids=allowed,
        logit_bias={t: 50.0 for t in (10, 12, 14)} | {t: 1.0 for t in range(100, 397)},
        bad_words_token_ids=words,
        max_tokens=STEPS,
    )
    state = CachedRequestState("r", 0, [1, 2], params, [])
    sampler = Sampler(0)
    CountingList.walks = 0
    logits = torch.zeros(1, V)
    tokens = []
    for step in range(STEPS):
        tokens.append(_step(state, logits, sampler))
        if step == 0:
            walks_after_first = CountingList.walks
    assert len(builds) == 1  # one build for the request's whole life
    assert CountingList.walks == walks_after_first  # later steps never walk the allowed ids again
    # The filters still hold at every step: 10 (biased, but a bad word) is never taken, 12 (the
    # first of the biased tokens left) is, and only allowed (even) tokens come out.
    assert tokens[0] == 12 and 10 not in tokens and all(t % 2 == 0 for t in tokens)


def test_a_step_checks_only_the_bad_words_its_last_token_could_complete():
    words = [[5, 6, 7], *([100 + i, 200 + i, 9] for i in range(1000))]
    filters = sampling_metadata.TokenFilters.build(SamplingParams(bad_words_token_ids=words), V, "cpu")
    assert filters.bad_word_bans([1, 5, 6]) == [7]
    assert filters.bad_word_bans([5, 1, 6]) == []
    assert filters.bad_word_bans([100, 200]) == [9] and filters.bad_word_bans([101, 200]) == []
    # A token ends at most one prefix here: a step looks at one word, not at all 1001.
    assert max(len(candidates) for candidates in filters.bad_word_tails.values()) == 1
    assert filters.always_banned is None


def test_filters_past_the_vocabulary_are_dropped_once():
    params = SamplingParams(
        allowed_token_ids=[1, V + 5], logit_bias={2: 3.0, V + 1: 3.0}, bad_words_token_ids=[[V + 2], [4]]
    )
    filters = sampling_metadata.TokenFilters.build(params, V, "cpu")
    assert filters.disallowed.shape == (V,) and not filters.disallowed[1] and filters.disallowed[0]
    assert filters.bias_ids.tolist() == [2] and filters.always_banned.tolist() == [4]
    assert sampling_metadata.TokenFilters.build(SamplingParams(), V, "cpu") is None
