"""The Llama layers hand the residual stream to the next norm's fused add: the hidden states
must equal the plain composition, x + attn(norm(x)) then x + mlp(norm(x)) per layer, in fp32
and bf16, on the fused CPU kernels and on the torch ops."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kernels import cpu_fused
from services.worker.forward_context import set_forward_context
from services.worker.layers.attention_metadata import build_attention_metadata
from services.worker.model_loader import load_model

TOKENS = [3, 17, 42, 99, 5, 250, 128, 7, 7, 7, 64, 1]
# bf16: the two orders differ only where an fp32 sum rounds on another side of a bf16 step.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _metadata(n: int):
    return build_attention_metadata(
        query_lens=np.array([n]),
        context_lens=np.array([0]),
        block_table=np.zeros((1, 1), np.int32),
        slot_mapping=np.zeros(n),
        block_size=16,
    )


def _composed(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The hidden states as the layers' plain sum, the torch RMSNorm throughout."""
    inner = model.model
    x = inner.embed_tokens(ids)
    for layer in inner.layers:
        x = x + layer.self_attn(positions, layer.input_layernorm._norm(x))
        x = x + layer.mlp(layer.post_attention_layernorm._norm(x))
    return inner.norm._norm(x)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_carried_residual_equals_the_plain_sum(tiny_llama_dir, make_engine_config, dtype, fused):
    if fused and not cpu_fused.available():
        pytest.fail("the fused CPU kernels did not build here")
    config = make_engine_config(str(tiny_llama_dir), str(tiny_llama_dir), max_model_len=256)
    model = load_model(msgspec.structs.replace(config.model, dtype=str(dtype).removeprefix("torch.")))
    norms = [m for m in model.modules() if hasattr(m, "_cpu_fused")]
    assert norms and all(m._cpu_fused for m in norms) == cpu_fused.available()
    for norm in norms:
        norm._cpu_fused = fused
    ids, positions = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    with torch.inference_mode(), set_forward_context(_metadata(len(TOKENS)), None):
        ours = model(ids, positions)
        expected = _composed(model, ids, positions)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), expected.float(), **TOLERANCE[dtype])
