"""Write ``benchmarks/workloads/pd-mixed.json``: ongoing streams, then long prompts.

Six streams (short prompts, 128 output tokens each) come first; three long
prompts (over 2,000 tokens, 8 output tokens each) follow, so with a modest
request rate they arrive while the streams are still decoding -- the case
disaggregated prefill/decode is for. Each long prompt opens with its own
header line, so no two share a prefix-cache block. Tokenized with the
default model's tokenizer (no special tokens), in the shared workload format
(``benchmarks/workloads/README.md``); output lengths are exact (``ignore_eos``).

    weft bench make-workload pd-mixed
"""

from __future__ import annotations

from benchmarks.bench.workload import workload_file
from services.api.tokenizer import Tokenizer

LONG_PROMPT_TOKENS = 2048
STREAM_TOKENS = 128
LONG_OUTPUT_TOKENS = 8

STREAM_PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step and in detail, how a paged KV cache serves many requests at once.",
    "Describe a walk through a busy harbour town on a spring morning, street by street.",
    "List and explain twenty tips for cooking rice, pasta and bread at home.",
    "Tell the history of the bicycle from the first wooden machines to today.",
    "Write a letter from a migrating goose to the farmers of the valley it flies over.",
]

PASSAGE = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls. Its keeper kept a logbook in which he wrote the weather every morning, the "
    "ships he saw every afternoon, and a single sentence about his day every night. In the spring the "
    "town below would wake up: fishing boats were painted in bright colours, the bakery opened its "
    "shutters before dawn, and children ran along the harbour wall collecting shells. "
)


def long_prompt(tokenizer: Tokenizer, index: int) -> tuple[str, list[int]]:
    """A header of its own, then the passage until LONG_PROMPT_TOKENS, then a question."""
    header = f"Archive report number {index + 1} of the harbour society, copied by hand:\n"
    question = "\nIn one sentence, what did the keeper write every night?"
    body, ids = "", []
    while len(ids) < LONG_PROMPT_TOKENS:
        body += PASSAGE
        ids = tokenizer.encode(header + body + question, add_special_tokens=False)
    return header + body + question, ids


def build(tokenizer: Tokenizer) -> dict:
    """The workload as a JSON-ready dict, tokenized with ``tokenizer``."""
    requests = [
        {
            "prompt": p,
            "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False),
            "max_tokens": STREAM_TOKENS,
        }
        for p in STREAM_PROMPTS
    ]
    for index in range(3):
        text, ids = long_prompt(tokenizer, index)
        requests.append({"prompt": text, "prompt_token_ids": ids, "max_tokens": LONG_OUTPUT_TOKENS})
    return workload_file(
        "pd-mixed",
        f"6 streams ({STREAM_TOKENS} output tokens) then 3 prompts of {LONG_PROMPT_TOKENS}+ "
        "tokens arriving while they decode; built by `weft bench make-workload pd-mixed`",
        requests,
    )
