"""Engine arguments with vLLM's names, resolved once into an EngineConfig.

Every ``"auto"`` and every ``None`` default is decided here, so the frozen
config that processes receive holds only concrete values; what the CPU can do
comes from ``kernels/cpu_caps.py``. Torch-free, and imports nothing from the
processes' packages (api, engine_core, worker, kv_transfer): the API process
builds the config too.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kernels.cpu_caps import cpu_has_fast_bf16, cpu_has_wide_int8_dot, cpu_int8_copy_pays, cpu_own_int8_gemm
from protocol import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from protocol.kv_transfer import KVTransferConfig
from services import env, model_files
from services.config.architectures import architecture_of, layer_sliding_windows
from services.config.async_scheduling_args import check_async_scheduling
from services.config.dense_copy import (
    AVX2_INT8_DENSE_MIN_ROWS,
    DEFAULT_DENSE_MIN_ROWS,
    OWN_INT8_GEMM_DENSE_MIN_ROWS,
    check_dense_copy_dtype,
    check_int8_copy_kept,
    linear_param_count,
    resolve_dense_min_rows,
)
from services.config.kv_events_args import resolve_kv_events_config
from services.config.kv_transfer_args import check_engine_supports, resolve_kv_transfer_config
from services.config.memory_plan import (
    DEFAULT_CPU_MEMORY_UTILIZATION,
    engine_share,
    node_available_memory_or_none,
)
from services.config.parallel_args import check_tensor_parallel
from services.config.pooler import resolve_pooler
from services.config.speculative_args import resolve_speculative_config
from services.generation_config import extra_eos_token_ids, read_generation_config, sampling_defaults

SCHEDULING_POLICIES = ("fcfs", "priority", "shortest-first")
DEFAULT_MAX_NUM_SEQS = 128
# Several partial prefills and no threshold: prompts longer than this percentage of max_model_len are long.
LONG_PREFILL_PERCENT = 4
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None  # several: the first is the one reported
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int | None = None  # None: by device (default_block_size)
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes of KV cache; None: from the memory that is left
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    long_prefill_token_threshold: int | None = None  # None: auto (prefill_chunk_cap; 0: no cap)
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "shortest-first"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    device: str = "auto"
    num_threads: int | None = None
    speculative_config: dict | str | None = None  # a dict, or its JSON on the command line
    structured_outputs_compile_timeout: float = 5.0
    load_format: str = "auto"
    enforce_eager: bool = False
    kv_transfer_config: dict | str | None = None  # a dict, or its JSON on the command line
    kv_events_config: dict | str | None = None  # a dict, or its JSON on the command line
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    quantization: str | None = None  # None: gguf for a GGUF file on CPU, else none
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    dense_min_rows: int | None = None  # None: auto (services/config/dense_copy.py)
    async_scheduling: bool = False
    dense_copy_dtype: str = "auto"  # auto | model | int8 (services/config/dense_copy.py)
    kv_cache_dtype: str = "auto"  # auto | model | int8 (resolve_kv_cache_dtype)
    pooler: str = "auto"  # auto | last | mean (services/config/pooler.py)
    cpu_memory_utilization: float = DEFAULT_CPU_MEMORY_UTILIZATION

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s) {unknown}; known: {sorted(known)}.")
        return cls(**kwargs)

    def create_engine_config(self, *, device_in_engine: bool = False) -> EngineConfig:
        """The checked config. ``device_in_engine`` (the API server's): with ``device auto``, the
        device, attention backend, block size and dtype left ``auto`` for each engine process to
        decide where it runs (``services/config/engine_device.py``); the rest is planned for the device
        this node's torch-free probe sees."""
        config = self._create_engine_config()
        if not device_in_engine or self.device == "cpu":
            return config
        model, cache, device = config.model, config.cache, config.device
        if self.dtype == "auto":  # on a GPU, by its compute capability
            model = msgspec.structs.replace(model, dtype="auto")
        if self.device == "auto":
            if self.block_size is None and config.kv_events is None:  # with events the API hashes in it
                cache = msgspec.structs.replace(cache, block_size=0)
            backend = device.attention_backend if _forced_backend() else "auto"
            device = msgspec.structs.replace(device, device="auto", attention_backend=backend)
        return msgspec.structs.replace(config, model=model, cache=cache, device=device)

    def _create_engine_config(self) -> EngineConfig:
        files = model_files.resolve(self.model)
        hf_config = files.hf_config()
        # Refuse an unsupported model before anything starts (for a GGUF, its config's model_type is
        # what transformers made of general.architecture).
        architecture_of(hf_config)
        windows = layer_sliding_windows(hf_config)
        check_tensor_parallel(
            hf_config, self.tensor_parallel_size, speculative=self.speculative_config is not None
        )
        device = resolve_device(self.device)
        quantization = resolve_quantization(self.quantization, files.is_gguf, device, self.load_format)
        dense_min_rows, int8_copy = self._dense_copy(quantization, device, hf_config)
        eos_token_id = _first(hf_config.get("eos_token_id"))
        model_dtype = resolve_dtype(self.dtype, device, quantization, dense_copy=dense_min_rows > 0)
        generation = read_generation_config(self.generation_config, files.hf_dir)
        config = EngineConfig(
            model=ModelConfig(
                model=str(files.weights),
                tokenizer=self.tokenizer or str(files.hf_dir),
                served_model_name=_first(self.served_model_name) or files.name,
                dtype=model_dtype,
                max_model_len=self._max_model_len(hf_config),
                max_model_len_auto=self.max_model_len is None,
                seed=self.seed,
                vocab_size=hf_config["vocab_size"],
                eos_token_id=eos_token_id,
                load_format=_check_load_format(self.load_format),
                layer_sliding_windows=windows,
                generation_defaults=sampling_defaults(generation),
                extra_eos_token_ids=extra_eos_token_ids(generation, eos_token_id),
                quantization=quantization,
                dense_min_rows=dense_min_rows,
                dense_copy_dtype="int8" if int8_copy else "model",
                pooler=resolve_pooler(self.pooler, files.hf_dir),
                hidden_size=hf_config.get("hidden_size") or 0,
            ),
            cache=CacheConfig(
                block_size=default_block_size(device) if self.block_size is None else self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=resolve_kv_cache_dtype(
                    self.kv_cache_dtype, device, model_dtype, kv_transfer=self.kv_transfer_config is not None
                ),
                cpu_memory_utilization=self._cpu_memory_utilization(),
                available_memory=self._available_memory(device),
                engines_on_node=self.data_parallel_size,
            ),
            scheduler=self._scheduler_config(self._max_model_len(hf_config), device, hf_config),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size
            ),
            device=DeviceConfig(
                device=device,
                num_threads=self.num_threads or self._default_num_threads(),
                attention_backend=resolve_attention_backend(device),
                enforce_eager=self.enforce_eager,
            ),
            speculative=resolve_speculative_config(self.speculative_config),
            structured_outputs=StructuredOutputsConfig(
                compile_timeout=self.structured_outputs_compile_timeout
            ),
            kv_transfer=self._kv_transfer_config(windows),
            kv_events=resolve_kv_events_config(self.kv_events_config, self.data_parallel_size),
        )
        check_async_scheduling(config)
        return config

    def _default_num_threads(self) -> int:
        """``OMP_NUM_THREADS`` where it is set, as torch's own default thread count reads it: a
        process started with it asks for that many threads (weft sets the count itself, so it would
        otherwise be ignored). Else the machine's cores, shared by the local engines."""
        raw = (env.get("OMP_NUM_THREADS") or "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"OMP_NUM_THREADS must be a thread count >= 1, got {raw!r}.")
            return int(raw)
        return max(1, (os.cpu_count() or 1) // self.data_parallel_size)

    def _cpu_memory_utilization(self) -> float:
        engine_share(1, self.cpu_memory_utilization, 1)  # refuses a value outside (0, 1]
        return self.cpu_memory_utilization

    def _available_memory(self, device: str) -> int | None:
        """The node's available memory now, before any engine loads (CPU, without --kv-cache-memory)."""
        if device != "cpu" or self.kv_cache_memory is not None or self.num_gpu_blocks_override is not None:
            return None
        return node_available_memory_or_none()

    def _kv_transfer_config(self, layer_windows: list[int]) -> KVTransferConfig | None:
        config = resolve_kv_transfer_config(self.kv_transfer_config)
        if config is not None and len(set(layer_windows)) > 1:
            raise ValueError(
                "kv_transfer_config: moving the KV of a model that mixes full and "
                "sliding-window attention (several KV cache groups) is not supported."
            )
        check_engine_supports(
            config,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        return config

    def _dense_copy(self, quantization: str, device: str, hf_config: dict) -> tuple[int, bool]:
        """The dense copy's row threshold (0: none, the default) and whether an int8 copy comes
        beside it (services/config/dense_copy.py)."""
        choice = check_dense_copy_dtype(self.dense_copy_dtype)
        asked = self.dense_min_rows
        if asked is None and choice != "auto" and quantization == "gguf":
            # A copy's dtype asked for alone asks for the copy, from that copy's first rows.
            own = choice == "int8" and cpu_own_int8_gemm()
            asked = own_int8_gemm_first_rows() if own else DEFAULT_DENSE_MIN_ROWS
        dense_min_rows = resolve_dense_min_rows(asked, quantization)
        if dense_min_rows == 0:
            if choice == "int8":
                check_int8_copy_kept(dense_min_rows, quantization)
            return 0, False
        model_dtype = resolve_dtype(self.dtype, device, quantization, dense_copy=True)
        # auto: the int8 copy where it was measured to pay: beside a bf16 copy, and beside the
        # fp32 copy that dtype auto picked (an fp32 asked for stays fp32 at every step: HF parity).
        int8 = choice == "int8" or (
            choice == "auto"
            and self.tensor_parallel_size == 1
            and (
                (model_dtype == "bfloat16" and cpu_int8_copy_pays())
                or (model_dtype == "float32" and self.dtype == "auto" and cpu_own_int8_gemm())
            )
        )
        return dense_min_rows, int8

    def _max_model_len(self, hf_config: dict) -> int:
        limit = hf_config.get("max_position_embeddings") or 2048
        if self.max_model_len is None:
            return limit
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len}."
            )
        return self.max_model_len

    def _scheduler_config(self, max_model_len: int, device: str, hf_config: dict) -> SchedulerConfig:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}."
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        budget = self.max_num_batched_tokens or default_step_budget(device)
        if not self.enable_chunked_prefill:
            # Unsplit, a prompt must fit one step's budget or it would wait for ever.
            if self.max_num_batched_tokens is None:
                budget = max(budget, max_model_len)
            elif budget < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({budget}) must be at least max_model_len ({max_model_len}) "
                    "without chunked prefill: a longer prompt could never be scheduled. Raise it, lower "
                    "max_model_len, or leave chunked prefill on."
                )
        threshold = self._long_prefill_token_threshold(max_model_len, device, hf_config, budget)
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            long_prefill_token_threshold=threshold,
            prefill_tokens_beside_decodes=threshold if self._chunk_cap_is_auto() else 0,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            async_scheduling=self.async_scheduling,
        )

    def _long_prefill_token_threshold(
        self, max_model_len: int, device: str, hf_config: dict, budget: int
    ) -> int:
        """Check the partial-prefill limits; as vLLM, several of them need a threshold to tell long
        prompts from short ones: LONG_PREFILL_PERCENT of max_model_len unless given. Left to auto
        otherwise, a CPU caps the chunks of a model larger than the default one (prefill_chunk_cap)."""
        given = self.long_prefill_token_threshold
        if given is not None and given < 0:
            raise ValueError(f"long_prefill_token_threshold must be at least 0, got {given}.")
        if self.max_num_partial_prefills < 1:
            raise ValueError(
                f"max_num_partial_prefills must be at least 1, got {self.max_num_partial_prefills}."
            )
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(
                "max_long_partial_prefills must be between 1 and max_num_partial_prefills "
                f"({self.max_num_partial_prefills}), got {self.max_long_partial_prefills}."
            )
        if self.max_num_partial_prefills > 1 and not given:
            return default_long_prefill_threshold(max_model_len)
        if given is not None:
            return given
        return prefill_chunk_cap(device, hf_config, budget) if self.enable_chunked_prefill else 0

    def _chunk_cap_is_auto(self) -> bool:
        """Whether the threshold is prefill_chunk_cap's (none given, one partial prefill, chunked
        prefill on): then it bounds a step's prompt tokens in all while streams decode beside them
        too, so a burst of long prompts holds the streams up no longer than one does."""
        return (
            self.long_prefill_token_threshold is None
            and self.max_num_partial_prefills == 1
            and self.enable_chunked_prefill
        )


def default_long_prefill_threshold(max_model_len: int) -> int:
    return max(1, max_model_len * LONG_PREFILL_PERCENT // 100)


def with_max_model_len(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """``config`` serving ``max_model_len`` tokens instead (what its KV cache holds): the
    threshold of long prefills follows it when it was derived from the old length."""
    old = config.model.max_model_len
    scheduler = config.scheduler
    if (
        scheduler.max_num_partial_prefills > 1
        and scheduler.long_prefill_token_threshold == default_long_prefill_threshold(old)
    ):
        scheduler = msgspec.structs.replace(
            scheduler, long_prefill_token_threshold=default_long_prefill_threshold(max_model_len)
        )
    return msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, max_model_len=max_model_len),
        scheduler=scheduler,
    )


def _first(value):
    return value[0] if isinstance(value, list) else value


def _check_load_format(load_format: str) -> str:
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}.")
    return load_format


def resolve_quantization(quantization: str | None, is_gguf: bool, device: str, load_format: str) -> str:
    """ "gguf" (weights kept packed) or "none" (dequantized at load); the packed kernels are CPU only."""
    if quantization not in (None, "none", "gguf"):
        raise ValueError(f"quantization must be 'gguf' or 'none', got {quantization!r}.")
    if quantization is None:
        return "gguf" if is_gguf and device == "cpu" and load_format == "auto" else "none"
    if quantization == "gguf":
        if not is_gguf or load_format != "auto":
            raise ValueError(
                "quantization 'gguf' needs a GGUF model file read from disk (load_format 'auto')."
            )
        if device != "cpu":
            raise ValueError("quantization 'gguf' runs on CPU only; use quantization 'none' on CUDA.")
    return quantization


# Tokens per KV block when none is asked for. On CPU, as vLLM's CPU backend: 128, so that a
# decode reads each (block, KV head)'s keys as one 16 KiB run (bf16, head size 64) instead of
# 2 KiB ones scattered over the cache; the compiled decode kernel ran 1.22x faster on offline-64's
# decode steps at 128 than at 16, prefill attention 8% slower (README, "KV blocks of 128 tokens on
# CPU"). 16 elsewhere, as vLLM on GPUs.
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


def default_block_size(device: str) -> int:
    return CPU_BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE


KV_CACHE_DTYPES = ("auto", "model", "int8")


def resolve_kv_cache_dtype(value: str, device: str, model_dtype: str, *, kv_transfer: bool) -> str:
    """``CacheConfig.cache_dtype``: ``model`` or ``int8`` where this much already decides it, ``auto``
    where the worker decides (it knows whether the compiled CPU kernels run, and the head size).

    int8 stores each token's keys and values one byte an element with an fp32 scale per KV head
    (README "int8 KV cache"). Only the CPU attention backends read it, and the KV-transfer path
    moves float blocks only; ``auto`` picks it on CPU for bf16 models alone, so fp32 runs stay exact.
    A dtype name equal to the model's is ``model`` (vLLM's ``--kv-cache-dtype bfloat16``)."""
    if value == model_dtype or _DTYPE_ALIASES.get(value) == model_dtype:
        return "model"
    if value.startswith("fp8"):
        raise ValueError(
            f"kv_cache_dtype {value!r}: fp8 KV caches are not supported; int8 (per-token scales, CPU) or "
            "auto is. An fp8 e4m3 cache without scales cost 0.017 nats a token here, int8 nothing measurable."
        )
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} or the model dtype ({model_dtype}); "
            f"got {value!r}."
        )
    if value == "int8" and device != "cpu":
        raise ValueError("kv_cache_dtype int8 runs on CPU only (the CPU attention backends read it).")
    if value == "int8" and kv_transfer:
        raise ValueError(
            "kv_cache_dtype int8 cannot be combined with kv_transfer_config: the KV-transfer path moves "
            "float blocks only."
        )
    if value == "auto" and (device != "cpu" or kv_transfer or model_dtype != "bfloat16"):
        return "model"
    return value


def resolve_attention_backend(device: str) -> str:
    """Triton kernels on CUDA, the compiled CPU kernel elsewhere (services/worker/layers/backends.py);
    ``WEFT_ATTENTION_BACKEND=torch|cpu|triton`` forces one."""
    return _forced_backend() or ("triton" if device == "cuda" else "cpu")


def _forced_backend() -> str:
    forced = (env.get("WEFT_ATTENTION_BACKEND") or "").strip().lower()
    if forced and forced not in ("torch", "cpu", "triton"):
        raise ValueError(f"WEFT_ATTENTION_BACKEND must be 'torch', 'cpu' or 'triton', got {forced!r}.")
    return forced


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    if device != "auto":
        return device
    # Torch-free probe: the NVIDIA driver exposes its devices here.
    return "cuda" if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists() else "cpu"


# A step's token budget where --max-num-batched-tokens is not given. A prefill chunk holds up the
# next token of every running request for the whole step, so the budget is a step time: 2,048 tokens
# are about half a second where the CPU has AMX or AVX-512 VNNI (two Zen 5 cores prefilled 4,450
# tokens/s, two AMX Xeon cores about as many), and on a GPU less. Where the CPU has AVX2 alone its
# int8 GEMM runs about 110 G multiply-adds/s on two cores, so a 2,048-token step took 2.3 s and a
# stream's tokens stalled that long (ITL p99 2.4 s at concurrency 64): 1,024 tokens there. Measured on
# offline-64 at concurrency 64 (README "TTFT under load"): 2,048 -> 1,024 gave TTFT p50 6.27 -> 5.71 s
# and ITL p99 2.43 -> 1.31 s at the same output rate (208 -> 214 tok/s, two runs each).
DEFAULT_STEP_BUDGET = 2048
AVX2_STEP_BUDGET = 1024


# The default model's layers take 106 M multiply-adds a token (SmolLM2-135M: 30 layers of 3,538,944),
# and the step budgets above are step times measured on it. A prompt's chunk beside a larger model's
# running requests holds their tokens up as long as its multiply-adds take, so on a CPU a model of
# n times as many caps each prompt's chunk at the budget / n (a multiple of PREFILL_CHUNK_GRAIN, at
# least one): the 1B shape 96 tokens of the AVX2 budget of 1,024, the 3B shape 32, the 8B shape 16.
# A step holding one then takes about as long at 3B as at 135M. Measured on two AVX2 cores
# (benchmarks/scripts/prefill_stall.py, r29): a stream beside a 2,048-token prompt at the 1B shape
# waited at most 3.4 s for a token where it waited 34.3 s uncapped, beside a 1,024-token one at 3B
# 3.0 s where 89.5 s; the prompts' own first tokens came 1% and 5% later.
REFERENCE_LAYER_MULTIPLY_ADDS = 30 * 3_538_944
PREFILL_CHUNK_GRAIN = 16


def layer_multiply_adds(hf_config: dict) -> int:
    """Multiply-adds a token takes in a decoder-only model's layers' linear weights (not the LM
    head, which a prefill runs on its last token alone)."""
    return linear_param_count(hf_config) - hf_config["vocab_size"] * hf_config["hidden_size"]


def prefill_chunk_cap(device: str, hf_config: dict, budget: int) -> int:
    """The tokens of one prompt a step takes where ``--long-prefill-token-threshold`` is left to
    auto (0: no cap): on a CPU, ``budget`` scaled down by the model's multiply-adds a token against
    the default model's (see ``REFERENCE_LAYER_MULTIPLY_ADDS``); elsewhere none."""
    if device != "cpu":
        return 0
    cap = budget * REFERENCE_LAYER_MULTIPLY_ADDS // layer_multiply_adds(hf_config)
    if cap >= budget:
        return 0
    return max(PREFILL_CHUNK_GRAIN, cap // PREFILL_CHUNK_GRAIN * PREFILL_CHUNK_GRAIN)


def default_step_budget(device: str, flags: set[str] | None = None) -> int:
    """The step budget auto gives on ``device`` (``AVX2_STEP_BUDGET`` on a CPU without AMX or
    AVX-512 VNNI, else ``DEFAULT_STEP_BUDGET``)."""
    if device != "cpu":
        return DEFAULT_STEP_BUDGET
    return DEFAULT_STEP_BUDGET if cpu_has_wide_int8_dot(flags) else AVX2_STEP_BUDGET


def own_int8_gemm_first_rows(flags: set[str] | None = None) -> int:
    """From how many rows a step auto's copies run, where weft's own int8 GEMM does: every step on
    AVX2 alone (``AVX2_INT8_DENSE_MIN_ROWS``: there the int8 copy's one-call layers and the lean
    decode path beat the packed kernels at one row too), from ``OWN_INT8_GEMM_DENSE_MIN_ROWS`` on AMX
    and AVX-512 VNNI (the packed kernels were as fast or faster at one row there)."""
    return OWN_INT8_GEMM_DENSE_MIN_ROWS if cpu_has_wide_int8_dot(flags) else AVX2_INT8_DENSE_MIN_ROWS


def resolve_dtype(dtype: str, device: str, quantization: str = "none", dense_copy: bool = False) -> str:
    """``auto``: bf16 on CUDA, and on a CPU with bf16 math wherever batched steps run dense
    weights (dequantized, or the dense copy of weights kept quantized). Weights kept
    quantized with no dense copy stay fp32: their kernel computes in fp32 whatever the
    activations are, so bf16 would only add conversions and round the residual stream
    (measured: no faster)."""
    if dtype not in ("auto", "float32", "bfloat16", "float16", *_DTYPE_ALIASES):
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"  # on the API node; the engine process lowers it to fp16 below sm80 (engine_device)
    dense = quantization == "none" or dense_copy
    return "bfloat16" if dense and cpu_has_fast_bf16() else "float32"
