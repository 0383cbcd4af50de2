"""The Hugging Face baseline: ``generate`` with static batching.

Requests run in fixed batches, in workload order, each left-padded to its
batch's longest prompt and decoded for its batch's largest ``max_tokens``
(``min_new_tokens`` too, so EOS never ends a row early: the workload's
ignore_eos). Only each request's own ``max_tokens`` count as output; the
rest of its row is the waste of static batching that continuous batching
avoids, and is what this baseline is here to show.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.bench.throughput import BenchResult
from benchmarks.bench.workload import Workload, WorkloadRequest
from services.model_files import resolve

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(model: str | None, dtype: str, device: str = "cpu") -> Any:
    """The HF model for ``--model`` (a GGUF file, dequantized, or an HF folder)."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    files = resolve(model)
    if files.is_gguf:
        hf_model = AutoModelForCausalLM.from_pretrained(
            files.weights.parent, gguf_file=files.weights.name, dtype=_DTYPES[dtype]
        )
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(files.weights, dtype=_DTYPES[dtype])
    return hf_model.to(device).eval()


def run_hf_baseline(workload: Workload, hf_model: Any, batch_size: int = 16) -> BenchResult:
    """Time ``generate`` over the workload in batches of ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    requests = workload.requests
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    _warm_up(hf_model, requests[0])
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = [tokens for batch in batches for tokens in generate_batch(hf_model, batch)]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return BenchResult(
        backend="hf",
        num_requests=len(outputs),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=sum(len(tokens) for tokens in outputs),
        elapsed_s=elapsed,
        cpu_s=cpu,
        details={
            "batch_size": batch_size,
            "dtype": str(hf_model.dtype).removeprefix("torch."),
            "device": str(hf_model.device),
            "torch_threads": torch.get_num_threads(),
            # Every row decodes its batch's longest output: padding included.
            "generated_tokens": sum(len(b) * max(r.max_tokens for r in b) for b in batches),
        },
    )


def generate_batch(hf_model: Any, batch: Sequence[WorkloadRequest]) -> list[list[int]]:
    """Greedy-decode one static batch; each request keeps its own ``max_tokens``."""
    num_new = max(r.max_tokens for r in batch)
    new_tokens = _generate(hf_model, [r.prompt_token_ids for r in batch], num_new)
    return [row[: r.max_tokens].tolist() for row, r in zip(new_tokens, batch)]


def _warm_up(hf_model: Any, request: WorkloadRequest) -> None:
    """One short untimed run, so first-call costs do not land in the figures."""
    _generate(hf_model, [request.prompt_token_ids], num_new=2)


@torch.inference_mode()
def _generate(hf_model: Any, prompts: list[list[int]], num_new: int) -> torch.Tensor:
    """Exactly ``num_new`` greedy tokens per prompt: [B, num_new]."""
    input_ids, attention_mask = _left_pad(prompts, hf_model.device)
    sequences = hf_model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=num_new,
        min_new_tokens=num_new,  # suppresses EOS until the end: ignore_eos
        do_sample=False,
        pad_token_id=_pad_token_id(hf_model),
    )
    new_tokens = sequences[:, input_ids.shape[1] :]  # [B, num_new]
    assert new_tokens.shape[1] == num_new, "min_new_tokens keeps every row going"
    return new_tokens


def _left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align the prompts, so every row's next token lands in the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _pad_token_id(hf_model: Any) -> int:
    # Padded positions are masked out, so any id does; prefer the model's own.
    config = hf_model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, list):  # several EOS ids: any one
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return 0
