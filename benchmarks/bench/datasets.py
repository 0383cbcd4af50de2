"""Workloads from other sources: random token prompts and ShareGPT files.

Both become a ``Workload`` (so every bench command takes them the same way)
with ``ignore_eos`` forced: output lengths are exact.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from benchmarks.bench.workload import (
    Workload,
    WorkloadRequest,
    load_workload,
    resolve_dataset,
)


def random_workload(
    input_len: int, output_len: int, num_prompts: int, vocab_size: int, seed: int = 0, tokenizer: Any = None
) -> Workload:
    """``num_prompts`` prompts of ``input_len`` uniform random token ids."""
    for name, value in (
        ("input length", input_len),
        ("output length", output_len),
        ("num prompts", num_prompts),
    ):
        if value < 1:
            raise ValueError(f"random {name} must be at least 1, got {value}.")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        ids = [rng.randrange(vocab_size) for _ in range(input_len)]
        # The text is for chat endpoints only; completions send the ids.
        text = tokenizer.decode(ids) if tokenizer is not None else ""
        requests.append(WorkloadRequest(prompt=text, prompt_token_ids=ids, max_tokens=output_len))
    return Workload(name=f"random-{input_len}x{output_len}x{num_prompts}", requests=requests)


def load_sharegpt(path: Path, tokenizer: Any, num_prompts: int | None = None) -> Workload:
    """ShareGPT conversations: the first human turn is the prompt, the gpt turn's
    token length the output length. Conversations without both are skipped."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read ShareGPT file {path}: {e}.") from e
    requests = []
    for entry in entries:
        turns = entry.get("conversations") or entry.get("conversation") or []
        pair = _first_exchange(turns)
        if pair is None:
            continue
        prompt_ids = tokenizer.encode(pair[0], add_special_tokens=False)
        output_len = len(tokenizer.encode(pair[1], add_special_tokens=False))
        if prompt_ids and output_len:
            requests.append(
                WorkloadRequest(prompt=pair[0], prompt_token_ids=prompt_ids, max_tokens=output_len)
            )
        if num_prompts is not None and len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"ShareGPT file {path} has no conversation with a human turn and a gpt reply.")
    return Workload(name=Path(path).stem, requests=requests)


def _first_exchange(turns: list[dict[str, Any]]) -> tuple[str, str] | None:
    for human, reply in zip(turns, turns[1:]):
        if human.get("from") in ("human", "user") and reply.get("from") in ("gpt", "assistant"):
            return human.get("value", ""), reply.get("value", "")
    return None


def is_sharegpt(path: Path) -> bool:
    """A ShareGPT file is a JSON list; a weft workload is an object."""
    with open(path, "rb") as f:
        head = f.read(256).lstrip()
    return head.startswith(b"[")


def load_any(dataset: str, tokenizer_dir: Any = None, num_prompts: int | None = None) -> Workload:
    """A workload file, a bare workload name, or a ShareGPT file (tokenized with
    the tokenizer in ``tokenizer_dir``, the default model's when None)."""
    path = resolve_dataset(dataset)
    if path.exists() and is_sharegpt(path):
        return load_sharegpt(path, default_tokenizer(tokenizer_dir), num_prompts)
    workload = load_workload(path)
    return workload.head(num_prompts) if num_prompts else workload


def default_tokenizer(hf_dir: Any = None) -> Any:
    from services.api.tokenizer import Tokenizer
    from services.model_files import resolve

    return Tokenizer(hf_dir if hf_dir is not None else resolve(None).hf_dir)
