"""Decode and verify steps of a Llama model on CPU with the Python between the kernels cut to the calls.

At one sequence a step's kernels take about half of it on a 2-core CPU: 30 layers of a dozen
modules each, their dispatch (which weight copy, which backend, which kernel, checks already
made) and the wrappers around each op cost as much as the arithmetic. For a step whose attention
runs on the paged CPU kernels alone (decodes, speculative verify rows and short prefill chunks,
none on the SDPA paths) and whose every linear layer is one compiled call at its row count (the packed weight on the
integer-activation op, ``QuantizedWeight.one_call``, as by default; or the AVX2 int8 copy's
one-call path, ``Int8Weight.one_call``), ``LeanDecode`` runs each layer as the same kernels on the
same tensors, called straight: the norms and the rotation of ``kernels.cpu_fused``, the KV write and
the decode and prefill kernels of ``kernels.cpu_attention``, the linear layers. The
numbers are those of the module path bit for bit (a test compares them); only the Python between
the calls goes.

``LeanDecode.qualifies`` decides once per model whether its layers are such (biases on packed
weights alone, as Qwen2's QKV; QK-norm as Qwen3's, the module's own norm; no sliding window, one
worker, the compiled kernels built; Gemma 3's layers, window layers included, take the subclass in
``lean_gemma3.py``); ``runs`` decides per step (the paged kernels alone on the CPU
backend, fp32 activations, every linear one call at ``rows``). The first
layer's attention call checks its arguments in full, as the module path's does; the kernels check
the index values on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_attention
from kernels.cpu_build import switch_on
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.norm import RMSNorm

ENV_SWITCH = "WEFT_LEAN_DECODE"  # "0": every step through the modules (to measure what this gains)
# Larger steps take the modules: their kernels dwarf the Python between them, and the modules free
# each layer's activations as they go where this path holds a step's buffers to its end (the
# start-up profile measures the activation peak on the modules).
MAX_ROWS = 256


@dataclass(frozen=True)
class _Linear:
    run: Callable[[torch.Tensor, torch.Tensor], None]  # run(x, out): x @ W^T into out
    out_features: int


@dataclass(frozen=True)
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: RMSNorm | None  # QK-norm (Qwen3): per head, on the torch path as the module's
    k_norm: RMSNorm | None
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    intermediate: int


def _one_call(linear, rows: int) -> _Linear | None:
    """The one kernel call ``linear`` makes for a step of ``rows`` rows, as the module path
    chooses its weight (``LinearBase.linear``), or None where that is not one call."""
    if linear.runs_packed(rows):
        run = linear.quant.one_call()
        if run is None:
            return None
        if linear.bias is not None:  # QuantizedWeight.linear adds it to the product in place
            product, bias = run, linear.bias

            def run(x: torch.Tensor, out: torch.Tensor) -> None:
                product(x, out)
                out.add_(bias)

        return _Linear(run, linear.quant.shape[0])
    copy = linear.int8_copy_for(rows)
    if copy is None or not copy.one_call or linear.bias is not None:  # the copy's one call takes no bias
        return None
    op, weight, scale, block = copy._one_call, copy._qweight, copy.scale, copy.hadamard_block
    return _Linear(lambda x, out: op(x, weight, scale, block, out), copy.out_features)


def _weight_runs(linear, rows: int) -> str:
    """Which of its weights ``linear`` runs a step of ``rows`` rows on (``LinearBase.linear``'s choice)."""
    if linear.runs_packed(rows):
        return "packed"
    return "int8" if linear.int8_copy_for(rows) is not None else "dense"


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _out_features(linear) -> int:
    return linear.quant.shape[0] if linear.quant is not None else linear.int8.out_features


def _layers_qualify(model, eps: float) -> bool:
    """One worker, every linear packed or with an int8 copy; QK-norm, if any, Llama's RMSNorm;
    no sliding window, one KV cache group; the compiled norms and SiLU-and-mul; the kernels built;
    every layer's shapes alike."""
    # Nothing here loads a kernel: the packed weights' op and a one-call int8 copy loaded theirs when
    # the model was built, and the norms asked for the fused kernels then. (A process killed while
    # torch loads an extension leaves its build lock behind, and every later load waits on it:
    # loading in the middle of serving made that a crash away.)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not _linears_one_call_capable(layer):
            return False
        if hasattr(attn, "q_norm") and not (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm):
            return False
        if attn.attn.sliding_window is not None or attn.attn.kv_group != 0:
            return False
        if not (isinstance(mlp.act_fn, SiluAndMul) and mlp.act_fn._cpu_fused):
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or not n._cpu_fused or n.eps != eps for n in norms):
            return False
    return _layers_alike(model)


def _linears_one_call_capable(layer) -> bool:
    """Every linear of ``layer`` packed or with an int8 copy, on one worker (no tensor parallel)."""
    attn, mlp = layer.self_attn, layer.mlp
    if any(lin.quant is None and lin.int8 is None for lin in _linears(layer)):
        return False
    return attn.o_proj.tp.world_size == 1 and mlp.down_proj.tp.world_size == 1


def _layers_alike(model) -> bool:
    """Every layer's linears of the same shapes (the MLP's width with them): a step's activation
    buffers serve them all."""
    return len({tuple(_out_features(lin) for lin in _linears(layer)) for layer in model.layers}) == 1


class LeanDecode:
    """The lean decode path of one ``LlamaModel`` (see the module notes)."""

    def __init__(self, model) -> None:
        self.model = model
        self._by_rows: dict[int, list[_Layer] | None] = {}  # None: a step of that many rows runs the modules
        self._by_weights: dict[tuple[str, ...], list[_Layer]] = {}  # keyed by the weight each linear runs
        self._qualifies: bool | None = None  # decided at the first step with a KV cache (copies made)
        first = model.layers[0]
        attn = first.self_attn
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.num_heads, self.num_kv_heads = attn.attn.num_heads, attn.attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.scale = attn.attn.scale
        self.eps = first.input_layernorm.eps
        self.rotary = attn.rotary

    def qualifies(self) -> bool:
        """Whether the model's layers are the ones this path runs (see the module notes)."""
        if self._qualifies is None:
            self._qualifies = switch_on(ENV_SWITCH) and self._layers_qualify()
        return self._qualifies

    def _layers_qualify(self) -> bool:
        return _layers_qualify(self.model, self.eps)

    def runs(self, rows: int, x: torch.Tensor, context) -> bool:
        """Whether this step (``rows`` tokens, embeddings ``x``) runs lean."""
        if rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or context is None:
            return False
        if context.backend != "cpu" or context.kv_scales is not None or context.kv_caches is None:
            return False
        for meta in context.group_metadata or (context.attn_metadata,):  # each KV cache group's
            if (
                (meta.paged_decodes is None and meta.paged_prefills is None)
                or meta.decode_groups
                or meta.prefills
            ):
                return False
        if not self.qualifies():
            return False
        if rows not in self._by_rows:
            self._by_rows[rows] = self._layers_for(rows)
        return self._by_rows[rows] is not None

    def _layers_for(self, rows: int) -> list[_Layer] | None:
        """The layers' calls for a step of ``rows`` rows, or None where a linear is not one call.
        Row counts whose linears run the same weights share them."""
        linears = [lin for layer in self.model.layers for lin in _linears(layer)]
        key = tuple(_weight_runs(lin, rows) for lin in linears)
        if "dense" in key:
            return None
        if key in self._by_weights:
            return self._by_weights[key]
        calls = [_one_call(lin, rows) for lin in linears]
        if any(call is None for call in calls):
            return None
        layers = self._bind(calls)
        self._by_weights[key] = layers
        return layers

    def _bind(self, calls: list[_Linear]) -> list:
        """Each layer's tensors and its four linears' calls (``calls``, four a layer in order)."""
        return [
            _Layer(
                in_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                qkv=calls[4 * i],
                o=calls[4 * i + 1],
                gate_up=calls[4 * i + 2],
                down=calls[4 * i + 3],
                intermediate=layer.mlp.intermediate_size,
            )
            for i, layer in enumerate(self.model.layers)
        ]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers of a step ``runs`` accepted: (the last layer's MLP output, the
        residual stream before it), as ``LlamaDecoderLayer`` returns them."""
        fused = torch.ops.weft_fused
        rms_norm, add_rms_norm = fused.rms_norm.default, fused.fused_add_rms_norm.default
        rotary, silu_and_mul = fused.rotary_neox.default, fused.silu_and_mul.default
        attention = torch.ops.weft_cpu.paged_decode_attention.default
        write_kv = torch.ops.weft_cpu.write_kv.default
        meta = context.group_metadata[0] if context.group_metadata else context.attn_metadata
        decodes, prefills, slots = meta.paged_decodes, meta.paged_prefills, meta.slot_mapping
        t = x.shape[0]
        h, kvh, d, eps, scale = self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale
        q_size, kv_size = self.q_size, self.kv_size
        cos, sin = self.rotary.cos, self.rotary.sin
        positions = positions.long()
        layers = self._by_rows[t]
        first = layers[0]
        # One buffer per activation for the whole step (the layers are alike, each consumes its
        # inputs before the next writes them), and their views made once.
        x, residual = torch.empty_like(x), x
        qkv = torch.empty(t, first.qkv.out_features)
        q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
        heads, new_keys, new_values = (
            q.view(t, h, d),
            k.view(t, kvh, d),
            v.view(t, kvh, d),
        )
        attn = torch.empty(t, h, d)
        attn_rows = attn.view(t, h * d)
        o = torch.empty(t, first.o.out_features)
        gate_up = torch.empty(t, first.gate_up.out_features)
        act = torch.empty(t, first.intermediate)
        if decodes is not None:
            table, seq_lens, token_idx = decodes.block_table, decodes.seq_lens, decodes.token_idx
        bf16_dot, int8_fast = cpu_attention.decode_switches()  # the first layer's, read once for the step
        for i, (layer, cache) in enumerate(zip(layers, context.kv_caches)):
            if i == 0:
                rms_norm(x, residual, layer.in_norm, eps)
            else:
                add_rms_norm(x, residual, layer.in_norm, eps)
            layer.qkv.run(x, qkv)
            if layer.q_norm is not None:  # the module's norms on the same views; their results in place
                q.copy_(layer.q_norm(heads).view(t, -1))
                k.copy_(layer.k_norm(k.view(t, kvh, d)).view(t, -1))
            rotary(positions, q, k, cos, sin, d)
            write_kv(new_keys, new_values, cache, slots)  # the kernel checks every argument itself
            # The first layer checks the step's arguments in full (the module path's rule).
            if decodes is not None and i == 0:
                cpu_attention.paged_decode_attention(heads, cache, token_idx, seq_lens, table, scale, attn)
            elif decodes is not None:
                attention(heads, cache, token_idx, seq_lens, table, scale, attn, 0, None, bf16_dot, int8_fast)
            if prefills is not None:  # verify rows and short chunks: few steps, so through the wrapper
                cpu_attention.paged_prefill_attention(
                    heads, cache, prefills.query_start, prefills.query_lens, prefills.context_lens,
                    prefills.block_table, scale, attn, check=i == 0,
                )  # fmt: skip
            layer.o.run(attn_rows, o)
            add_rms_norm(o, residual, layer.post_norm, eps)  # residual += o; o = norm(residual)
            layer.gate_up.run(o, gate_up)
            silu_and_mul(act, gate_up)
            layer.down.run(act, x)
        return x, residual
