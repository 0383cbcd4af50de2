"""Write ``benchmarks/workloads/repetitive-8.json``: prompts whose continuation repeats text
they contain (code, records, a chorus), the case n-gram speculation is for.

Each prompt gives some code or text more than once and stops part-way into
another copy, or asks for it to be repeated; the model's greedy continuation
copies long runs of the prompt. Tokenized with the default model's tokenizer
(no special tokens added), in the shared workload format
(``benchmarks/workloads/README.md``); output lengths are exact (``ignore_eos``).

    weft bench make-workload repetitive-8
"""

from __future__ import annotations

from benchmarks.bench.workload import workload_file
from services.api.tokenizer import Tokenizer

PY_CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def sub(a, b):
    """Return the difference of a and b."""
    return a - b


def mul(a, b):
    """Return the product of a and b."""
    return a * b


'''

JS_CODE = """function clamp(value, low, high) {
  if (value < low) {
    return low;
  }
  if (value > high) {
    return high;
  }
  return value;
}

"""

SQL_ROWS = "".join(
    f"INSERT INTO users (id, name, email, active) VALUES ({i}, 'user{i}', 'user{i}@example.com', true);\n"
    for i in range(1, 9)
)

YAML_RECORD = """- name: worker
  image: weft/worker:latest
  replicas: 2
  resources:
    cpu: "2"
    memory: 4Gi
  env:
    - name: LOG_LEVEL
      value: info
"""

CHORUS = (
    "And we sail on, we sail on, over the silver sea,\n"
    "the wind in the sails and the stars in the sky, calling you home to me.\n"
)
VERSE = (
    "The harbour lights are fading now, the gulls have gone to sleep,\n"
    "the nets are dry, the boats are tied, the tide is running deep.\n"
)

PARAGRAPH = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the year "
    "the only visitors were gulls. Its keeper kept a logbook in which he wrote the weather "
    "every morning and the ships he saw every afternoon."
)

TABLE_ROW = "| {n} | sensor-{n} | online | 21.5 C | 45 % |\n"

LOG = "".join(
    f"2024-05-01 12:00:{s:02d} INFO worker-{s % 3} heartbeat ok, queue=0, latency=3ms\n" for s in range(12)
)


def prompts() -> list[tuple[str, int]]:
    """(prompt text, output tokens)."""
    table = "| id | name | status | temperature | humidity |\n|---|---|---|---|---|\n"
    table += "".join(TABLE_ROW.format(n=n) for n in range(1, 7))
    return [
        (PY_CODE + PY_CODE + 'def add(a, b):\n    """Return the sum', 256),
        ("// Helpers, copied into each module.\n" + JS_CODE + JS_CODE + "function clamp(", 192),
        (SQL_ROWS, 192),
        ("services:\n" + YAML_RECORD + YAML_RECORD + "- name:", 160),
        (VERSE + CHORUS + "\n" + VERSE + CHORUS + "\n" + VERSE, 192),
        ("Text: " + PARAGRAPH + "\nThe same text again: ", 160),
        (table, 192),
        (LOG, 128),
    ]


def build(tokenizer: Tokenizer) -> dict:
    """The workload as a JSON-ready dict, tokenized with ``tokenizer``."""
    requests = []
    for text, max_tokens in prompts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        requests.append({"prompt": text, "prompt_token_ids": ids, "max_tokens": max_tokens})
    return workload_file(
        "repetitive-8",
        "8 prompts that repeat code or text and stop inside another copy (n-gram "
        "speculative decoding); built by `weft bench make-workload repetitive-8`",
        requests,
    )
