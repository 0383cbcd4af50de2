"""Engine arguments on the command line, named as vLLM names them.

Flags are generated from ``EngineArgs``; their help comes from the field
descriptions of the protocol config tree, so the two cannot drift apart, and
every default it states is rendered from the field or constant that holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from protocol import config as config_module
from services.config.dense_copy import (
    AMX_INT8_MAX_ROWS,
    AVX2_INT8_DENSE_MIN_ROWS,
    DEFAULT_DENSE_MIN_ROWS,
    INT8_MIN_ROWS,
    OWN_INT8_GEMM_DENSE_MIN_ROWS,
)
from services.config.engine_args import (
    AVX2_STEP_BUDGET,
    CPU_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STEP_BUDGET,
    GPU_BLOCK_SIZE,
    LONG_PREFILL_PERCENT,
    EngineArgs,
)
from services.config.memory_plan import MIN_FITTED_MAX_MODEL_LEN

_EXTRA_HELP = {
    "model": "GGUF file or Hugging Face model folder (default: SmolLM2-135M-Instruct).",
    "tokenizer": "Tokenizer folder (default: the model's).",
    "served_model_name": "Model name(s) the API serves: responses report the first, requests may name any "
    "(default: the model file's name).",
    "device": "cpu, cuda or auto.",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bf16 on GPUs, and on CPUs with AMX or AVX-512 bf16 "
    "where batched steps run dense weights; else fp32).",
    "num_threads": "torch threads per engine process (default: OMP_NUM_THREADS where set, else cores / local engines).",
    "max_num_batched_tokens": f"Token budget of one engine step (default {DEFAULT_STEP_BUDGET}; "
    f"{AVX2_STEP_BUDGET} on a CPU with neither AMX nor AVX-512 VNNI, where a {DEFAULT_STEP_BUDGET}-token "
    "prefill takes seconds; without chunked prefill at least max_model_len).",
    "max_num_seqs": f"Most requests running at once (default {DEFAULT_MAX_NUM_SEQS}).",
    "max_model_len": "Longest prompt + output in tokens (default: the model's, lowered to what the KV cache "
    f"holds when one such sequence does not fit, to no fewer than {MIN_FITTED_MAX_MODEL_LEN} tokens).",
    "kv_cache_memory": "Bytes of KV cache per worker, as vLLM's --kv-cache-memory: the weights and activations "
    "come on top (default: on CPU, from --cpu-memory-utilization; on CUDA, from --gpu-memory-utilization).",
    "cpu_memory_utilization": "CPU: fraction of the memory available when the engines start (MemAvailable, or "
    "the container's cgroup limit minus usage when lower) that this node's engine processes may use "
    "together, split evenly; each one's KV cache gets what its runtime, weights and activation peak "
    "leave.",
    "block_size": f"Tokens per KV cache block (default: {CPU_BLOCK_SIZE} on CPU, as vLLM's CPU backend; "
    f"{GPU_BLOCK_SIZE} on CUDA).",
    "max_num_partial_prefills": "Prompts a step may leave partway through their prefill. Above 1, "
    "at most --max-long-partial-prefills of a step's prefills are long ones, so shorter prompts queued "
    "behind a long one start first.",
    "long_prefill_token_threshold": "Most tokens of one prompt a step takes (0: no cap; default auto: with "
    "--max-num-partial-prefills above 1, "
    f"{LONG_PREFILL_PERCENT}%% of --max-model-len; else on a CPU, for a model larger than the default one, "
    "the step budget scaled down by its multiply-adds a token, so a prompt's chunk holds up the running "
    "requests' next tokens about as long at every model size, and that cap bounds all prompts of a step "
    "together while requests decode beside them; else no cap).",
    "max_long_partial_prefills": "Long prefills (over --long-prefill-token-threshold tokens left; default "
    f"{LONG_PREFILL_PERCENT}%% of --max-model-len) a step may carry when --max-num-partial-prefills is "
    "above 1.",
    "generation_config": "Where requests' sampling defaults and extra stop tokens come from, as vLLM's: "
    "auto (the model folder's generation_config.json), vllm (none: vLLM's own defaults), or a folder "
    "holding a generation_config.json.",
    "load_format": "auto (read the checkpoint) or dummy (random weights of the config's shape; benchmarks).",
    "quantization": "gguf (keep a GGUF file's quantized weights packed; the default for GGUF files on CPU) "
    "or none (dequantize to --dtype at load).",
    "dense_min_rows": "With --quantization gguf: steps of at least this many rows run a dense copy of each "
    "weight, fewer rows the packed kernels; 0 keeps no copy (default auto: no copy, the weights resident "
    "once and a row's output independent of its batch; with --dense-copy-dtype model or int8 given alone, "
    f"{AVX2_INT8_DENSE_MIN_ROWS} with the int8 copy on weft's own AVX2 int8 GEMM, "
    f"{OWN_INT8_GEMM_DENSE_MIN_ROWS} on its AMX int8 tiles or AVX-512 VNNI GEMMs, and "
    f"{DEFAULT_DENSE_MIN_ROWS} otherwise). A copy costs memory and batch invariance.",
    "dense_copy_dtype": "model (the dense copy in --dtype alone), int8 (an int8 copy beside it, one more "
    "byte a weight: activations rotated and rounded to int8 per row, then integer GEMMs at a small cost "
    f"in accuracy; weft's own GEMMs run it for the dense copy's steps, up to {AMX_INT8_MAX_ROWS} rows on AMX "
    f"int8 tiles and every step on AVX-512 VNNI or AVX2, elsewhere torch's for steps of {INT8_MIN_ROWS} rows "
    "and more), or auto "
    "(default: int8 with a bf16 --dtype on a CPU with AMX int8 tiles, or with AVX-512 VNNI and bf16, "
    "and with the float32 that --dtype auto picks where weft's own int8 GEMM runs; one worker, where "
    "both copies fit the memory rule; else model).",
    "kv_cache_dtype": "What the KV cache stores: model (the model dtype), int8 (one byte an element and an "
    "fp32 scale per token and KV head: 1.88x the tokens of a bf16 cache in the same memory, and faster "
    "decode attention; CPU only), or auto (default: int8 on CPU for a bf16 model where the compiled "
    "attention kernels run its decodes on int8 dot products: head sizes 64 and 128, AVX-512 bf16 and "
    "VNNI; else model). fp8 is refused.",
    "structured_outputs_compile_timeout": "Seconds a request's grammar may take to compile before the "
    "request fails.",
    "speculative_config": 'Speculative decoding as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
    "(default: off).",
    "kv_transfer_config": 'Disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "ZmqConnector", '
    '"kv_role": "kv_consumer", "kv_ip": "127.0.0.1", "kv_port": 14579}\' '
    "(kv_role: kv_producer, kv_consumer or kv_both; default: off).",
    "pooler": "How /v1/embeddings pools a prompt's hidden states (after the final norm) into one "
    "L2-normalized vector: last (the last token's), mean, or auto (default: what a sentence-transformers "
    "checkpoint's modules.json and 1_Pooling/config.json say, else last, as decoder embedding models pool).",
    "kv_events_config": 'KV cache events as JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
    '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5657", "topic": ""}\' '
    "(vLLM's names; each DP rank offsets the ports by its rank; hashes only unless include_token_ids; "
    "a host other than loopback needs --zmq-curve-keys; default: off).",
}


# Flags that take one or more values (vLLM's nargs="+").
_SEVERAL = ("served_model_name",)


def _descriptions() -> dict[str, str]:
    found: dict[str, str] = {}
    for struct in (
        config_module.ModelConfig,
        config_module.CacheConfig,
        config_module.SchedulerConfig,
        config_module.ParallelConfig,
        config_module.DeviceConfig,
    ):
        for name, hint in typing.get_type_hints(struct, include_extras=True).items():
            for meta in getattr(hint, "__metadata__", ()):
                if getattr(meta, "description", None):
                    found[name] = meta.description
    return found | _EXTRA_HELP


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine arguments")
    help_text = _descriptions()
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        text = help_text.get(f.name)
        if f.name in _SEVERAL:
            group.add_argument(flag, nargs="+", default=f.default, help=text)
        elif f.type in ("bool", bool):
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=with_default(text, f.default),
            )
        else:
            kind = float if "float" in str(f.type) else int if "int" in str(f.type) else str
            group.add_argument(flag, type=kind, default=f.default, help=with_default(text, f.default))


def with_default(text: str | None, default: object) -> str | None:
    """``text`` ending with the flag's default, unless the default is None (the text says what
    decides it then) or the text already tells it."""
    if text is None or default is None or "default" in text:
        return text
    return f"{text.removesuffix('.')} (default: %(default)s)."


def engine_args_from(namespace: argparse.Namespace, skip: tuple[str, ...] = ()) -> EngineArgs:
    values = vars(namespace)
    return EngineArgs(
        **{
            f.name: values[f.name]
            for f in dataclasses.fields(EngineArgs)
            if f.name in values and f.name not in skip
        }
    )
