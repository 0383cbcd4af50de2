"""Decode and verify steps of a Gemma 3 model on CPU, its layers run as their kernels called straight.

``LeanDecode``'s path (``lean_decode.py``: which steps and weights qualify, the linear layers' one
calls, the cache writes) for Gemma 3's layer (``gemma3.py``): four norms a layer, each scaling by
``1 + weight`` (the compiled RMSNorm on ``GemmaRMSNorm.one_plus_weight``, as the module runs it in
fp32), each sublayer's output normalized before it joins the residual stream (with the next norm, one
``norm_add_norm`` call: the bits of the norm, the add and the norm); QK-norm per head and the
rotation in one call (``qk_norm_rotary``); GeGLU (the compiled kernel, as the module's
``GeluTanhAndMul``); each layer's own rotation table (the window layers' local base); and the window
layers' attention on their own KV cache group's tables with their window passed to the paged
kernels. The same arithmetic on the same tensors in the same order as the modules, so the same bits
(``tests/worker/test_lean_decode.py``).
Gemma 3 270M, one thread, 48 tokens after a short prompt, the two alternated in one process: 53.0-54.3
ms a token through the modules (six norms a layer, 18 layers), 41.4-43.5 ms here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_attention
from services.worker.layers.norm import GemmaRMSNorm
from services.worker.models.lean_decode import LeanDecode, _layers_alike, _Linear, _linears_one_call_capable


@dataclass(frozen=True)
class _GemmaLayer:
    norms: tuple[GemmaRMSNorm, GemmaRMSNorm, GemmaRMSNorm, GemmaRMSNorm]  # in, post-attn, pre-/post-MLP
    q_norm: GemmaRMSNorm
    k_norm: GemmaRMSNorm
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    cos: torch.Tensor  # the layer's rotation table (window layers: the local base)
    sin: torch.Tensor
    window: int  # 0: global attention
    group: int  # its KV cache group, whose metadata it reads
    checks: bool  # the first layer of its group: the attention call checks its arguments in full


def _norms(layer) -> tuple:
    return (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm,
        layer.self_attn.q_norm,
        layer.self_attn.k_norm,
    )


class LeanGemma3(LeanDecode):
    """The lean decode path of one ``Gemma3Model``."""

    def _layers_qualify(self) -> bool:
        """One worker, every linear packed or with an int8 copy, every norm, rotation and GeGLU the
        compiled kernel, every layer's shapes alike."""
        for layer in self.model.layers:
            if not _linears_one_call_capable(layer):
                return False
            if any(
                type(n) is not GemmaRMSNorm or not n._cpu_fused or n.eps != self.eps for n in _norms(layer)
            ):
                return False
            if not layer.self_attn.rotary._cpu_fused or not layer.mlp.act._cpu_fused:
                return False
        return _layers_alike(self.model)

    def _bind(self, calls: list[_Linear]) -> list[_GemmaLayer]:
        layers = []
        for i, layer in enumerate(self.model.layers):
            norms = _norms(layer)
            attn = layer.self_attn.attn
            layers.append(
                _GemmaLayer(
                    norms=norms[:4],
                    q_norm=norms[4],
                    k_norm=norms[5],
                    qkv=calls[4 * i],
                    o=calls[4 * i + 1],
                    gate_up=calls[4 * i + 2],
                    down=calls[4 * i + 3],
                    cos=layer.self_attn.rotary.cos,
                    sin=layer.self_attn.rotary.sin,
                    window=attn.sliding_window or 0,
                    group=attn.kv_group,
                    checks=attn.checks_decode_args,
                )
            )
        return layers

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context) -> torch.Tensor:  # type: ignore[override]
        """The decoder layers of a step ``runs`` accepted: the residual stream after the last
        layer (``x``'s storage), as the layers leave it before the final norm."""
        fused = torch.ops.weft_fused
        rms_norm, norm_add_norm = fused.rms_norm.default, fused.norm_add_norm.default
        qk_norm_rotary, gelu_mul = fused.qk_norm_rotary.default, fused.gelu_tanh_and_mul.default
        attention = torch.ops.weft_cpu.paged_decode_attention.default
        write_kv = torch.ops.weft_cpu.write_kv.default
        metas = context.group_metadata or (context.attn_metadata,)
        t = x.shape[0]
        h, kvh, d, eps, scale = self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale
        q_size, kv_size = self.q_size, self.kv_size
        positions = positions.long()
        layers = self._by_rows[t]
        first = layers[0]
        # One buffer per activation for the whole step (the layers are alike).
        residual = x
        normed = torch.empty_like(x)  # a norm's output: the next linear's input, or the sublayer's output
        out = torch.empty_like(x)  # the attention's and the MLP's output projections
        qkv = torch.empty(t, first.qkv.out_features)
        q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
        q_normed, k_normed = torch.empty(t, q_size), torch.empty(t, kv_size)
        heads = q_normed.view(t, h, d)
        new_keys, new_values = k_normed.view(t, kvh, d), v.view(t, kvh, d)
        attn = torch.empty(t, h, d)
        attn_rows = attn.view(t, h * d)
        gate_up = torch.empty(t, first.gate_up.out_features)
        act = torch.empty(t, first.gate_up.out_features // 2)
        bf16_dot, int8_fast = cpu_attention.decode_switches()  # read once for the step
        caches = context.kv_caches
        rms_norm(normed, residual, first.norms[0].one_plus_weight(), eps)  # the first layer's input norm
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            post_attn, pre_mlp, post_mlp = (n.one_plus_weight() for n in layer.norms[1:])
            layer.qkv.run(normed, qkv)
            # QK-norm per head into the buffers, then their rotation: one call, the module's bits.
            q_w, k_w = layer.q_norm.one_plus_weight(), layer.k_norm.one_plus_weight()
            qk_norm_rotary(positions, q_normed, k_normed, q, k, q_w, k_w, eps, layer.cos, layer.sin, d)
            meta = metas[layer.group]
            write_kv(new_keys, new_values, cache, meta.slot_mapping)  # the kernel checks every argument
            decodes, prefills = meta.paged_decodes, meta.paged_prefills
            if decodes is not None and layer.checks:
                cpu_attention.paged_decode_attention(
                    heads, cache, decodes.token_idx, decodes.seq_lens, decodes.block_table, scale, attn,
                    window=layer.window,
                )  # fmt: skip
            elif decodes is not None:
                attention(
                    heads, cache, decodes.token_idx, decodes.seq_lens, decodes.block_table, scale, attn,
                    layer.window, None, bf16_dot, int8_fast,
                )  # fmt: skip
            if prefills is not None:  # verify rows and short chunks
                cpu_attention.paged_prefill_attention(
                    heads, cache, prefills.query_start, prefills.query_lens, prefills.context_lens,
                    prefills.block_table, scale, attn, check=layer.checks, window=layer.window,
                )  # fmt: skip
            layer.o.run(attn_rows, out)
            # residual += norm(attention), as the module adds them; normed = the MLP's input norm.
            norm_add_norm(normed, residual, out, post_attn, pre_mlp, eps)
            layer.gate_up.run(normed, gate_up)
            gelu_mul(act, gate_up)
            layer.down.run(act, out)
            if i + 1 < len(layers):  # residual += norm(MLP); normed = the next layer's input norm
                norm_add_norm(normed, residual, out, post_mlp, layers[i + 1].norms[0].one_plus_weight(), eps)
            else:
                rms_norm(normed, out, post_mlp, eps)
                residual.add_(normed)
        return residual
