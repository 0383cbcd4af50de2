"""One frozen config tree that every process receives whole.

Built and validated once (``services.config.engine_args``) with every ``"auto"``
resolved; each field's description doubles as its CLI help.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol.kv_events import KVEventsConfig
from protocol.kv_transfer import KVTransferConfig

# Most draft tokens one request may verify in a step (vLLM's bound too).
MAX_SPEC_TOKENS = 128


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Annotated[
        str,
        Meta(description="Path to a GGUF file or a Hugging Face model folder (config.json + safetensors)."),
    ]
    tokenizer: Annotated[str, Meta(description="Folder holding the Hugging Face tokenizer files.")]
    served_model_name: Annotated[str, Meta(description="Model name reported by the API.")]
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16", "auto"],
        Meta(
            description="Weights and activations dtype (auto: bf16 on GPUs of compute capability 8.0 and up, fp16 on older ones, and on CPUs bf16 with AMX or AVX-512 bf16 where batched steps run dense weights, else fp32; decided in the engine process)."
        ),
    ]
    max_model_len: Annotated[int, Meta(ge=1, description="Longest prompt + output, in tokens.")]
    seed: Annotated[int, Meta(description="Seed for the random sampling of unseeded requests.")] = 0
    vocab_size: Annotated[int, Meta(ge=1, description="Vocabulary size of the model.")] = 1
    eos_token_id: Annotated[int | None, Meta(description="End-of-sequence token id.")] = None
    load_format: Annotated[
        Literal["auto", "dummy"],
        Meta(
            description="auto: read the checkpoint; dummy: random weights of the config's shape, no checkpoint read (benchmarks)."
        ),
    ] = "auto"
    layer_sliding_windows: Annotated[
        list[int],
        Meta(
            description="Per layer, its sliding attention window in tokens, 0 for full attention; empty: every layer full (protocol.kv_cache_groups)."
        ),
    ] = []
    generation_defaults: Annotated[
        dict[str, float | int],
        Meta(
            description="The model's generation_config.json sampling defaults (SamplingParams field -> value), for requests that do not set them."
        ),
    ] = {}
    extra_eos_token_ids: Annotated[
        list[int],
        Meta(
            description="EOS ids of generation_config.json beyond eos_token_id: stop tokens of every request that does not ignore EOS."
        ),
    ] = []
    quantization: Annotated[
        Literal["none", "gguf"],
        Meta(
            description="gguf: keep a GGUF file's Q8_0/Q6_K/Q5_0/Q5_1/Q5_K/Q4_0/Q4_1/Q4_K weights packed and run quantized matmuls (CPU; the default for GGUF files there); none: dequantize every weight to dtype at load."
        ),
    ] = "none"
    dense_min_rows: Annotated[
        int,
        Meta(
            ge=0,
            description="With weights kept quantized: steps of at least this many rows run a dense copy of each weight in dtype (oneDNN GEMM), fewer rows the packed kernels; 0 keeps no dense copy (saves its memory).",
        ),
    ] = 0
    dense_copy_dtype: Annotated[
        Literal["model", "int8"],
        Meta(
            description="model: the dense copy in dtype (oneDNN GEMM); int8: an int8 copy beside it for the steps its GEMM takes (from services.config.dense_copy.INT8_MIN_ROWS rows on, every step on weft's AVX-512 VNNI GEMM, or up to AMX_INT8_MAX_ROWS on AMX int8 tiles; weights and activations rotated and rounded to int8 per row; integer GEMM).",
        ),
    ] = "model"
    pooler: Annotated[
        Literal["last", "mean"],
        Meta(
            description="How /v1/embeddings pools a prompt's hidden states (after the final norm) into one L2-normalized vector: the last token's, or their mean."
        ),
    ] = "last"
    hidden_size: Annotated[
        int, Meta(ge=0, description="Width of the model's hidden states (an embedding's size); 0: unknown.")
    ] = 0
    # Appended fields (positional encoding is a wire contract).
    max_model_len_auto: Annotated[
        bool,
        Meta(
            description="max_model_len is the model's own context (not given): the engine lowers it to what its KV cache holds when one such sequence does not fit."
        ),
    ] = False


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: Annotated[
        int,
        Meta(ge=0, description="Tokens per KV cache block (0: by device, decided in the engine process)."),
    ] = 16
    enable_prefix_caching: Annotated[
        bool, Meta(description="Share full KV blocks between requests with the same prefix.")
    ] = True
    kv_cache_memory: Annotated[
        int | None,
        Meta(
            description="Bytes of KV cache per worker, as vLLM's --kv-cache-memory (weights and activations come on top). Bypasses cpu_memory_utilization and gpu_memory_utilization."
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float, Meta(gt=0, le=1, description="Fraction of GPU memory the worker may use.")
    ] = 0.9
    num_gpu_blocks_override: Annotated[
        int | None, Meta(description="Use exactly this many KV blocks (testing).")
    ] = None
    cache_dtype: Annotated[
        Literal["auto", "model", "int8"],
        Meta(
            description="What the KV cache stores: model (keys and values in dtype), int8 (one byte an element and an fp32 scale per token and KV head; the CPU attention backends only), or auto (int8 where the compiled CPU kernels run a bf16 model's decodes over it on int8 dot products; else model). Resolved by the worker, which knows the attention backend."
        ),
    ] = "model"
    # Appended fields (positional encoding is a wire contract).
    cpu_memory_utilization: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="CPU: fraction of the memory available on the node when its engines start (MemAvailable, or the container's cgroup limit minus usage when lower) that its engine processes may use together; each gets an even share, and its KV cache what is left of it after its runtime, weights and profiled activation peak.",
        ),
    ] = 0.9
    available_memory: Annotated[
        int | None,
        Meta(
            description="CPU: bytes available on this node before its engines started, measured by their launcher (None: the worker measures it when it starts)."
        ),
    ] = None
    engines_on_node: Annotated[
        int, Meta(ge=1, description="Engine cores started on this node, which share its available memory.")
    ] = 1


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_num_batched_tokens: Annotated[int, Meta(ge=1, description="Token budget of one engine step.")] = 2048
    max_num_seqs: Annotated[int, Meta(ge=1, description="Most requests running at once.")] = 128
    long_prefill_token_threshold: Annotated[
        int, Meta(ge=0, description="Cap a prefill chunk at this many tokens (0: off).")
    ] = 0
    prefill_tokens_beside_decodes: Annotated[
        int,
        Meta(
            ge=0,
            description="Most prompt tokens a step takes, all prompts together, while it also carries "
            "requests past their prompt (0: no limit beyond the budget). Set with the CPU's automatic "
            "chunk cap, so several long prompts cannot stall the running streams between them.",
        ),
    ] = 0
    enable_chunked_prefill: Annotated[
        bool, Meta(description="Split prefills that do not fit the step's budget.")
    ] = True
    scheduling_policy: Annotated[
        Literal["fcfs", "priority", "shortest-first"],
        Meta(
            description="shortest-first (the default: shorter prompts first, each prompt token counted "
            "as 1 ms of waiting, so none is starved); fcfs (arrival order); or priority (lower value "
            "runs first)."
        ),
    ] = "shortest-first"
    max_num_partial_prefills: Annotated[
        int,
        Meta(
            ge=1,
            description="Prompts a step may leave partway through their prefill. Above 1, long prompts "
            "(see max_long_partial_prefills) are passed over for shorter ones queued behind them.",
        ),
    ] = 1
    max_long_partial_prefills: Annotated[
        int,
        Meta(
            ge=1,
            description="With max_num_partial_prefills above 1: how many of a step's prefills may be long "
            "(more than long_prefill_token_threshold tokens left; the threshold defaults to 4% of "
            "max_model_len then).",
        ),
    ] = 1
    async_scheduling: Annotated[
        bool,
        Meta(
            description="Schedule step N+1 while step N runs (vLLM's --async-scheduling): scheduling and "
            "output processing leave the forward's critical path; stops and aborts apply one step late.",
        ),
    ] = False


class ParallelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tensor_parallel_size: Annotated[int, Meta(ge=1, description="Workers (devices) per engine core.")] = 1
    data_parallel_size: Annotated[int, Meta(ge=1, description="Engine cores in all.")] = 1
    data_parallel_size_local: Annotated[
        int | None, Meta(description="Engine cores on this node (default: all).")
    ] = None
    data_parallel_start_rank: Annotated[
        int, Meta(ge=0, description="Rank of the first local engine core.")
    ] = 0
    data_parallel_rank: Annotated[
        int, Meta(ge=0, description="This engine core's rank (set per process).")
    ] = 0
    data_parallel_address: Annotated[str, Meta(description="Address of the API node's handshake socket.")] = (
        "127.0.0.1"
    )
    data_parallel_rpc_port: Annotated[
        int, Meta(ge=0, le=65535, description="Port of the API node's handshake socket.")
    ] = 29550


class DeviceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    device: Annotated[
        Literal["cpu", "cuda", "auto"],
        Meta(description="Device the workers run on (auto: CUDA where the engine process's torch sees it)."),
    ] = "cpu"
    num_threads: Annotated[int, Meta(ge=1, description="torch threads per worker process.")] = 1
    attention_backend: Annotated[
        Literal["torch", "cpu", "triton", "auto"],
        Meta(description="Attention implementation (cpu: compiled decode kernel on CPU; triton on CUDA)."),
    ] = "torch"
    enforce_eager: Annotated[
        bool, Meta(description="Never capture or replay CUDA graphs (they speed up decode steps on GPU).")
    ] = False


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding: draft tokens proposed cheaply, verified in one forward."""

    method: Annotated[
        Literal["ngram"], Meta(description="How drafts are proposed: ngram (prompt lookup).")
    ] = "ngram"
    num_speculative_tokens: Annotated[
        int, Meta(ge=1, le=MAX_SPEC_TOKENS, description="Draft tokens per request per step (K).")
    ]
    prompt_lookup_min: Annotated[int, Meta(ge=1, description="Shortest n-gram matched against the context.")]
    prompt_lookup_max: Annotated[
        int, Meta(ge=1, description="Longest n-gram matched against the context (tried first).")
    ]

    def __post_init__(self) -> None:
        # msgspec checks the Meta bounds only when decoding; direct
        # construction must refuse the same values.
        if self.method != "ngram":
            raise ValueError(f"speculative method must be 'ngram', got {self.method!r}.")
        if not 1 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPEC_TOKENS}], "
                f"got {self.num_speculative_tokens}."
            )
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be at least 1, got {self.prompt_lookup_min}.")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least "
                f"prompt_lookup_min ({self.prompt_lookup_min})."
            )


class StructuredOutputsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Guided decoding: how the engine core compiles request grammars."""

    compile_timeout: Annotated[
        float,
        Meta(gt=0, description="Seconds a request's grammar may take to compile before the request fails."),
    ] = 5.0

    def __post_init__(self) -> None:
        # Meta bounds are checked on decode only; construction checks here.
        if not self.compile_timeout > 0:
            raise ValueError(
                f"structured_outputs_compile_timeout must be positive, got {self.compile_timeout}."
            )


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: DeviceConfig = DeviceConfig()
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    kv_transfer: KVTransferConfig | None = None  # None: no disaggregated prefill/decode
    kv_events: KVEventsConfig | None = None  # None: no KV cache events
