"""Checks on ``--tensor-parallel-size`` that need only the model's config.

Run when the engine config is built (torch-free, before any process
starts), so a model that does not split over the ranks is refused at once
with what to change, instead of failing inside the workers.
"""

from __future__ import annotations


def check_tensor_parallel(hf_config: dict, tensor_parallel_size: int, speculative: bool = False) -> None:
    """ValueError unless the model's heads and MLP split evenly over the ranks.

    Query heads and the MLP width must divide by the size; KV heads must
    divide by it, or divide it (then each KV head is replicated on
    ``size / kv_heads`` ranks).
    """
    size = tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}.")
    if size == 1:
        return
    if speculative:
        # Only the driver rank gets logits; the speculative sampler does not
        # yet hand its accepted tokens to the other ranks.
        raise ValueError("Speculative decoding does not support tensor_parallel_size > 1 yet.")
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    intermediate = hf_config["intermediate_size"]
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads % size and size % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}) neither divides it nor is divisible by it")
    if intermediate % size:
        problems.append(f"intermediate_size ({intermediate}) is not divisible by it")
    if problems:
        sizes = [
            n
            for n in range(1, heads + 1)
            if not heads % n and (not kv_heads % n or not n % kv_heads) and not intermediate % n
        ]
        raise ValueError(
            f"tensor_parallel_size {size} does not fit this model: {'; '.join(problems)}. "
            f"Sizes that fit: {', '.join(map(str, sizes))}."
        )
