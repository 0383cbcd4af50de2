"""Every environment variable weft reads, with its meaning; the only module that reads them.

Two kinds:

- settings that have no flag (where the model files live, a forced attention
  backend, ...), read with ``get(name)``;
- deployment overrides of a command-line flag (``WEFT_PORT`` for ``--port``):
  a container or a unit file sets them instead of editing the command. They
  win over a ``--config`` file and lose to the command line
  (``services/config_file.py`` applies them).

Reading a name that is not declared here is a ``KeyError``, so a new
variable cannot be read without being listed (and documented) first.
``PLATFORM`` lists the variables of other tools that weft reads too (the
compiler, Triton, torch's build folder, OpenMP). Stdlib only and imports no
other weft module: ``kernels/`` reads its switches through it, and the API
process imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    flag: str | None = None  # the flag it overrides, if any


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("WEFT_API_KEY", "API keys the /v1 routes accept, comma-separated, when no --api-key is given."),
    EnvVar(
        "WEFT_ADMIN_API_KEY",
        "Admin keys the management POSTs accept, comma-separated, when no --admin-api-key is given.",
    ),
    EnvVar(
        "WEFT_KV_TRANSFER_SECRET",
        "The P/D proxy's shared secret, when no --kv-transfer-secret-file is given "
        "(services/kv_transfer/trust.py).",
    ),
    EnvVar(
        "WEFT_CPU_FUSED",
        "0 turns the fused CPU element-wise kernels off (kernels/cpu_fused.py).",
    ),
    EnvVar(
        "WEFT_LEAN_DECODE",
        "0 runs every step through the model's modules instead of the lean path of kernels called "
        "straight (services/worker/models/lean_decode.py; the same numbers, for measuring what it gains).",
    ),
    EnvVar(
        "WEFT_ATTENTION_BF16_DOT",
        "1 runs bf16 prefills and decodes of the CPU attention kernel on bf16 dot products where the CPU has "
        "AVX512_BF16 (faster, not batch-invariant); unset or 0 keeps them on its fp32 path, whose rows are the "
        "same bits in any batch (kernels/cpu_attention.py reads it on every call and passes it to the kernel).",
    ),
    EnvVar(
        "WEFT_ATTENTION_AMX",
        "0 keeps bf16 prefills of the CPU attention kernel on AVX512_BF16 dot products where the CPU has AMX "
        "tiles and WEFT_ATTENTION_BF16_DOT=1 (read as WEFT_ATTENTION_BF16_DOT is; for tests and measurements).",
    ),
    EnvVar(
        "WEFT_ATTENTION_INT8_FAST",
        "0 keeps decodes over an int8 KV cache on the CPU attention kernel's generic path where its AVX-512 "
        "path is built (read as WEFT_ATTENTION_BF16_DOT is; for tests and measurements).",
    ),
    EnvVar(
        "WEFT_AMX_INT8",
        "0 keeps the int8 copy's GEMMs on oneDNN where weft's AMX int8 kernel would run them "
        "(kernels/cpu_int8_gemm.py; to measure what it gains).",
    ),
    EnvVar(
        "WEFT_VNNI_INT8",
        "0 keeps the int8 copy's GEMMs on torch._int_mm where weft's AVX-512 VNNI kernel would run them "
        "(kernels/cpu_int8_gemm.py; to measure what it gains).",
    ),
    EnvVar(
        "WEFT_AVX2_INT8",
        "0 keeps the int8 copy's GEMMs on torch._int_mm where weft's AVX2 int8 kernel would run them "
        "(kernels/cpu_int8_gemm.py; to measure what it gains).",
    ),
    EnvVar(
        "WEFT_QUANT_ISA",
        "Force one build of the quantized-linear kernel: avx512vnni, avx2 or generic (default: the fastest "
        "the CPU runs; kernels/cpu_quant_linear.py).",
    ),
    EnvVar(
        "WEFT_QUANT_ACTIVATIONS",
        "int8 (default), int16 or fp32: the activations of the quantized matmul rounded to int8 or int16 "
        "per weight group (int8 against the K formats: per 256), which makes the matmul integer dot products at "
        "every row count (int8 is fastest, "
        "int16 half as fast and closer to fp32), or kept fp32 (exact up to the order of sums) "
        "(services/worker/layers/quantized_linear.py).",
    ),
    EnvVar(
        "WEFT_CPU_ONE_THREAD_BELOW",
        "On CPU, steps of fewer than this many tokens run on one torch thread, others on --num-threads "
        "(default 0: every step on --num-threads) (services/worker/cpu_threads.py).",
    ),
    EnvVar(
        "WEFT_TEST_FAULT_FILE",
        "Tests only: a file whose content makes each worker step hang or fail to allocate "
        "(services/worker/fault_injection.py); unset in any real deployment.",
    ),
    EnvVar(
        "CUDA_VISIBLE_DEVICES",
        "The GPUs weft may use (CUDA's own variable). A node's data-parallel engine cores split the devices it "
        "lists, tensor-parallel size each, and each narrows it to its own share for its workers "
        "(services/engine_core/devices.py).",
    ),
    EnvVar("WEFT_MODELS_DIR", "Folder of the default model's files (default: models/ in the repository)."),
    EnvVar(
        "WEFT_WORKLOADS_DIR",
        "Folder where bare workload names resolve (default: benchmarks/workloads/ in the repository).",
    ),
    EnvVar(
        "WEFT_ATTENTION_BACKEND",
        "Force an attention backend: torch, cpu or triton (default: triton on CUDA, cpu elsewhere).",
    ),
    EnvVar(
        "WEFT_CONFIG", "A YAML file of flags, read when the command line has no --config.", flag="--config"
    ),
    EnvVar("WEFT_MODEL", "The model to serve: a GGUF file or a folder of safetensors.", flag="--model"),
    EnvVar("WEFT_HOST", "Address the HTTP server listens on.", flag="--host"),
    EnvVar("WEFT_PORT", "Port the HTTP server listens on.", flag="--port"),
    EnvVar(
        "WEFT_DATA_PARALLEL_ADDRESS",
        "Host of the API node, for remote engine cores.",
        flag="--data-parallel-address",
    ),
    EnvVar("WEFT_DATA_PARALLEL_RPC_PORT", "Handshake port of the API node.", flag="--data-parallel-rpc-port"),
    EnvVar(
        "WEFT_DATA_PARALLEL_INPUT_PORT",
        "Port of the API's request socket, for remote engine cores.",
        flag="--data-parallel-input-port",
    ),
    EnvVar(
        "WEFT_DATA_PARALLEL_OUTPUT_PORT",
        "Port of the API's output socket, for remote engine cores.",
        flag="--data-parallel-output-port",
    ),
    EnvVar(
        "WEFT_ZMQ_CURVE_KEYS",
        "Folder of CurveZMQ keys (`weft keys`) for the API-engine links.",
        flag="--zmq-curve-keys",
    ),
    EnvVar(
        "WEFT_LOG_FORMAT",
        "text or json: how every weft process logs (services/log_format.py); `weft serve` and "
        "`engine-core` set it for the processes they start.",
        flag="--log-format",
    ),
    EnvVar(
        "WEFT_KV_CACHE_MEMORY",
        "Bytes of KV cache per worker (default: what the machine's available memory leaves, on CPU).",
        flag="--kv-cache-memory",
    ),
)
# Other tools' variables that weft reads (or, for OpenMP's, sets where unset).
PLATFORM: tuple[EnvVar, ...] = (
    EnvVar("PATH", "Where the C++ kernel builds find ninja and the compiler (kernels/cpu_build.py)."),
    EnvVar("CXX", "The C++ compiler for the kernel builds (default: c++; kernels/cpu_build.py)."),
    EnvVar(
        "TORCH_EXTENSIONS_DIR",
        "Where torch builds and caches the C++ kernels (default: torch's own folder; kernels/cpu_build.py).",
    ),
    EnvVar(
        "TRITON_INTERPRET",
        "1 runs the Triton kernels in Triton's CPU interpreter (kernels/__init__.py reads it as Triton does).",
    ),
    EnvVar(
        "OMP_NUM_THREADS",
        "torch threads per engine process where --num-threads is not given (services/config/engine_args.py).",
    ),
    EnvVar(
        "OMP_WAIT_POLICY",
        "OpenMP's wait policy; weft sets PASSIVE where it is unset (services/__init__.py).",
    ),
    EnvVar(
        "GOMP_SPINCOUNT",
        "How long libgomp's threads spin before they sleep; weft sets 10000 where it is unset "
        "(services/__init__.py).",
    ),
)
_BY_NAME = {variable.name: variable for variable in (*VARIABLES, *PLATFORM)}


def _check_declared(name: str) -> None:
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not declared in services/env.py.")


def get(name: str, default: str | None = None) -> str | None:
    """The value of declared variable ``name``, or ``default`` when it is unset or empty."""
    _check_declared(name)
    return os.environ.get(name) or default


def get_raw(name: str, default: str | None = None) -> str | None:
    """The value of declared variable ``name`` as set, empty included; ``default`` when unset."""
    _check_declared(name)
    return os.environ.get(name, default)


def is_set(name: str) -> bool:
    """Whether declared variable ``name`` is in the environment (empty included)."""
    return get_raw(name) is not None


def put(name: str, value: str) -> None:
    """Set declared variable ``name`` for this process and the processes it starts."""
    _check_declared(name)
    os.environ[name] = value


def flag_overrides(known_flags: set[str]) -> list[tuple[EnvVar, str]]:
    """The set flag overrides whose flag is one of ``known_flags``, in declaration order."""
    return [
        (v, value)
        for v in VARIABLES
        if v.flag is not None and v.flag in known_flags and (value := get(v.name))
    ]


def describe() -> str:
    """A table of the variables, for ``--help`` epilogues and the README."""
    return "\n".join(f"  {v.name:32} {v.meaning}" for v in VARIABLES)
