"""``weft bench gpu``: the GPU figures of scripts/gpu_check.sh, one line each ("gpu_check | ...").

    weft bench gpu e2e          # default model, greedy: Triton + CUDA graphs vs eager torch, fp32 and bf16
    weft bench gpu kernels      # paged attention kernel vs torch SDPA, Llama-3-8B heads, bf16
    weft bench gpu serve        # weft serve --gpu-memory-utilization 0.9: 64 concurrent streams over HTTP
    weft bench gpu throughput   # dummy-weight Llama-3-8B: decode tok/s at batch 1/32/256, prefill tok/s,
                                # TTFT, peak memory

``--model`` and ``--load-format dummy`` run e2e and serve on another model (the GPU bundle carries
the default model's config and tokenizer without its GGUF: its shape with random weights).

``--smoke`` runs the same code on CPU with tiny shapes (Triton interpreted),
to check the script itself where there is no GPU; its figures mean nothing.
Exit status 1 when a check fails (the e2e tokens differ).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B), for dummy weights.
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=128001,
)
TINY = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def report(line: str) -> None:
    print(f"gpu_check | {line}", flush=True)


def device_kind(smoke: bool) -> str:
    return "cpu" if smoke else "cuda"


def release(llm) -> None:
    import torch

    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- end to end -------------------------------------------------------------------------------

E2E_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "1, 1, 2, 3, 5, 8,",
]


def e2e(smoke: bool, model: str | None = None, load_format: str = "auto") -> int:
    """fp32: every token identical. bf16: every prompt's first token identical (later ones may part
    where two logits tie within bf16's rounding), and the share of identical tokens reported."""
    failed = 0
    for dtype in ("float32",) if smoke else ("float32", "bfloat16"):
        failed += _e2e_parity(smoke, model, load_format, dtype)
    return 1 if failed else 0


def _e2e_parity(smoke: bool, model: str | None, load_format: str, dtype: str) -> int:
    from services import LLM, SamplingParams

    prompts = E2E_PROMPTS[:1] if smoke else E2E_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=2 if smoke else 16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        os.environ["WEFT_ATTENTION_BACKEND"] = backend
        llm = LLM(
            model,
            device=device_kind(smoke),
            dtype=dtype,
            load_format=load_format,
            max_model_len=512,
            kv_cache_memory=4 << 30,
            max_num_seqs=8,
            enforce_eager=backend == "torch",
            num_threads=1,
        )
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        release(llm)
    pairs = [(a, b) for want, got in zip(tokens["torch"], tokens["triton"]) for a, b in zip(want, got)]
    same = sum(a == b for a, b in pairs)
    if dtype == "float32":
        ok = tokens["torch"] == tokens["triton"]
    else:
        ok = all(want[:1] == got[:1] for want, got in zip(tokens["torch"], tokens["triton"]))
    weights = "random weights" if load_format == "dummy" else "weights"
    report(
        f"e2e greedy {dtype}, {model or 'default model'} ({weights}), {len(prompts)} prompts x "
        f"{params.max_tokens} tokens, triton + CUDA graphs vs eager torch: {same}/{len(pairs)} tokens "
        f"identical -> {'OK' if ok else 'MISMATCH'}"
    )
    if not ok:
        report(f"  torch:  {tokens['torch']}\n  triton: {tokens['triton']}")
    return 0 if ok else 1


# --- serving over HTTP ------------------------------------------------------------------------------

SERVE_REQUESTS = 64


def serve(smoke: bool, model: str | None = None, load_format: str = "auto") -> int:
    """``weft serve --gpu-memory-utilization 0.9`` answering 64 concurrent streamed completions."""
    import asyncio

    from benchmarks.stack import Stack

    args = ["--max-model-len", "1024", "--load-format", load_format]
    if smoke:  # interpreted kernels: small steps
        args += ["--device", "cpu", "--kv-cache-memory", str(1 << 28), "--max-num-batched-tokens", "32"]
        args += ["--max-num-seqs", "4", "--dtype", "float32"]
    else:
        args += ["--gpu-memory-utilization", "0.9"]
    log_dir = Path(tempfile.mkdtemp(prefix="weft-gpu-serve-"))
    if smoke:  # the tiny shape: interpreted kernels over the default model's 30 layers take minutes
        write_dummy_model(log_dir, {**TINY, "vocab_size": 49152})  # the tokenizer's ids
        model, args[args.index("--load-format") + 1] = str(log_dir), "dummy"
    if model is not None:
        args += ["--model", model]
    stack = Stack(args, log_dir, startup_timeout_s=240)
    try:
        health = stack.wait_healthy()
        requests = 4 if smoke else SERVE_REQUESTS
        start = time.perf_counter()
        errors, tokens = asyncio.run(_streams(stack.url, requests, max_tokens=4 if smoke else 64))
        seconds = time.perf_counter() - start
    except Exception as exc:
        report(f"serve: FAILED ({type(exc).__name__}: {str(exc)[-2000:]})")
        return 1
    finally:
        stack.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    report(
        f"serve --gpu-memory-utilization 0.9: {requests} concurrent streamed completions, {len(errors)} errors, "
        f"{tokens} tokens in {seconds:.1f} s ({tokens / seconds:.0f} tokens/s); health {json.dumps(health)[:200]}"
    )
    for error in errors[:3]:
        report(f"  error: {error}")
    return 1 if errors else 0


async def _streams(url: str, n: int, max_tokens: int) -> tuple[list[str], int]:
    import asyncio

    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: the numbers from one to ten are", max_tokens=max_tokens,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        count = 0
        async for chunk in stream:
            count += sum(1 for choice in chunk.choices if choice.text)
        return count

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    await client.close()
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return errors, sum(r for r in results if isinstance(r, int))


# --- kernel timings -------------------------------------------------------------------------------


def kernels(smoke: bool) -> int:
    import torch

    if smoke:
        shapes = [("decode", 2, 64), ("prefill", 1, 32)]
        heads, kv_heads, head_dim, dtype = 4, 2, 64, torch.float32
    else:
        shapes = [
            ("decode", 1, 8192),
            ("decode", 32, 2048),
            ("decode", 256, 1024),
            ("prefill", 1, 2048),
            ("prefill", 8, 512),
        ]
        heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    for kind, batch, length in shapes:
        triton_ms, sdpa_ms = _time_attention(kind, batch, length, heads, kv_heads, head_dim, dtype, smoke)
        what = f"ctx={length}" if kind == "decode" else f"len={length}"
        report(
            f"kernel {kind} b={batch} {what} (H={heads}, KVH={kv_heads}, D={head_dim}, {str(dtype)[6:]}): "
            f"triton paged {triton_ms:.3f} ms, torch SDPA (dense K/V) {sdpa_ms:.3f} ms, "
            f"ratio {triton_ms / sdpa_ms:.2f}"
        )
    return 0


def _time_attention(kind, batch, length, heads, kv_heads, head_dim, dtype, smoke):
    import torch
    import torch.nn.functional as F

    from kernels.paged_attention import paged_attention

    device = device_kind(smoke)
    block_size = 16
    blocks_per_seq = -(-length // block_size)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
    # Each sequence's blocks scattered over the pool, as a busy server's would be.
    table = (
        (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, -1).int()
    )
    q_len = 1 if kind == "decode" else length
    query = torch.randn(batch * q_len, heads, head_dim, dtype=dtype, device=device)
    query_start = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)

    def run_triton():
        paged_attention(query, cache, query_start, seq_lens, table, head_dim**-0.5, max_query_len=q_len)

    # The same keys, gathered into dense [B, KVH, S, D] tensors before timing.
    k = (
        cache[0][:, table.long()]
        .reshape(kv_heads, batch, -1, head_dim)[:, :, :length]
        .transpose(0, 1)
        .contiguous()
    )
    v = (
        cache[1][:, table.long()]
        .reshape(kv_heads, batch, -1, head_dim)[:, :, :length]
        .transpose(0, 1)
        .contiguous()
    )
    q = query.view(batch, q_len, heads, head_dim).transpose(1, 2)  # [B, H, q, D]

    def run_sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=kind == "prefill", enable_gqa=True)

    return _time_ms(run_triton, smoke), _time_ms(run_sdpa, smoke)


def _time_ms(fn, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


# --- throughput -------------------------------------------------------------------------------


def throughput(smoke: bool) -> int:
    from services import LLM

    folder = Path(tempfile.mkdtemp(prefix="weft-dummy-8b-"))
    try:
        write_dummy_model(folder, TINY if smoke else LLAMA3_8B)
        llm = LLM(
            str(folder),
            load_format="dummy",
            device=device_kind(smoke),
            dtype="float32" if smoke else "bfloat16",
            max_model_len=2048,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            # The KV cache's bytes alone: the 60 GiB budget this run had for weights (16 GB), activations
            # and cache together, less the weights.
            kv_cache_memory=(1 << 30) if smoke else (44 << 30),
            num_threads=1,
        )
        shape = "tiny smoke model" if smoke else "Llama-3-8B shape, dummy weights, bf16"
        _generate(llm, batch=1, prompt_len=16, max_tokens=4)  # warm-up
        ttft = min(_generate(llm, batch=1, prompt_len=128, max_tokens=1) for _ in range(3))
        report(f"TTFT {shape}: one 128-token prompt alone: {ttft * 1e3:.1f} ms")
        steps = 4 if smoke else 128
        for batch in (1, 2) if smoke else (1, 32, 256):
            rate = _decode_rate(llm, batch, prompt_len=32 if smoke else 128, steps=steps)
            report(f"decode {shape}: batch {batch}: {rate:.0f} tokens/s ({rate / batch:.1f} per sequence)")
        batch, prompt_len = (2, 64) if smoke else (32, 1024)
        seconds = _generate(llm, batch=batch, prompt_len=prompt_len, max_tokens=1)
        report(f"prefill {shape}: {batch} x {prompt_len} tokens: {batch * prompt_len / seconds:.0f} tokens/s")
        _report_peak_memory(shape)
        release(llm)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _report_peak_memory(shape: str) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    report(
        f"memory {shape}: peak allocated {peak / 2**30:.1f} GiB, reserved {reserved / 2**30:.1f} GiB, "
        f"device in use {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB"
    )


def write_dummy_model(folder: Path, config: dict) -> None:
    """config.json of the shape, and the default model's tokenizer (prompts are token ids anyway)."""
    (folder / "config.json").write_text(json.dumps(config))
    from services.model_files import DEFAULT_GGUF, models_dir

    tokenizer_dir = models_dir() / DEFAULT_GGUF.replace(".gguf", ".hf")
    if (tokenizer_dir / "tokenizer.json").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, folder / name)
    else:
        _write_byte_tokenizer(folder)


def _write_byte_tokenizer(folder: Path) -> None:
    """A 256-token byte-level tokenizer, when the default model's files are not on this machine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i) if chr(i).isprintable() else f"<0x{i:02X}>": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0x00>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))


def _decode_rate(llm, batch: int, prompt_len: int, steps: int) -> float:
    """Decode tokens/s: (batch x steps) tokens over the time beyond a prefill-only run of the same batch."""
    prefill = _generate(llm, batch, prompt_len, max_tokens=1)
    full = _generate(llm, batch, prompt_len, max_tokens=1 + steps)
    return batch * steps / max(full - prefill, 1e-9)


def _generate(llm, batch: int, prompt_len: int, max_tokens: int) -> float:
    """Seconds to run ``batch`` random prompts of ``prompt_len`` tokens for ``max_tokens`` tokens each."""
    import random

    from services import SamplingParams

    rng = random.Random(batch * 1000 + prompt_len + max_tokens)
    top = min(20000, llm.config.model.vocab_size)
    prompts = [{"prompt_token_ids": [rng.randrange(1, top) for _ in range(prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["e2e", "kernels", "serve", "throughput"])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreted): checks the script"
    )
    parser.add_argument("--model", default=None, help="e2e and serve: the model (default: the default model)")
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="e2e and serve: dummy = random weights (default: auto)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
        os.environ.setdefault("WEFT_ATTENTION_BACKEND", "triton")  # CPU would pick torch
    if args.what in ("e2e", "serve"):
        return {"e2e": e2e, "serve": serve}[args.what](args.smoke, args.model, args.load_format)
    return {"kernels": kernels, "throughput": throughput}[args.what](args.smoke)
