"""The rejection sampler: greedy verification, and lossless random verification.

The statistical tests draw tens of thousands of verifications of the same
drafts on small synthetic distributions in one batch, with a fixed seed, and
bound the chi-square distance of every emitted position's distribution from
the target (given the drafts before it were accepted).
"""

from __future__ import annotations

import math

import pytest
import torch

from protocol import SamplingParams
from services.worker.input_batch import CachedRequestState
from services.worker.sampling_metadata import RequestSamplingInput, build_sampling_metadata
from services.worker.spec_decode.rejection_sampler import RejectionSampler
from services.worker.spec_decode.spec_decoder import per_position_inputs

EOS = 0
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4


def chi2_bound(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_1E4 * math.sqrt(h)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens the target can produce; asserts the rest never appear."""
    assert counts[probs == 0].sum() == 0, "a token the target excludes was emitted"
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def run(
    rows_logits: list[list[float]],
    drafts: list[int],
    params: SamplingParams,
    num_requests: int,
    seed: int = 0,
    outputs: list[int] | None = None,
) -> list[list[int]]:
    """Verify the same drafts ``num_requests`` times in one batch; the emitted tokens of each."""
    state = CachedRequestState("r", 0, [1, 2, 3], params, list(outputs or []))
    inputs = per_position_inputs([state], [drafts]) * num_requests
    meta = build_sampling_metadata(inputs, vocab_size=len(rows_logits[0]), eos_token_id=EOS)
    logits = torch.tensor(rows_logits, dtype=torch.float32).repeat(num_requests, 1)
    sampler = RejectionSampler(torch.Generator().manual_seed(seed))
    return sampler(logits, meta, [drafts] * num_requests).token_ids


def logits_of(probs: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in probs]


# ------------------------------------------------------------------- greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)
# Row argmaxes: 4, 2, 3, 1.
GREEDY_ROWS = [
    [0.0, 0.1, 0.2, 0.3, 2.0],
    [0.0, 0.5, 3.0, 0.1, 0.2],
    [0.0, 0.0, 0.0, 1.0, 0.0],
    [0.0, 9.0, 0.0, 0.0, 0.0],
]


@pytest.mark.parametrize(
    "drafts, expected",
    [
        ([4, 2, 3], [4, 2, 3, 1]),  # all accepted, then the bonus token
        ([4, 2, 1], [4, 2, 3]),  # the third is wrong: the argmax replaces it
        ([1, 2, 3], [4]),  # the first is wrong: nothing accepted
    ],
)
def test_greedy_accepts_while_drafts_equal_the_argmax(drafts: list[int], expected: list[int]) -> None:
    assert run(GREEDY_ROWS, drafts, GREEDY, 1) == [expected]


def test_greedy_without_drafts_is_the_argmax() -> None:
    assert run(GREEDY_ROWS[:1], [], GREEDY, 2) == [[4], [4]]


def test_each_position_obeys_min_tokens_as_if_emitted_one_by_one() -> None:
    # EOS is every row's argmax; min_tokens=3 with one output already bans it at
    # output indexes 1 and 2 (rows 0 and 1) and allows it at index 3 (row 2).
    rows = [[5.0, 1.0, 0.0, 0.0], [5.0, 0.0, 1.0, 0.0], [5.0, 0.0, 0.0, 1.0]]
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10)
    assert run(rows, [1, 2], params, 1, outputs=[7]) == [[1, 2, EOS]]


def test_each_position_sees_the_drafts_before_it_in_its_penalties() -> None:
    # Token 1 leads by 1.0 in both rows; a frequency penalty of 1.5 removes the
    # lead of row 1 only if draft 0 (a 1) counts as an output there.
    rows = [[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]]
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5, max_tokens=10)
    assert run(rows, [1], params, 1) == [[1, 2]]


# ------------------------------------------------------------------- random

P0 = [0.1, 0.4, 0.2, 0.2, 0.1]
P1 = [0.3, 0.1, 0.1, 0.4, 0.1]
P2 = [0.05, 0.25, 0.3, 0.15, 0.25]
DRAFTS = [1, 3]


def position_counts(outputs: list[list[int]], position: int, vocab: int) -> torch.Tensor:
    """Counts of the token emitted at ``position``, over the runs that got that far."""
    tokens = [out[position] for out in outputs if len(out) > position]
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def assert_follows(outputs: list[list[int]], targets: list[list[float]], drafts: list[int]) -> None:
    for position, target in enumerate(targets):
        counts = position_counts(outputs, position, len(target))
        statistic, df = chi2(counts, torch.tensor(target, dtype=torch.float64))
        assert statistic < chi2_bound(df), (position, statistic, counts.tolist())
    # A run is the accepted drafts, then one token that is not the next draft.
    for out in outputs:
        num_accepted = len(out) - 1
        assert out[:num_accepted] == drafts[:num_accepted]
        assert num_accepted == len(drafts) or out[num_accepted] != drafts[num_accepted]


def test_random_emits_the_target_distribution_at_every_position() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=100)
    outputs = run([logits_of(P0), logits_of(P1), logits_of(P2)], DRAFTS, params, 40_000)
    assert_follows(outputs, [P0, P1, P2], DRAFTS)
    # Acceptance happens at rate p(draft): 0.4 at the first position.
    accepted_first = sum(len(out) > 1 for out in outputs) / len(outputs)
    assert abs(accepted_first - P0[DRAFTS[0]]) < 0.01


def test_random_target_is_after_temperature_and_top_k() -> None:
    logits = [0.0, 1.0, 2.0, 0.5, -1.0]
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=100)
    scaled = torch.tensor(logits) / 0.7
    target = torch.where(scaled >= scaled.topk(3).values[-1], scaled, torch.tensor(-math.inf)).softmax(0)
    # The draft (token 4) is outside the top 3: never accepted.
    outputs = run([logits, logits], [4], params, 20_000)
    assert all(len(out) == 1 for out in outputs)
    counts = position_counts(outputs, 0, 5)
    statistic, df = chi2(counts, target.double())
    assert statistic < chi2_bound(df)


def test_a_wrong_recovery_would_fail_the_bound() -> None:
    """The bound has teeth: recovering from p itself (not p without the draft)
    over-weights the draft, and the same test would reject it."""
    p0 = torch.tensor(P0, dtype=torch.float64)
    wrong = p0 * (1 - p0[DRAFTS[0]])
    wrong[DRAFTS[0]] += p0[DRAFTS[0]]
    n = 40_000
    counts = wrong * n  # the expected counts under the wrong scheme
    statistic, df = chi2(counts, p0)
    assert statistic > 10 * chi2_bound(df)


def test_seeded_requests_repeat_and_still_follow_the_target() -> None:
    logits = [logits_of(P0), logits_of(P1), logits_of(P2)]
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=100) for s in range(3000)]
    states = [CachedRequestState(f"r{s}", s, [1], p, []) for s, p in enumerate(seeded)]

    def once(generator_seed: int) -> list[list[int]]:
        meta = build_sampling_metadata(
            per_position_inputs(states, [DRAFTS] * len(states)), vocab_size=5, eos_token_id=EOS
        )
        sampler = RejectionSampler(torch.Generator().manual_seed(generator_seed))
        return sampler(torch.tensor(logits).repeat(len(states), 1), meta, [DRAFTS] * len(states)).token_ids

    first = once(0)
    assert once(123) == first  # the worker's generator plays no part for seeded requests
    assert_follows(first, [P0], DRAFTS)


def test_logprobs_of_every_emitted_token() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=10)
    state = CachedRequestState("r", 0, [1], params, [])
    meta = build_sampling_metadata(per_position_inputs([state], [[4, 2]]), vocab_size=5, eos_token_id=EOS)
    logits = torch.tensor(GREEDY_ROWS[:3])
    out = RejectionSampler(torch.Generator().manual_seed(0))(logits, meta, [[4, 2]])
    assert out.token_ids == [[4, 2, 3]]
    raw = logits.log_softmax(dim=-1)
    entries = out.logprobs[0]
    assert [e.token_ids[0] for e in entries] == [4, 2, 3]
    for row, (entry, token) in enumerate(zip(entries, [4, 2, 3])):
        assert entry.logprobs[0] == pytest.approx(float(raw[row, token]))
        assert entry.rank == 1 and len(entry.token_ids) == 3  # the token, then the top 2


def test_rows_of_requests_without_drafts_sample_like_the_sampler() -> None:
    """A seeded request with no drafts in a speculative step draws exactly what
    the plain sampler would."""
    from services.worker.sampler import Sampler

    params = SamplingParams(temperature=0.9, top_p=0.8, seed=42, max_tokens=10)
    inputs = [RequestSamplingInput(params, [1], [5, 6])]
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    plain = Sampler(seed=0)(
        logits, build_sampling_metadata(inputs, vocab_size=50, eos_token_id=EOS)
    ).token_ids.tolist()
    meta = build_sampling_metadata(inputs, vocab_size=50, eos_token_id=EOS)
    spec = RejectionSampler(torch.Generator().manual_seed(0))(logits, meta, [[]]).token_ids
    assert spec == [plain]


def test_token_filters_apply_to_every_verified_position() -> None:
    # GREEDY_ROWS' argmaxes are 4, 2, 3, 1.
    # A bias of +10 on token 0 makes it every row's argmax: draft 0 is accepted,
    # draft 2 is not and is replaced by 0.
    biased = SamplingParams(temperature=0.0, max_tokens=100, logit_bias={0: 10.0})
    assert run(GREEDY_ROWS, [0, 2, 3], biased, 1) == [[0, 0]]
    # Without token 4, row 0 takes its next best (3); the other rows keep theirs.
    allowed = SamplingParams(temperature=0.0, max_tokens=100, allowed_token_ids=[1, 2, 3])
    assert run(GREEDY_ROWS, [3, 2, 3], allowed, 1) == [[3, 2, 3, 1]]
    # Row 2 follows the draft 2, so its argmax 3 would finish the bad word (2, 3):
    # draft 3 is rejected there and the row's next best (0, 1, 2, 4 are tied at 0) replaces it.
    bad = SamplingParams(temperature=0.0, max_tokens=100, bad_words_token_ids=[[2, 3]])
    (emitted,) = run(GREEDY_ROWS, [4, 2, 3], bad, 1)
    assert emitted[:2] == [4, 2] and len(emitted) == 3 and emitted[2] != 3
