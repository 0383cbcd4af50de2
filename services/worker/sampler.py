"""Pick each request's next token from its logits, vectorized over the batch.

Order (all rows, as vLLM): allowed_token_ids, logit_bias, penalties, then
the bans (min_tokens, bad_words) -> greedy rows take the argmax -> random
rows: temperature, top-k, top-p, min-p, then one draw.
Logprobs are reported from the raw logits, before any of these.

Random draws use the exponential trick: argmax(p / q) with q ~ Exp(1) per
token picks token i with probability p_i, and lets each row take its noise
from its own generator: seeded rows from a generator seeded by (seed,
output index), the rest from the worker's generator in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_fused
from protocol import TokenLogprobs
from services.worker.logprobs import token_logprobs
from services.worker.penalties import add_logit_bias, apply_penalties, ban_tokens, restrict_tokens
from services.worker.sampling_metadata import SamplingMetadata


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    logprobs: list[TokenLogprobs | None]  # per row; None where not asked


def argmax_rows(x: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Each row's index of its maximum, the first one on ties (a NaN in a row is its maximum): what
    ``argmax(dim=-1)`` returns. With ``compiled`` (decided once by the sampler's owner: a CPU model
    runner with the compiled kernels available, as its layers take them), fp32 rows on the CPU take
    the compiled kernel (``kernels.cpu_fused.argmax_rows``: Gemma 3's 262,144 logits in 62 us against
    torch's 331); others ``max(dim=-1)``, whose CPU kernel is vectorized where ``argmax``'s is not (a
    [64, 49,152] fp32 batch on 2 threads: 0.84 ms against 2.03)."""
    on_kernel = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0
    if compiled and on_kernel and x.stride(1) == 1:
        return cpu_fused.argmax_rows(x)
    return x.max(dim=-1).indices


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu", compiled_argmax: bool = False) -> None:
        # Noise for unseeded random requests; seeded ones bring their own.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.compiled_argmax = compiled_argmax  # argmax_rows's ``compiled``

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] fp32 -> sampled ids [N] and the logprobs rows asked for."""
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = adjusted_logits(logits, meta)
        token_ids = argmax_rows(logits, self.compiled_argmax)  # [N]
        if not meta.all_greedy:
            rows = (~meta.greedy).nonzero().squeeze(1)  # random rows only
            token_ids[rows] = self._sample_random(logits[rows], rows.tolist(), meta)
        return SamplerOutput(token_ids, self._logprobs(raw_logprobs, token_ids, meta))

    def _sample_random(self, logits: torch.Tensor, rows: list[int], meta: SamplingMetadata) -> torch.Tensor:
        """logits [R, V] of the random rows (batch rows ``rows``) -> token ids [R]."""
        probs = random_probs(logits, rows, meta)  # [R, V]
        return argmax_rows(probs / self._exponential_noise(probs, rows, meta), self.compiled_argmax)

    def _exponential_noise(
        self, probs: torch.Tensor, rows: list[int], meta: SamplingMetadata
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)  # [R, V]
        if any(row not in meta.generators for row in rows):
            noise.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row in meta.generators:
                noise[i].exponential_(generator=meta.generators[row])
        # An exact 0 would turn a zero-probability token into 0/0 = nan.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _logprobs(
        self, raw: torch.Tensor | None, token_ids: torch.Tensor, meta: SamplingMetadata
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * meta.num_rows
        if raw is None:
            return out
        rows = [i for i, n in enumerate(meta.num_logprobs) if n is not None]
        index = torch.tensor(rows, device=raw.device)
        entries = token_logprobs(raw[index], token_ids[index], [meta.num_logprobs[i] for i in rows])
        for row, entry in zip(rows, entries):
            out[row] = entry
        return out


def adjusted_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Token filters, logit_bias, penalties and bans, which greedy rows obey too:
    logits [N, V] -> [N, V] (a new tensor when anything applies; the input is never changed)."""
    if meta.allowed or meta.logit_bias:
        logits = logits.clone()
        restrict_tokens(logits, meta.allowed)
        add_logit_bias(logits, meta.logit_bias)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.banned:
        fresh = meta.penalties is not None or meta.allowed or meta.logit_bias
        logits = logits if fresh else logits.clone()
        ban_tokens(logits, meta.banned)
    return logits


def random_probs(logits: torch.Tensor, rows: list[int], meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: adjusted logits [R, V] of batch rows
    ``rows`` -> probabilities [R, V] after temperature, top-k, top-p and min-p
    (min-p leaves them unnormalized; a draw only needs proportions)."""
    logits = logits / meta.temperature[rows, None]
    top_k = None if meta.top_k is None else meta.top_k[rows]
    top_p = None if meta.top_p is None else meta.top_p[rows]
    if top_k is not None or top_p is not None:
        logits = _mask_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)  # [R, V]
    if meta.min_p is not None:
        floor = meta.min_p[rows, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep, per row, the k most likely tokens, then the smallest set of those
    whose probability reaches top_p; the rest get -inf. logits [N, V]."""
    vocab = logits.shape[1]
    if top_p is None:
        # top_k alone: a partial sort up to the largest k is enough.
        k_max = int(top_k.max())
        values = logits.topk(k_max, dim=-1).values  # [N, k_max], descending
        threshold = values.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
        return logits.masked_fill(logits < threshold, float("-inf"))
    ordered = logits.sort(dim=-1, descending=True).values  # [N, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    if top_k is not None:
        ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # A token is needed while the mass before it is still short of top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p[:, None]) & (ordered > float("-inf"))
    keep[:, 0] = True
    num_kept = keep.sum(dim=-1)  # [N]
    threshold = ordered.gather(1, (num_kept - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))
