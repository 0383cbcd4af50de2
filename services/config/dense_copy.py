"""Whether weights kept quantized also keep a dense copy for batched steps (opt-in).

By default a GGUF's weights are resident once, packed, and every step runs
the packed integer kernels at every row count
(``services/worker/layers/quantized_linear.py``): resident weight bytes stay
within the file's, and a row's output does not depend on what shares its
step, so greedy outputs are batch invariant and n-gram speculation is
token-identical to plain decoding.

``--dense-min-rows N`` keeps, beside the packed weight, a dense copy in the
model's dtype for steps of N rows and more (oneDNN's GEMM on dense weights,
bf16 dot products where the CPU has them, was 2-4x faster than the packed
kernels on batched steps of the 135M default model). It costs: the copy's
memory (2-4 bytes a weight against ~0.6 packed: 4-6x the weights' memory),
and batch invariance (a row runs the packed kernel in a small step and the
copy in a large one, so greedy tokens can part at near-ties, and speculative
verify steps can differ from plain decoding).

``--dense-copy-dtype int8`` adds an int8 copy (one byte a weight, activations
rotated and rounded to int8 per row, integer GEMMs:
``services.worker.layers.int8_linear``) for steps of ``INT8_MIN_ROWS`` rows and
more; below that the model dtype's copy stays faster (the rounding passes cost
more than the integer GEMM saves), so both are kept. Where the integer GEMM is
weft's own (``kernels.cpu_amx_int8`` on AMX int8 tiles, ``kernels.cpu_vnni_int8``
on AVX-512 VNNI, ``kernels.cpu_avx2_int8`` on AVX2 alone), the int8 copy runs
every step of the dense copy instead, up to ``AMX_INT8_MAX_ROWS`` rows on AMX (the
model dtype's copy the longer ones there). With a copy asked for,
``--dense-copy-dtype auto`` adds the int8 copy where it was measured to pay — a bf16
model dtype on a CPU with AMX int8 tiles, or with AVX-512 VNNI and bf16 dot products
(``kernels.cpu_caps.cpu_int8_copy_pays``), or the float32 that dtype auto picks on a
CPU without bf16 math where weft's own GEMM runs (``kernels.cpu_caps.cpu_own_int8_gemm``;
an fp32 asked for stays fp32 at every step), one engine per model (no tensor parallelism:
the shards' rows would round differently from one worker's); "model": the model
dtype's copy alone (an fp32 or bf16 run whose batched steps match dequantized
weights).
Torch-free: the API process builds the config too.
"""

from __future__ import annotations

# From 8 rows a step on, the dense copy was faster than the packed kernels on
# every layer of the default model (bf16: 23 ms against 39 ms for all its
# matmuls; fp32: 35 ms against 39 ms; 2 threads): the row count a copy asked for
# with --dense-copy-dtype alone starts at.
DEFAULT_DENSE_MIN_ROWS = 8
DENSE_COPY_DTYPES = ("auto", "model", "int8")
# From this many rows a step on, the int8 copy beat the bf16 one on all the default model's
# matmuls (`python benchmarks/scripts/dense_rows_bench.py`: 0.97x at 24 rows, 1.05-1.11x at 32, 1.20x at 64,
# 1.40x at 128, since the rounding pass's rotation runs two stages at a time).
INT8_MIN_ROWS = 32
# weft's own integer GEMMs stream the int8 copy at close to the read bandwidth at a few rows.
# On AMX int8 tiles (kernels/cpu_amx_int8.py) the int8 copy beat the packed Q4_1 kernels from 2
# rows a step on (7.9 against 7.7-12.1 ms for all the default model's matmuls at 2-4 rows; 8.2
# against 6.6 at 1) and the bf16 copy up to 128 (1.8x at 1-4 rows, 1.4x at 32, 1.2x at 64, level
# at 128, 0.86x at 256: `python benchmarks/scripts/dense_rows_bench.py`). On AVX-512 VNNI (Zen 4,
# kernels/cpu_vnni_int8.py) it beat the packed kernels from 2 rows (6.7-7.9 against 7.2-12.2 ms;
# 6.8-8.2 against 6.2-9.9 at 1, a tie) and the bf16 copy at every row count measured (2.1x at 2
# rows, 1.5x at 8, 1.2x at 32, 1.5x at 64, 1.3-1.4x at 256-2048). So auto keeps the packed weight
# for 1-row steps and the int8 copy from 2 rows on, up to AMX_INT8_MAX_ROWS on AMX, the bf16 copy
# above that.
OWN_INT8_GEMM_DENSE_MIN_ROWS = 2
# On AVX2 alone (kernels/cpu_avx2_int8.py) the int8 copy runs a layer as one call
# (``Int8Weight.one_call``) and a decode step's layers without the modules around them
# (``services.worker.models.lean_decode``): a batch-1 step on a Zen 3 took 8.2 ms against the
# packed Q4_1 kernels' 13.7-15.8 (alternated in one process), so there it takes 1-row steps too.
AVX2_INT8_DENSE_MIN_ROWS = 1
AMX_INT8_MAX_ROWS = 128


def linear_param_count(hf_config: dict) -> int:
    """Weights in the linear layers and the LM head of a decoder-only model's config."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    intermediate = hf_config["intermediate_size"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return hf_config["num_hidden_layers"] * (attention + mlp) + hf_config["vocab_size"] * hidden


def resolve_dense_min_rows(value: int | None, quantization: str) -> int:
    """Rows from which a kept-quantized layer runs its dense copy; 0: no copy.

    ``value`` None is "auto": no copy (the module's notes: one copy of the weights,
    batch-invariant numerics). An explicit value is kept."""
    if value is not None and value < 0:
        raise ValueError(f"dense_min_rows must be 0 (no dense copy) or a row count >= 1, got {value}.")
    if quantization != "gguf":
        if value:
            raise ValueError(
                "dense_min_rows applies to weights kept quantized (quantization 'gguf'); "
                f"with quantization {quantization!r} every weight is dense already."
            )
        return 0
    return 0 if value is None else value


def check_dense_copy_dtype(value: str) -> str:
    if value not in DENSE_COPY_DTYPES:
        raise ValueError(f"dense_copy_dtype must be one of {', '.join(DENSE_COPY_DTYPES)}; got {value!r}.")
    return value


def check_int8_copy_kept(dense_min_rows: int, quantization: str) -> None:
    """``dense_copy_dtype`` int8 names the copy's dtype: refuse it where no copy is kept."""
    if dense_min_rows > 0:
        return
    if quantization != "gguf":
        reason = f"with quantization {quantization!r} there is no packed weight to copy"
    else:
        reason = "no copy is kept (--dense-min-rows 0, or unset: by default weights stay packed alone)"
    raise ValueError(f"dense_copy_dtype int8 applies to the dense copy of weights kept quantized: {reason}.")
