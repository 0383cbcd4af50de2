"""The sampler: greedy, filters, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from protocol import SamplingParams
from services.worker.penalties import apply_penalties
from services.worker.sampler import Sampler, argmax_rows
from services.worker.sampling_metadata import RequestSamplingInput, build_sampling_metadata

V = 50
EOS = 7


def req(prompt=(1, 2), output=(), **params) -> RequestSamplingInput:
    return RequestSamplingInput(SamplingParams(**params), list(prompt), list(output))


def sample(logits: torch.Tensor, requests: list[RequestSamplingInput], seed: int = 0):
    meta = build_sampling_metadata(requests, vocab_size=logits.shape[1], eos_token_id=EOS)
    return Sampler(seed)(logits, meta)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def four_token_logits(rows: int) -> torch.Tensor:
    """Probabilities 0.5, 0.3, 0.15, 0.05 on tokens 0..3, nothing elsewhere."""
    probs = torch.zeros(V)
    probs[:4] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    return probs.log().expand(rows, V).clone()


def test_greedy_is_argmax():
    logits = random_logits(6)
    out = sample(logits, [req(temperature=0.0)] * 6)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = random_logits(4)
    out = sample(
        logits,
        [req(temperature=0.0), req(temperature=1.0), req(temperature=0.0), req(temperature=2.0, seed=3)],
    )
    assert out.token_ids[[0, 2]].tolist() == logits.argmax(-1)[[0, 2]].tolist()


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.7), {0, 1}),
        (dict(top_p=0.8), {0, 1}),  # 0.5 + 0.3 already reach 0.8
        (dict(top_p=0.85), {0, 1, 2}),
        (dict(min_p=0.5), {0, 1}),  # keeps p >= 0.25
        (dict(top_k=3, top_p=0.9), {0, 1, 2}),
        (dict(top_k=1), {0}),
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(params, allowed):
    rows = 400
    out = sample(four_token_logits(rows), [req(**params)] * rows)
    assert set(out.token_ids.tolist()) == allowed


def test_random_sampling_follows_the_distribution():
    rows = 8000
    out = sample(four_token_logits(rows), [req()] * rows)
    freq = torch.bincount(out.token_ids, minlength=4)[:4].float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.025, rtol=0)


def test_temperature_flattens_the_distribution():
    rows = 4000
    hot = sample(four_token_logits(rows), [req(temperature=100.0)] * rows)
    # Nearly uniform over the four (other tokens have -inf logits and stay out).
    assert set(hot.token_ids.tolist()) == {0, 1, 2, 3}
    assert (hot.token_ids == 3).float().mean() > 0.2


def test_seeded_draws_do_not_depend_on_batch_composition():
    logits = random_logits(1, seed=5)[0]
    target = req(seed=42, output=(9, 9, 9))  # sampling output index 3
    alone = sample(logits[None], [target], seed=0).token_ids[0]
    others = random_logits(5, seed=6)
    mixed_logits = torch.cat([others[:3], logits[None], others[3:]])
    batch = [req(), req(seed=1), req(temperature=0.0), target, req(top_k=5)]
    mixed = sample(mixed_logits, batch, seed=123).token_ids[3]
    assert alone == mixed


def test_seeded_draws_change_with_the_output_index_and_seed():
    logits = torch.zeros(1, V)  # uniform: every draw is a fresh pick
    picks = {int(sample(logits, [req(seed=42, output=[0] * i)]).token_ids[0]) for i in range(12)}
    assert len(picks) > 3
    by_seed = {int(sample(logits, [req(seed=s)]).token_ids[0]) for s in range(12)}
    assert len(by_seed) > 3


def test_unseeded_draws_follow_the_worker_seed():
    logits = torch.zeros(20, V)
    first = sample(logits, [req()] * 20, seed=7).token_ids
    assert torch.equal(first, sample(logits, [req()] * 20, seed=7).token_ids)
    assert not torch.equal(first, sample(logits, [req()] * 20, seed=8).token_ids)


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    meta = build_sampling_metadata(
        [req(prompt=[0, 1], output=[2], repetition_penalty=2.0)], vocab_size=5, eos_token_id=None
    )
    out = apply_penalties(logits, meta.penalties)
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, -2.0, 1.0]]))


def test_presence_and_frequency_penalties_cover_output_only():
    logits = torch.zeros(1, 6)
    meta = build_sampling_metadata(
        [req(prompt=[4], output=[3, 3, 5], presence_penalty=1.0, frequency_penalty=0.5)],
        vocab_size=6,
        eos_token_id=None,
    )
    out = apply_penalties(logits, meta.penalties)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0, -2.0, 0.0, -1.5]]))


def test_no_penalties_means_no_penalty_work():
    meta = build_sampling_metadata([req(), req(temperature=0.0)], vocab_size=V, eos_token_id=EOS)
    assert meta.penalties is None and meta.top_k is None and meta.top_p is None and meta.min_p is None


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 11], logits[0, 12] = 10.0, 9.0, 8.0
    early = req(output=[1], min_tokens=3, stop_token_ids=[11], temperature=0.0)
    assert sample(logits, [early]).token_ids.tolist() == [12]
    done = req(output=[1, 2, 3], min_tokens=3, stop_token_ids=[11], temperature=0.0)
    assert sample(logits, [done]).token_ids.tolist() == [EOS]


def test_logprobs_come_from_raw_logits_with_ranks_and_top_tokens():
    logits = random_logits(3)
    raw = logits.log_softmax(-1)
    requests = [
        req(logprobs=2, temperature=0.0, repetition_penalty=1.5, output=[int(logits[0].argmax())]),
        req(logprobs=0, temperature=5.0, seed=1),
        req(),  # asks for none
    ]
    out = sample(logits, requests)
    for row in (0, 1):
        entry = out.logprobs[row]
        token = int(out.token_ids[row])
        assert entry.token_ids[0] == token
        assert math.isclose(entry.logprobs[0], float(raw[row, token]), rel_tol=1e-6)
        assert entry.rank == int((raw[row] > raw[row, token]).sum()) + 1
    top = out.logprobs[0]
    assert top.token_ids[1:] == raw[0].topk(2).indices.tolist()
    assert len(out.logprobs[1].token_ids) == 1
    assert out.logprobs[2] is None
    # The penalty moved the greedy pick off the raw argmax, so its rank is not 1.
    assert top.rank > 1


def test_whole_vocabulary_logprobs():
    out = sample(random_logits(1), [req(logprobs=-1, temperature=0.0)])
    entry = out.logprobs[0]
    assert entry.rank == 1 and len(entry.token_ids) == V + 1
    assert math.isclose(sum(math.exp(x) for x in entry.logprobs[1:]), 1.0, rel_tol=1e-5)


def test_logit_bias_moves_the_argmax_on_greedy_and_random_rows():
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    rows = [req(temperature=0.0, logit_bias={9: 6.0}), req(logit_bias={9: 100.0, 3: -100.0})]
    assert sample(logits, rows).token_ids.tolist() == [9, 9]


def test_allowed_token_ids_are_the_only_tokens_sampled():
    rows = 400
    out = sample(random_logits(rows), [req(allowed_token_ids=[5, 17, 30])] * rows)
    assert set(out.token_ids.tolist()) == {5, 17, 30}
    greedy = sample(four_token_logits(1), [req(temperature=0.0, allowed_token_ids=[2, 3])])
    assert greedy.token_ids.tolist() == [2]  # the likelier of the two left


def test_bad_words_ban_the_token_that_would_complete_a_word():
    logits = torch.zeros(3, V)
    logits[:, 4], logits[:, 6] = 9.0, 8.0
    words = [[20, 4], [6]]  # a two-token word ending in 4; a one-token word 6
    rows = [
        req(output=[1, 20], temperature=0.0, bad_words_token_ids=words),  # 4 would finish it
        req(output=[20, 1], temperature=0.0, bad_words_token_ids=words),  # 4 is harmless here
        req(output=[], temperature=0.0, bad_words_token_ids=[[4]]),
    ]
    # Row 0 may take neither 4 nor 6; row 1 may take 4; row 2 bans 4 at once.
    assert sample(logits, rows).token_ids.tolist()[1:] == [4, 6]
    assert sample(logits, rows).token_ids.tolist()[0] not in (4, 6)


def test_logprobs_stay_those_of_the_raw_logits_under_token_filters():
    logits = random_logits(1)
    out = sample(logits, [req(temperature=0.0, logprobs=0, allowed_token_ids=[11])])
    assert out.token_ids.tolist() == [11]
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 11]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_is_argmax_with_ties_nans_and_infinities(dtype, threads):
    """The first maximum on ties, a NaN as the maximum, rows of -inf and of +inf ties: as argmax."""
    x = torch.randint(0, 4, (64, 49152), generator=torch.Generator().manual_seed(1)).to(dtype)
    x[3] = float("-inf")
    x[5, 100] = float("nan")
    x[6] = float("nan")
    x[7] = 0
    x[8, 7] = x[8, 9] = float("inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, want = argmax_rows(x), x.argmax(dim=-1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert got[3].item() == 0 and got[5:9].tolist() == [100, 0, 0, 7]
