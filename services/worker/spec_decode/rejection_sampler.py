"""Verify draft tokens against the target model: accept a prefix, then emit one more.

Each request brings ``k >= 0`` drafts and ``k + 1`` rows of logits: row ``j``
is the target's prediction for draft position ``j`` (given the drafts before
it), row ``k`` the bonus position after the last draft. Rows are adjusted and
shaped exactly as the ``Sampler`` would (penalties, min_tokens bans,
temperature, top-k, top-p, min-p), each as if the drafts before it had
already been emitted; the caller builds the metadata that way.

- Greedy rows: a draft is accepted while it equals the row's argmax; the
  first mismatch emits the argmax instead, and if all match the bonus row's
  argmax follows. The tokens are those of plain greedy decoding.
- Random rows (Leviathan et al., 2023): an n-gram draft ``x`` is a point mass
  ``q``, so it is accepted with probability ``min(1, p(x) / q(x)) = p(x)``;
  on rejection the emitted token is drawn from ``max(p - q, 0)``, i.e. ``p``
  without ``x``, renormalized. Either way the token has distribution ``p``,
  and the bonus row draws from ``p`` directly.

Draws use the sampler's exponential race (argmax of p / Exp(1) noise). A
seeded row takes its uniform and its noise from its own generator, seeded by
(request seed, output index), so the result depends only on the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol import TokenLogprobs
from services.worker.logprobs import token_logprobs
from services.worker.sampler import adjusted_logits, argmax_rows, random_probs
from services.worker.sampling_metadata import SamplingMetadata


@dataclass(frozen=True)
class RejectionOutput:
    token_ids: list[list[int]]  # per request: the accepted drafts, then one more token
    logprobs: list[list[TokenLogprobs]]  # per request, one per emitted token; empty if not asked


class RejectionSampler:
    def __init__(self, generator: torch.Generator, compiled_argmax: bool = False) -> None:
        self.generator = generator  # for unseeded random rows (the sampler's)
        self.compiled_argmax = compiled_argmax  # argmax_rows's ``compiled`` (the sampler's)

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]
    ) -> RejectionOutput:
        """logits [N, V] with N = sum(len(d) + 1 for d in drafts), request by request."""
        device = logits.device
        first_row = _first_rows(drafts)
        draft_rows = torch.tensor(
            [first_row[i] + j for i, d in enumerate(drafts) for j in range(len(d))],
            dtype=torch.long,
            device=device,
        )
        draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=device)
        draft_of_row = torch.full((logits.shape[0],), -1, dtype=torch.long, device=device)
        draft_of_row[draft_rows] = draft_ids  # [N], -1 on bonus rows

        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        adjusted = adjusted_logits(logits, meta)
        emitted = argmax_rows(adjusted, self.compiled_argmax)  # [N]: greedy rows emit the argmax
        accepted = emitted == draft_of_row  # [N]: greedy acceptance (never on bonus rows)
        if not meta.all_greedy:
            rows = (~meta.greedy).nonzero().squeeze(1)
            accepted[rows], emitted[rows] = self._random_rows(
                adjusted[rows], rows.tolist(), draft_of_row[rows], meta
            )

        num_accepted = _accepted_prefix_lengths(accepted.tolist(), drafts, first_row)
        emitted_list = emitted.tolist()
        token_ids = [
            d[:m] + [emitted_list[first_row[i] + m]] for i, (d, m) in enumerate(zip(drafts, num_accepted))
        ]
        logprobs = self._logprobs(raw_logprobs, token_ids, first_row, meta)
        return RejectionOutput(token_ids, logprobs)

    def _random_rows(
        self, logits: torch.Tensor, rows: list[int], drafts: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adjusted logits [R, V] of random rows, their drafts [R] (-1: bonus row)
        -> (accepted [R] bool, token drawn for the row [R])."""
        probs = random_probs(logits, rows, meta)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves them unnormalized
        has_draft = drafts >= 0
        index = drafts.clamp(min=0)[:, None]
        p_draft = probs.gather(1, index).squeeze(1)  # [R]
        # The recovered distribution: p without the draft (bonus rows keep all of p).
        rest = probs.scatter(1, index, torch.where(has_draft[:, None], 0.0, p_draft[:, None]))
        uniform, noise = self._draws(probs, rows, has_draft, meta)
        # A draft holding all the mass leaves nothing to recover: it is always
        # accepted (u < 1 = p(x) in exact arithmetic; guard the rounding).
        nothing_left = rest.sum(dim=-1) == 0
        accepted = has_draft & ((uniform < p_draft.double()) | nothing_left)
        return accepted, argmax_rows(rest / noise, self.compiled_argmax)

    def _draws(
        self, probs: torch.Tensor, rows: list[int], has_draft: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per random row: a uniform in [0, 1) (float64; used only by rows with a
        draft) and Exp(1) noise [R, V]. A seeded row with a draft draws its
        uniform first, then its noise; one without draws exactly as the
        ``Sampler`` does, so undrafted rows sample as they would without
        speculation."""
        uniform = torch.rand(len(rows), dtype=torch.float64, device=probs.device, generator=self.generator)
        noise = torch.empty_like(probs)
        if any(row not in meta.generators for row in rows):
            noise.exponential_(generator=self.generator)
        has = has_draft.tolist()
        for i, row in enumerate(rows):
            generator = meta.generators.get(row)
            if generator is None:
                continue
            if has[i]:
                uniform[i] = torch.rand((), dtype=torch.float64, device=probs.device, generator=generator)
            noise[i].exponential_(generator=generator)
        # An exact 0 would turn a zero-probability token into 0/0 = nan.
        return uniform, noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, token_ids: list[list[int]], first_row: list[int], meta: SamplingMetadata
    ) -> list[list[TokenLogprobs]]:
        """Logprobs (of the raw logits, as the sampler reports them) of each emitted token."""
        out: list[list[TokenLogprobs]] = [[] for _ in token_ids]
        if raw is None:
            return out
        picks = [
            (i, first_row[i] + j, t)
            for i, tokens in enumerate(token_ids)
            if meta.num_logprobs[first_row[i]] is not None
            for j, t in enumerate(tokens)
        ]
        if not picks:
            return out
        rows = torch.tensor([row for _, row, _ in picks], device=raw.device)
        tokens = torch.tensor([t for _, _, t in picks], device=raw.device)
        entries = token_logprobs(raw[rows], tokens, [meta.num_logprobs[row] for _, row, _ in picks])
        for (i, _, _), entry in zip(picks, entries):
            out[i].append(entry)
        return out


def _first_rows(drafts: list[list[int]]) -> list[int]:
    """Row of each request's first position in the flattened logits."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    return starts


def _accepted_prefix_lengths(
    accepted: list[bool], drafts: list[list[int]], first_row: list[int]
) -> list[int]:
    """Per request, how many drafts are accepted before the first rejection."""
    lengths = []
    for d, start in zip(drafts, first_row):
        m = 0
        while m < len(d) and accepted[start + m]:
            m += 1
        lengths.append(m)
    return lengths
