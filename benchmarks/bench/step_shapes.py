"""The fixed engine-step shapes ``weft bench profile`` measures, and how to set one up.

A shape is a number of sequences, a prompt length and a step count; a decode
shape is measured on requests already past their prefill. Shared by the
torch.profiler breakdown (``profile.py``) and the step-phase timing
(``step_phases.py``).
"""

from __future__ import annotations

import time

SHAPES = {  # name -> (sequences, prompt tokens, steps profiled)
    "decode-64": (64, 128, 8),
    "decode-16": (16, 128, 16),  # 16 concurrent streams, as `weft bench peers --concurrencies 16`
    "prefill-2048": (1, 2048, 1),
    "decode-1": (1, 128, 32),
    # Batch-1 decode of a prompt that repeats one 32-token span: the model goes on
    # copying it, so n-gram speculation (--speculative-config) has drafts to verify.
    "repeat-1": (1, 128, 32),
}
_REPEAT_SPAN = 32


def is_decode(shape: str) -> bool:
    return not shape.startswith("prefill")


def requests_for(llm, name: str, max_tokens: int, tag: str, seed: int):
    import numpy as np

    from protocol import EngineCoreRequest, SamplingParams

    num_seqs, prompt_len, _ = SHAPES[name]
    rng = np.random.default_rng(seed)  # a seed per phase: no prefix-cache hits across phases
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = llm.config.model.vocab_size

    def prompt() -> list[int]:
        if not name.startswith("repeat"):
            return rng.integers(0, vocab, prompt_len).tolist()
        return np.resize(rng.integers(0, vocab, _REPEAT_SPAN), prompt_len).tolist()

    return [
        EngineCoreRequest(
            request_id=f"{tag}-{i}",
            prompt_token_ids=prompt(),
            sampling_params=params,
            arrival_time=time.time(),
            eos_token_id=None,
        )
        for i in range(num_seqs)
    ]


def start_shape(llm, name: str, tag: str, seed: int, max_tokens: int) -> list[str]:
    """Add the shape's requests; for a decode shape, step until all are prefilled."""
    requests = requests_for(llm, name, max_tokens, f"{name}-{tag}", seed)
    for request in requests:
        llm.engine.add_request(request)
    if is_decode(name):  # the measured steps are then pure decode
        seen: set[str] = set()
        while len(seen) < len(requests):
            seen.update(o.request_id for o in llm.engine.step().outputs)
    return [r.request_id for r in requests]
