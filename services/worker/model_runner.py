"""Run one engine step on this worker: inputs -> forward -> logits -> sample (or pool).

The runner owns the model, the paged KV cache, the persistent input batch
and the sampler. ``execute_model`` takes a ``SchedulerOutput`` and returns a
``ModelRunnerOutput`` in the scheduled order (the order of
``num_scheduled_tokens``), with an empty token list for requests still
mid-prefill.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable

import numpy as np
import torch

from kernels import cpu_fused
from protocol import EngineConfig, ModelRunnerOutput, SamplingParams, SchedulerOutput, TokenLogprobs
from protocol.kv_cache_groups import KVCacheGroup, kv_cache_groups, layer_placement
from services.worker.cpu_threads import StepThreads
from services.worker.cuda_graphs import capture_sizes, graphs_wanted, maybe_capture_decode_graphs
from services.worker.distributed import get_tp_group
from services.worker.forward_context import set_forward_context
from services.worker.input_batch import InputBatch
from services.worker.layers.attention import PagedAttention, kv_cache_shape
from services.worker.layers.attention_metadata import (
    BF16_DOT_PREFILL_CAPS,
    FP32_PREFILL_CAPS,
    TILE_PREFILL_CAPS,
    PrefillCaps,
    build_attention_metadata,
)
from services.worker.layers.backends import check_backend
from services.worker.layers.linear import pack_linear_weights, packed_weights_bytes
from services.worker.layers.quantized_linear import quantized_report
from services.worker.layers.triton_attention import StepStaging, build_triton_metadata
from services.worker.model_loader import DTYPES, load_model
from services.worker.pooler import pool_step
from services.worker.prompt_logprobs import chunk_prompt_logprobs
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import RequestSamplingInput, build_sampling_metadata, cached_filters
from services.worker.spec_decode.spec_decoder import SpecDecoder
from services.worker.step_inputs import StepInputs, prepare_step, record_emitted, sampling_states
from services.worker.structured_output import with_grammar_bitmask

# Bytes of K/V one decode group may gather per layer (the shared gather buffer).
_DECODE_GATHER_BYTES = 64 << 20


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.model = None
        self.max_decode_group_tokens: int | None = None  # set with the model
        self.kv_caches: list[torch.Tensor] | None = None
        # With an int8 cache, each layer's fp32 scales [2, KVH, num_blocks, block_size] (else None).
        self.kv_scales: list[torch.Tensor] | None = None
        self.kv_int8 = False  # decided with the model (resolve_kv_int8)
        windows = config.model.layer_sliding_windows
        self.kv_groups = kv_cache_groups(windows, len(windows)) if windows else []
        num_groups = max(1, len(self.kv_groups))
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, config.model.max_model_len, self.block_size, num_groups
        )
        # The compiled argmax where the layers take the compiled CPU kernels (chosen once, as theirs).
        compiled_argmax = self.device.type == "cpu" and cpu_fused.available()
        self.sampler = Sampler(config.model.seed, self.device, compiled_argmax=compiled_argmax)
        self.attention_backend = check_backend(config.device.attention_backend, self.device)
        self.cuda_graphs = None  # captured with the KV cache, on CUDA only
        # The Triton backend's step tensors go through pinned host buffers kept for the worker's life.
        self.staging = StepStaging(self.device) if self.attention_backend == "triton" else None
        self.step_threads = StepThreads(config.device.num_threads) if self.device.type == "cpu" else None
        self.spec_decoder = (
            SpecDecoder(config, self.sampler.generator, self.device, self.sampler.compiled_argmax)
            if config.speculative is not None
            else None
        )

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.device)
        place_layers_in_kv_groups(self.model, self.config.model.layer_sliding_windows, self.kv_groups)
        if self.attention_backend == "cpu":
            pack_linear_weights(self.model, self.dtype, self.device)
        a = self.model.args
        self.max_decode_group_tokens = _DECODE_GATHER_BYTES // (
            2 * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        )
        self.kv_int8 = resolve_kv_int8(
            self.config.cache.cache_dtype, self.attention_backend, self.dtype, a.head_dim
        )
        # Over an int8 cache a bf16 query's prefills run on bf16 dot products too (each chunk's
        # keys and values widened to bf16 first), so the caps follow the query's dtype.
        self.prefill_caps = prefill_caps_for(self.attention_backend, self.dtype, a.head_dim)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_kind)

    @property
    def weights_by_kind(self) -> tuple[int, int, int]:
        """Bytes of the weights as the loader holds them: (packed GGUF blocks, parameters in the
        model dtype, other: repacked layouts and int8 copies outside the parameters)."""
        dense = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return quantized_report(self.model).total_bytes, dense, packed_weights_bytes(self.model)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over all layers: 2 (K and V) x block_size x kv_heads x head_dim x dtype x layers
        (an int8 cache: one byte an element, and a 4-byte scale per token and KV head)."""
        a = self.model.args
        per_token_head = a.head_dim + 4 if self.kv_int8 else a.head_dim * self.dtype.itemsize
        per_layer = 2 * self.block_size * a.num_kv_heads * per_token_head
        return per_layer * self._layers_per_block

    @property
    def _layers_per_block(self) -> int:
        """A block id holds one KV cache group's layers (all of them with a single group)."""
        return len(self.kv_groups[0].layers) if self.kv_groups else self.model.args.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        a = self.model.args
        shape = kv_cache_shape(num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        # Zeros, not empty: padded decode gathers read unwritten slots, and
        # garbage NaNs there would leak through the masked softmax (0 * NaN).
        cache_dtype = torch.int8 if self.kv_int8 else self.dtype
        tensors = [self._zeros(shape, cache_dtype) for _ in range(self._layers_per_block)]
        scales = [self._zeros(shape[:-1], torch.float32) for _ in tensors] if self.kv_int8 else None
        if self.kv_groups:  # layer j of every group shares tensor j (protocol.kv_cache_groups)
            placement = layer_placement(self.kv_groups)
            self.kv_caches = [tensors[placement[layer][1]] for layer in range(a.num_layers)]
            if scales is not None:
                scales = [scales[placement[layer][1]] for layer in range(a.num_layers)]
        else:
            self.kv_caches = tensors
        self.kv_scales = scales
        self.cuda_graphs = maybe_capture_decode_graphs(
            self.model,
            self.kv_caches,
            backend=self.attention_backend,
            enforce_eager=self.config.device.enforce_eager,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            block_size=self.block_size,
            max_model_len=self.config.model.max_model_len,
            device=self.device,
            tp_size=get_tp_group().world_size,
            kv_groups=len(self.kv_groups),
        )

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero KV tensor. On CPU its pages come from an anonymous private mapping: zero until
        written, and resident only from their first write, so a cache sized to the machine's
        memory costs what its blocks hold, not all of it at start (torch.zeros would write it all)."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the mapping alive

    @torch.inference_mode()
    def profile_run(self, forward_tokens: int | None = None) -> None:
        """The largest step the scheduler may send: max_num_batched_tokens of prefill (or
        ``forward_tokens`` of it), then sampling."""
        hidden = self._profile_forward(forward_tokens)
        self._profile_sampling(hidden)

    @torch.inference_mode()
    def profile_forward(self, tokens: int) -> None:
        """A prefill step of ``tokens`` tokens alone (the worker scales its peak), through one
        decoder layer of each kind: layers run one after another and free what they made, so
        the step's peak is one layer's, and the other layers only cost time."""
        layers = self.model.model.layers
        self.model.model.layers = torch.nn.ModuleList(one_layer_per_kind(layers))
        try:
            self._profile_forward(tokens)
        finally:
            self.model.model.layers = layers

    @torch.inference_mode()
    def profile_sampling(self, computed_rows: int | None = None) -> None:
        """The logits and sampling of the largest step, on a hidden state of its rows; the LM head
        runs on ``computed_rows`` of them where given (``_profile_sampling``)."""
        a = self.model.args
        rows = min(self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens)
        self._profile_sampling(
            torch.zeros(rows, a.hidden_size, dtype=self.dtype, device=self.device), computed_rows
        )

    def _profile_sampling(self, hidden: torch.Tensor, computed_rows: int | None = None) -> None:
        """Logits for the step's rows, then sampling. With ``computed_rows`` (on one rank) the LM head
        runs on that many rows and its logits are tiled to the rest: what the peak needs is the
        logits' bytes, not their values (the profiled hidden state is zeros anyway), and on a CPU the
        LM head over 128 rows was a second of every start-up. Under tensor parallelism every row
        goes through the gather, whose buffers count in the peak."""
        a = self.model.args
        if self.attention_backend == "torch":
            # Its decode steps hold the K/V gather buffer at up to its cap; count it in the peak.
            gather_shape = (2 * a.num_kv_heads, self.max_decode_group_tokens, a.head_dim)
            self.model.attention_workspace.take(gather_shape, hidden).fill_(0)
        # Speculation computes logits at every draft position too, but samples them in chunks.
        rows = min(self.config.scheduler.max_num_seqs, hidden.shape[0])
        logits_rows = (
            rows if self.spec_decoder is None else min(self.spec_decoder.max_logits_rows, hidden.shape[0])
        )
        sample_rows = (
            rows if self.spec_decoder is None else min(self.spec_decoder.max_chunk_rows, logits_rows)
        )
        dummy = RequestSamplingInput(SamplingParams(top_p=0.9, logprobs=5), [0], [])
        sampling = build_sampling_metadata(
            [dummy] * sample_rows, vocab_size=a.vocab_size, eos_token_id=None, device=self.device
        )
        if computed_rows is not None and computed_rows < logits_rows and get_tp_group().world_size == 1:
            some = self.model.compute_logits(hidden[:computed_rows])
            logits = some.repeat(-(-logits_rows // computed_rows), 1)[:logits_rows]
        else:
            logits = self.model.compute_logits(
                hidden[:logits_rows]
            )  # None on tensor-parallel followers: they never sample
        if logits is not None:
            self.sampler(logits[:sample_rows], sampling)

    def _profile_forward(self, tokens: int | None = None) -> torch.Tensor:
        """Prefill max_num_batched_tokens (or ``tokens``) tokens as max_model_len-long sequences,
        without a KV cache."""
        total, max_len = (
            tokens or self.config.scheduler.max_num_batched_tokens,
            self.config.model.max_model_len,
        )
        lens = np.array([max_len] * (total // max_len) + ([total % max_len] if total % max_len else []))
        meta = build_attention_metadata(
            query_lens=lens,
            context_lens=np.zeros_like(lens),
            block_table=np.zeros((len(lens), 1), dtype=np.int32),
            slot_mapping=np.zeros(total, dtype=np.int64),
            block_size=self.block_size,
            device=self.device,
        )
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(self.device)
        if self.attention_backend == "triton":
            return self._profile_forward_triton(lens, positions)
        # The CPU backends profile a fresh prefill on torch ops, without a cache.
        with set_forward_context(meta, None):
            return self.model(torch.zeros(total, dtype=torch.long, device=self.device), positions)

    def _profile_forward_triton(self, lens: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """The profiled prefill on the Triton kernels that will serve it (compiled now, not in the first
        requests), over a scratch cache just large enough for its sequences, shared by the layers (each
        writes its K/V before reading them back). Its bytes count in the peak, a slight overstatement."""
        meta, cache = self._scratch_triton_step(lens)
        total = int(lens.sum())
        with set_forward_context(meta, [cache] * self.model.args.num_layers, "triton"):
            return self.model(torch.zeros(total, dtype=torch.long, device=self.device), positions)

    def _scratch_triton_step(self, lens: np.ndarray, context_lens: np.ndarray | None = None):
        """Triton metadata for sequences of ``lens`` new tokens after ``context_lens`` cached ones, each
        on blocks of its own in a zeroed scratch cache (block 0 the null block)."""
        context = np.zeros_like(lens) if context_lens is None else np.asarray(context_lens, dtype=np.int64)
        bs, a = self.block_size, self.model.args
        blocks_per_seq = -(-(context + lens) // bs)
        table = np.zeros((len(lens), max(1, int(blocks_per_seq.max(initial=1)))), dtype=np.int32)
        first = 1 + np.concatenate(([0], np.cumsum(blocks_per_seq)[:-1]))
        for i, (start, n) in enumerate(zip(first, blocks_per_seq)):
            table[i, :n] = np.arange(start, start + n)
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(context, lens)])
        rows = np.repeat(np.arange(len(lens)), lens)
        slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        meta = build_triton_metadata(
            query_lens=lens,
            context_lens=context,
            block_table=table,
            slot_mapping=slots,
            block_size=bs,
            device=self.device,
        )
        shape = kv_cache_shape(1 + int(blocks_per_seq.sum()), bs, a.num_kv_heads, a.head_dim)
        return meta, torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def profile_decode_graph(self) -> None:
        """A decode step of the largest CUDA-graph batch over one block of context each: its peak is what
        the graphs' memory pool will hold (captured after the KV cache, so it is budgeted before)."""
        rows = max(capture_sizes(self.config.scheduler.max_num_seqs))
        lens = np.ones(rows, dtype=np.int64)
        meta, cache = self._scratch_triton_step(lens, np.full(rows, self.block_size - 1))
        positions = torch.full((rows,), self.block_size - 1, dtype=torch.long, device=self.device)
        with set_forward_context(meta, [cache] * self.model.args.num_layers, "triton"):
            self.model(torch.zeros(rows, dtype=torch.long, device=self.device), positions)

    @property
    def captures_graphs(self) -> bool:
        """Whether ``initialize_kv_cache`` will capture decode CUDA graphs (``cuda_graphs.graphs_wanted``)."""
        return graphs_wanted(
            self.device,
            self.attention_backend,
            self.config.device.enforce_eager,
            get_tp_group().world_size,
            len(self.kv_groups),
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_tokens and self.spec_decoder is None:
            raise ValueError(
                "The scheduler sent draft tokens, but speculative decoding is off in this worker."
            )
        self.input_batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        if self.step_threads is not None:
            self.step_threads.enter_step(scheduler_output.total_num_scheduled_tokens)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_drafts = self.spec_decoder.write_drafts(self.input_batch, spec_tokens) if spec_tokens else None
        step = prepare_step(
            self.input_batch,
            req_ids,
            scheduler_output.num_scheduled_tokens,
            self.device,
            self.max_decode_group_tokens,
            num_drafts,
            self.attention_backend,
            self.prefill_caps,
            self.staging,
        )
        hidden = self._forward(step)  # [T, H]
        pooled_req_ids, pooled = [], None
        if self.input_batch.pooling_req_ids:
            pooled_req_ids, pooled = pool_step(hidden, step, self.input_batch)
            # Pooling requests never sample: their last prompt token gave them a vector instead.
            is_pooling = np.array([r in self.input_batch.pooling_req_ids for r in req_ids])
            step = dataclasses.replace(step, samples=step.samples & ~is_pooling)
        # Structured outputs: the sampled positions' logits come masked by their grammars.
        compute_logits = with_grammar_bitmask(
            self.model.compute_logits, scheduler_output, req_ids, step.samples
        )
        if spec_tokens:
            sampled, logprobs = self.spec_decoder.sample(
                hidden, step, spec_tokens, self.input_batch, compute_logits
            )
        else:
            sampled, logprobs = self._sample(hidden, step, compute_logits)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(hidden, step),
            spec_token_ids=self.spec_decoder.propose(self.input_batch, req_ids, sampled)
            if self.spec_decoder
            else [],
            pooled_req_ids=pooled_req_ids,
            pooled=pooled,
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model's hidden states [T, H]: a CUDA-graph replay for a pure decode step when one was captured."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_replay(step.attn_metadata):
            return self.cuda_graphs.replay(step.input_ids, step.positions, step.attn_metadata)
        groups = step.group_metadata
        with set_forward_context(
            step.attn_metadata, self.kv_caches, self.attention_backend, groups, kv_scales=self.kv_scales
        ):
            return self.model(step.input_ids, step.positions)

    def _sample(
        self,
        hidden: torch.Tensor,
        step: StepInputs,
        compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    ) -> tuple[list[list[int]], list[list[TokenLogprobs]]]:
        rows, states = sampling_states(step, self.input_batch)
        if rows.size == 0:
            return record_emitted(step, self.input_batch, rows, [], [])
        index = torch.from_numpy(step.sample_token_index).to(self.device)
        logits = compute_logits(hidden[index])  # [N, V]; None on tensor-parallel followers
        tp = get_tp_group()
        if logits is None:  # a follower feeds the driver's tokens to its next step
            token_ids = tp.broadcast_from_driver(torch.empty(len(rows), dtype=torch.long, device=self.device))
            entries = [None] * len(rows)
        else:
            vocab = logits.shape[1]
            meta = build_sampling_metadata(
                [
                    RequestSamplingInput(
                        s.sampling_params,
                        # The batch's copy of the prompt: a repetition penalty reads it in one copy.
                        self.input_batch.token_ids[s.row, : s.num_prompt_tokens],
                        s.output_token_ids,
                        cached_filters(s, vocab, self.device),
                        filters_given=True,
                    )
                    for s in states
                ],
                vocab_size=vocab,
                eos_token_id=self.config.model.eos_token_id,
                device=self.device,
                staging=self.staging,
            )
            out = self.sampler(logits, meta)
            token_ids, entries = tp.broadcast_from_driver(out.token_ids), out.logprobs
        tokens = [[token] for token in token_ids.tolist()]
        return record_emitted(
            step, self.input_batch, rows, tokens, [[] if entry is None else [entry] for entry in entries]
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, step: StepInputs
    ) -> dict[str, list[TokenLogprobs | None]]:
        result = {}
        for i, req_id in enumerate(step.req_ids):
            state = self.input_batch.requests[req_id]
            context = int(step.context_lens[i])
            if state.sampling_params.prompt_logprobs is None or context >= state.num_prompt_tokens:
                continue
            chunk = hidden[step.query_start[i] : step.query_start[i + 1]]
            result[req_id] = chunk_prompt_logprobs(state, chunk, context, self.model.compute_logits)
        return result


def place_layers_in_kv_groups(model, layer_windows: list[int], groups: list[KVCacheGroup]) -> None:
    """Point each attention layer at its KV cache group, after checking that the model's own
    windows are the ones the scheduler was configured with (one config, read twice)."""
    layers = sorted((m for m in model.modules() if isinstance(m, PagedAttention)), key=lambda m: m.layer_idx)
    ours = [layer.sliding_window or 0 for layer in layers]
    if (layer_windows or [0] * len(layers)) != ours:
        raise ValueError(
            f"The model's sliding windows per layer {ours} differ from the configured {layer_windows}."
        )
    for layer_idx, (group, index) in layer_placement(groups).items():
        layers[layer_idx].kv_group = group
        layers[layer_idx].checks_decode_args = index == 0


def resolve_kv_int8(cache_dtype: str, backend: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this worker's KV cache is int8 (``CacheConfig.cache_dtype``; the engine arguments have
    decided every case but ``auto`` on CPU for a bf16 model). ``auto`` takes it where the cpu
    backend's decodes over it run on int8 dot products (the path measured to pay: README "int8 KV
    cache"); an explicit ``int8`` runs on either CPU backend (the torch one writes and gathers it
    with torch ops, slowly), not Triton."""
    if cache_dtype == "model":
        return False
    if backend == "triton":
        if cache_dtype == "int8":
            raise ValueError("kv_cache_dtype int8 runs on the CPU backends only, not on Triton's kernels.")
        return False
    if cache_dtype == "int8":
        return True
    from kernels.cpu_attention import int8_dot_queries

    return backend == "cpu" and int8_dot_queries(dtype, head_dim)


def prefill_caps_for(backend: str, dtype: torch.dtype, head_dim: int) -> PrefillCaps:
    """Which prefills the cpu backend's kernel takes: all of them, on bf16 dot products
    (``WEFT_ATTENTION_BF16_DOT=1``, AVX512_BF16) or on its register tiles; the torch backend's
    caps are unused (``attention_metadata.py``)."""
    if backend == "cpu":
        from kernels.cpu_attention import bf16_dot_prefills, tile_prefills

        if bf16_dot_prefills(dtype, head_dim):
            return BF16_DOT_PREFILL_CAPS
        if tile_prefills(dtype, head_dim):
            return TILE_PREFILL_CAPS
    return FP32_PREFILL_CAPS


def one_layer_per_kind(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    """The first layer of each kind (its class, and the windows of its attention), in order."""
    kept: dict[tuple, torch.nn.Module] = {}
    for layer in layers:
        windows = tuple(m.sliding_window for m in layer.modules() if isinstance(m, PagedAttention))
        kept.setdefault((type(layer), windows), layer)
    return list(kept.values())
