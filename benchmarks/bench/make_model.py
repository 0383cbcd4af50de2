"""``weft bench make-model``: a GGUF with random weights in the shape of a real model.

The shapes are those of the real checkpoints' ``config.json`` (hidden size,
layers, MLP width, query and KV heads, head size, rope theta, RMS epsilon,
tied embeddings, context length); the vocabulary is the default model's
(SmolLM2's 49,152 tokens): every ``tokenizer.*`` field is copied from the
default GGUF, so a prompt is the same token ids in weft, llama.cpp and
transformers, which all read the file.

The weights are normal noise, scaled so activations stay of order one:
projections with std 1/sqrt(fan in), the embedding (and an untied output
head) with std 1/sqrt(hidden), norm weights 1 + N(0, 0.1), Qwen2's QKV
biases N(0, 0.5). Matrices are quantized with the ``gguf`` package's
quantizer to one of the four types it writes (Q4_0, Q4_1, Q5_0, Q8_0), or
by ``benchmarks.bench.kquants`` to Q5_K in every matrix (a Q5_K_S file) or
to llama.cpp's Q4_K_M or Q5_K_M mix (the most common downloads):
Q4_K or Q5_K everywhere but the output head
(the token embedding when tied) and the ``attn_v`` and ``ffn_down`` of the
layers llama.cpp gives more bits (the first and last eighth and every third
between), which take Q6_K, as ``llama-quantize`` assigns them for a dense
model. Norms and biases stay F32. Tensors are made and written one at a time, each
from row chunks, so memory stays a few hundred MB whatever the model's size.

llama.cpp stores a Llama's Q and K rows permuted (weft's and transformers'
loaders undo it): with random weights the file simply defines the model in
llama.cpp's order, and every reader sees the same one. Llama 3's rope
scaling (``rope_freqs``) is left out: positions beyond the original 8,192
rotate as plain rope.
"""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Rows per chunk are chosen so that a chunk holds about this many fp32 values (64 MB).
_CHUNK_VALUES = 16 * 1024 * 1024
_NORM_NOISE = 0.1
_BIAS_STD = 0.5


@dataclass(frozen=True)
class Shape:
    architecture: str  # GGUF general.architecture: llama, qwen2, qwen3
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tied: bool
    context_length: int

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"


SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-3.2-1B (llama3 rope scaling left out)
    "llama-3.2-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64, 500000.0, 1e-5, True, 131072),
    # meta-llama/Llama-3.2-3B
    "llama-3.2-3b": Shape("llama", 3072, 28, 8192, 24, 8, 128, 500000.0, 1e-5, True, 131072),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": Shape("llama", 4096, 32, 14336, 32, 8, 128, 500000.0, 1e-5, False, 131072),
    # Qwen/Qwen2.5-1.5B: QKV biases
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 8960, 12, 2, 128, 1000000.0, 1e-6, True, 32768),
    # Qwen/Qwen3-4B: RMSNorm over each head of Q and K
    "qwen3-4b": Shape("qwen3", 2560, 36, 9728, 32, 8, 128, 1000000.0, 1e-6, True, 40960),
    # Small shapes for tests. transformers' GGUF config for qwen3 takes Qwen3Config's default
    # head_dim (128) whatever the file says, so the tiny Qwen3 keeps 128 too.
    "tiny-llama": Shape("llama", 256, 2, 768, 8, 4, 32, 500000.0, 1e-5, False, 4096),
    "tiny-qwen2": Shape("qwen2", 256, 2, 768, 8, 2, 32, 1000000.0, 1e-6, True, 4096),
    "tiny-qwen3": Shape("qwen3", 256, 2, 768, 4, 2, 128, 1000000.0, 1e-6, True, 4096),
}

# The gguf package's four types, Q5_K in every matrix (a Q5_K_S file), then llama.cpp's K-quant
# mixes by their base type.
K_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q5_K", *K_MIXES)
# The file type a file of each qtype declares (general.file_type), where not MOSTLY_<qtype>.
_FILE_TYPES = {"Q5_K": "MOSTLY_Q5_K_S"}


def matrix_type(qtype: str, name: str, layers: int, tied: bool) -> str:
    """The GGML type of matrix ``name`` in a file of ``qtype`` (a type, or a K-quant mix)."""
    base = K_MIXES.get(qtype)
    if base is None:
        return qtype
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith((".attn_v.weight", ".ffn_down.weight")) and _more_bits(int(name.split(".")[1]), layers):
        return "Q6_K"
    return base


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of layers for Q6_K in a _M mix: the first and last eighth, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # (rows = out features, columns = in features), or (n,)
    kind: str  # "matrix" (quantized), "norm" or "bias" (F32)
    std: float = 0.0


def tensor_plan(shape: Shape, vocab_size: int, num_layers: int) -> list[TensorSpec]:
    """Every tensor of the file, in llama.cpp's order, with how its values are drawn."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [TensorSpec("token_embd.weight", (vocab_size, h), "matrix", h**-0.5)]
    plan.append(TensorSpec("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        plan.append(TensorSpec("output.weight", (vocab_size, h), "matrix", h**-0.5))
    for i in range(num_layers):
        b = f"blk.{i}"
        plan.append(TensorSpec(f"{b}.attn_norm.weight", (h,), "norm"))
        for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            plan.append(TensorSpec(f"{b}.{part}.weight", (rows, h), "matrix", h**-0.5))
            if shape.qkv_bias:
                plan.append(TensorSpec(f"{b}.{part}.bias", (rows,), "bias", _BIAS_STD))
        if shape.qk_norm:
            plan.append(TensorSpec(f"{b}.attn_q_norm.weight", (shape.head_dim,), "norm"))
            plan.append(TensorSpec(f"{b}.attn_k_norm.weight", (shape.head_dim,), "norm"))
        plan.append(TensorSpec(f"{b}.attn_output.weight", (h, q), "matrix", q**-0.5))
        plan.append(TensorSpec(f"{b}.ffn_norm.weight", (h,), "norm"))
        plan.append(TensorSpec(f"{b}.ffn_gate.weight", (shape.intermediate, h), "matrix", h**-0.5))
        plan.append(TensorSpec(f"{b}.ffn_up.weight", (shape.intermediate, h), "matrix", h**-0.5))
        plan.append(
            TensorSpec(f"{b}.ffn_down.weight", (h, shape.intermediate), "matrix", shape.intermediate**-0.5)
        )
    return plan


def parameter_count(plan: list[TensorSpec]) -> int:
    return sum(int(np.prod(t.shape)) for t in plan)


@functools.cache  # the stock reader walks all 98k strings of SmolLM2's vocabulary and merges: once
def tokenizer_fields(gguf_path: Path) -> tuple[list[tuple[str, object, object, object]], int]:
    """Every ``tokenizer.*`` field of a GGUF file as (key, value, type, element type), and its vocab size.

    Read once per file and version in a process: the ``gguf`` reader walks the tokenizer's 49k
    strings in Python, which costs more than writing a small model.
    """
    stat = gguf_path.stat()
    return _tokenizer_fields(str(gguf_path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _tokenizer_fields(
    path: str, mtime_ns: int, size: int
) -> tuple[list[tuple[str, object, object, object]], int]:
    from gguf import GGUFValueType

    from services.gguf_plain import PlainArrayReader

    reader = PlainArrayReader(path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub_type))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: no tokenizer to copy.")
    return fields, len(tokens.data)


def _generator(seed: int, name: str):
    """One torch generator per tensor, seeded from (seed, name): a tensor's values do not
    depend on which tensors come before it (--num-layers changes nothing else)."""
    import torch

    # torch's CPU generator keeps 32 bits of a seed: hash both into those.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


def _values(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's fp32 values, a chunk of whole rows at a time."""
    import torch

    generator = _generator(seed, spec.name)
    if spec.kind != "matrix":
        noise = torch.randn(spec.shape, generator=generator)
        yield (1.0 + _NORM_NOISE * noise if spec.kind == "norm" else spec.std * noise).numpy()
        return
    rows, columns = spec.shape
    step = max(1, _CHUNK_VALUES // columns)
    for start in range(0, rows, step):
        yield torch.randn((min(step, rows - start), columns), generator=generator).mul_(spec.std).numpy()


def _quantized(spec: TensorSpec, qtype, seed: int) -> np.ndarray:
    from gguf.quants import quant_shape_to_byte_shape, quantize

    from benchmarks.bench import kquants

    out = np.empty(quant_shape_to_byte_shape(spec.shape, qtype), dtype=np.uint8)
    start = 0
    for chunk in _values(spec, seed):
        if qtype.name in kquants.TYPES:
            out[start : start + len(chunk)] = kquants.quantize(chunk, qtype.name)
        else:
            out[start : start + len(chunk)] = quantize(chunk, qtype)
        start += len(chunk)
    return out


def _tensor_bytes(spec: TensorSpec, qtype) -> int:
    from gguf.quants import quant_shape_to_byte_shape

    if spec.kind != "matrix":
        return 4 * int(np.prod(spec.shape))
    return int(np.prod(quant_shape_to_byte_shape(spec.shape, qtype)))


def write_model(
    shape_name: str,
    qtype_name: str,
    out: Path,
    seed: int = 0,
    num_layers: int | None = None,
    tokenizer_gguf: Path | None = None,
    log=print,
) -> dict[str, object]:
    """Write the file (through ``<out>.partial``, renamed once whole); returns what was written."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

    from services.model_files import DEFAULT_GGUF, models_dir

    shape = SHAPES[shape_name]
    layers = shape.layers if num_layers is None else num_layers
    fields, vocab_size = tokenizer_fields(tokenizer_gguf or models_dir() / DEFAULT_GGUF)
    plan = tensor_plan(shape, vocab_size, layers)
    types = {
        spec.name: GGMLQuantizationType[matrix_type(qtype_name, spec.name, layers, shape.tied)]
        for spec in plan
        if spec.kind == "matrix"
    }
    began = time.monotonic()

    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, shape.architecture)
    arch = shape.architecture
    writer.add_name(f"{shape_name} {qtype_name}, random weights (weft bench make-model, seed {seed})")
    writer.add_file_type(LlamaFileType[_FILE_TYPES.get(qtype_name, f"MOSTLY_{qtype_name}")])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_uint32(f"{arch}.vocab_size", vocab_size)
    writer.add_uint32(f"{arch}.context_length", shape.context_length)
    writer.add_uint32(f"{arch}.embedding_length", shape.hidden)
    writer.add_uint32(f"{arch}.block_count", layers)
    writer.add_uint32(f"{arch}.feed_forward_length", shape.intermediate)
    writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", shape.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(
            key, value, GGUFValueType(vtype), None if sub_type is None else GGUFValueType(sub_type)
        )
    for spec in plan:
        raw = types.get(spec.name)
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), _tensor_bytes(spec, raw), raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, spec in enumerate(plan):
            if spec.kind == "matrix":
                data = _quantized(spec, types[spec.name], seed)
            else:
                data = np.ascontiguousarray(next(_values(spec, seed)), dtype=np.float32)
            writer.write_tensor_data(data)
            if spec.name.endswith("ffn_down.weight"):
                log(
                    f"make-model: layer {spec.name.split('.')[1]} of {layers} written ({i + 1}/{len(plan)} tensors)"
                )
        writer.close()
        partial.rename(out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return {
        "path": str(out),
        "shape": shape_name,
        "qtype": qtype_name,
        "layers": layers,
        "parameters": parameter_count(plan),
        "bytes": out.stat().st_size,
        "seconds": time.monotonic() - began,
    }


def _shape_line(name: str, s: Shape) -> str:
    return (
        f"{name}: {s.architecture}, hidden {s.hidden}, {s.layers} layers, MLP {s.intermediate}, "
        f"{s.heads}/{s.kv_heads} heads of {s.head_dim}, {'tied' if s.tied else 'untied'}"
    )


def add_arguments(parser) -> None:
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "shapes:\n  "
        + "\n  ".join(_shape_line(n, s) for n, s in SHAPES.items())
        + "\n\nAll use the default model's tokenizer (49,152 tokens). Llama 3's rope scaling is left out."
        "\nQ5_K: every matrix Q5_K (a Q5_K_S file). Q4_K_M and Q5_K_M are llama.cpp's mixes: Q4_K or"
        "\nQ5_K, with Q6_K for the output head and for"
        "\nattn_v and ffn_down in the first and last eighth of the layers and every third between."
    )
    parser.add_argument("--shape", required=True, choices=list(SHAPES), help="The real model's shape.")
    parser.add_argument("--qtype", required=True, choices=QTYPES, help="How the matrices are quantized.")
    parser.add_argument("--out", required=True, type=Path, help="The GGUF file to write.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random weights (default 0).")
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="Fewer (or more) layers than the shape's (default: its own).",
    )
    parser.add_argument("--force", action="store_true", help="Overwrite --out if it exists.")


def run(args, parser) -> int:
    if args.num_layers is not None and args.num_layers < 1:
        parser.error("--num-layers must be at least 1.")
    if not 0 <= args.seed < 2**32:
        parser.error("--seed must be in [0, 2**32).")
    if args.out.suffix != ".gguf":
        parser.error(f"--out must name a .gguf file, got {str(args.out)!r}.")
    if args.out.exists() and not args.force:
        parser.error(f"--out {args.out} exists: pass --force to overwrite it.")
    if not args.out.parent.is_dir():
        parser.error(f"--out: no such folder {args.out.parent}.")
    try:
        done = write_model(args.shape, args.qtype, args.out, args.seed, args.num_layers)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(
        f"wrote {done['path']}: {done['shape']} {done['qtype']}, {done['layers']} layers, "
        f"{done['parameters'] / 1e9:.2f}B parameters, {done['bytes'] / 2**30:.2f} GiB in {done['seconds']:.1f} s"
    )
    return 0
