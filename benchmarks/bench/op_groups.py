"""How ``weft bench profile`` groups profiler ops: by the kind of work (linear, attention, the
fused CPU kernels, element-wise ops by kind, copies), so that a change to one kind of work shows
as a shift between groups. Shared by the fixed-shape profile and the workload profile."""

from __future__ import annotations

# Self-CPU op name -> group; an op not named here is matched by the prefixes below, else "other".
_GROUPS = {
    "mkldnn::_linear_pointwise": "linear",
    "aten::addmm": "linear",
    "aten::mm": "linear",
    "aten::linear": "linear",
    "aten::matmul": "linear",
    # The int8 dense copy: its GEMM and the two passes around it.
    "aten::_int_mm": "linear",
    "weft_fused::quantize_rows_int8": "linear",
    "weft_fused::scale_int32": "linear",
    "weft_cpu::paged_decode_attention": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::bmm": "attention",
    "aten::_softmax": "attention",
    "aten::mul": "elementwise: mul",
    "aten::add": "elementwise: add",
    "aten::add_": "elementwise: add",
    "aten::pow": "elementwise: RMSNorm (pow/mean/rsqrt)",
    "aten::mean": "elementwise: RMSNorm (pow/mean/rsqrt)",
    "aten::rsqrt": "elementwise: RMSNorm (pow/mean/rsqrt)",
    "aten::sum": "elementwise: RMSNorm (pow/mean/rsqrt)",
    "aten::div": "elementwise: RMSNorm (pow/mean/rsqrt)",
    "aten::silu": "elementwise: silu",
    "aten::cat": "elementwise: cat/neg (rotary)",
    "aten::neg": "elementwise: cat/neg (rotary)",
    "aten::copy_": "copies (copy_/to/index)",
    "aten::index": "copies (copy_/to/index)",
    "aten::index_copy_": "copies (copy_/to/index)",
    "aten::index_put_": "copies (copy_/to/index)",
    "aten::embedding": "copies (copy_/to/index)",
    "aten::index_select": "copies (copy_/to/index)",
}
_PREFIXES = (("weft_fused::", "fused CPU kernels"), ("weft_cpu::", "attention"), ("weft_quant_", "linear"))


def group_of(op_name: str) -> str:
    if op_name in _GROUPS:
        return _GROUPS[op_name]
    return next((group for prefix, group in _PREFIXES if op_name.startswith(prefix)), "other")
