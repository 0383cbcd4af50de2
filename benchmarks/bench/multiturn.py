"""A synthetic multi-turn chat workload: each turn's prompt extends the previous turn's.

Conversation ``c``'s turn ``k`` is its system prompt, then for every earlier
turn the user message and an answer, then turn ``k``'s user message. The
answers are synthetic (fixed token ids standing in for what the model said):
the prompt a turn reuses is the previous turn's prompt and answer, as a chat
client resends the history. Requests are ordered turn by turn (every
conversation's turn 1, then every turn 2, ...), so with a concurrency at or
below the number of conversations a turn is mostly sent after the previous
turn of its conversation was answered, as real clients do.
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks.bench.workload import Workload, WorkloadRequest

# Clear of the special tokens at the start of the vocabulary.
_FIRST_ID = 1000


def multiturn_workload(
    *,
    num_conversations: int = 8,
    num_turns: int = 4,
    system_len: int = 256,
    user_len: int = 32,
    answer_len: int = 32,
    output_len: int = 32,
    vocab_size: int = 49152,
    seed: int = 0,
    tokenizer: Any = None,
) -> Workload:
    """``num_conversations * num_turns`` requests of ``output_len`` tokens each."""
    for name, value in (
        ("num_conversations", num_conversations),
        ("num_turns", num_turns),
        ("system_len", system_len),
        ("user_len", user_len),
        ("output_len", output_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    if answer_len < 0 or vocab_size <= _FIRST_ID:
        raise ValueError("answer_len must be non-negative and vocab_size above the special tokens.")
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(_FIRST_ID, vocab_size) for _ in range(n)]

    histories = [ids(system_len) for _ in range(num_conversations)]
    requests = []
    for _ in range(num_turns):
        for c in range(num_conversations):
            prompt = histories[c] + ids(user_len)
            # The text is for chat endpoints only; completions send the ids.
            text = tokenizer.decode(prompt) if tokenizer is not None else ""
            requests.append(WorkloadRequest(prompt=text, prompt_token_ids=prompt, max_tokens=output_len))
            histories[c] = prompt + ids(answer_len)
    return Workload(
        name=f"multiturn-{num_conversations}x{num_turns}",
        description=f"{num_conversations} conversations x {num_turns} turns: system {system_len}, "
        f"user {user_len}, answer {answer_len} tokens per turn, {output_len} output tokens, seed {seed}",
        requests=requests,
        total_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        total_output_tokens=output_len * len(requests),
    )
