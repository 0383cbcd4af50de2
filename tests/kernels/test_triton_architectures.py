"""Every registered architecture on the Triton backend (interpreted on CPU): the torch backend's tokens.

Tiny random checkpoints with a GPU's shapes where it matters to the kernels: head size 64,
16-token blocks, grouped-query attention (4 query heads over 2 KV heads). Prompts longer than
the step budget make the steps mix a prefill chunk over cached context with decodes; the window
models (Mistral's and Gemma 3's sliding-window layers) have windows shorter than the prompts, so
the kernels' window masks and the window groups' block tables are exercised. Qwen3's QK-norm
sends ``[T, heads, D]`` to the Triton RMSNorm.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import kernels.paged_attention
from protocol import SamplingParams
from services import LLM, model_files
from services.worker.models.registry import ARCHITECTURES

pytestmark = pytest.mark.slow

WINDOW = 24
SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.2,
)
CHECKPOINTS = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {}),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
}
PROMPTS = [[(5 * i + 3) % 500 + 1 for i in range(45)], [(11 * i + 7) % 500 + 1 for i in range(19)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def save_checkpoint(path, architecture: str):
    import transformers as tf

    config_name, model_name, overrides = CHECKPOINTS[architecture]
    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():  # biases start at 0 and norms at their identity: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(0.0 if name.endswith("bias") or "Gemma" in architecture else 1.0, 0.3)
    model.save_pretrained(path)
    tokenizer_dir = model_files.models_dir() / model_files.DEFAULT_GGUF.replace(".gguf", ".hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the GPU check has them without the GGUF
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def greedy_tokens(monkeypatch, folder, backend: str, device: torch.device) -> list[list[int]]:
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", backend)
    llm = LLM(
        str(folder),
        dtype="float32",
        device=device.type,  # on a GPU (the device check), the Triton run replays CUDA graphs
        num_threads=1,
        block_size=16,
        max_model_len=128,
        num_gpu_blocks_override=24,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    try:
        assert llm.config.device.attention_backend == backend
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


def test_every_registered_architecture_is_checked_here():
    assert set(CHECKPOINTS) == set(ARCHITECTURES)


@pytest.mark.parametrize("architecture", sorted(CHECKPOINTS))
def test_triton_backend_gives_the_torch_tokens(tmp_path, monkeypatch, architecture, device):
    torch.set_num_threads(1)
    folder = save_checkpoint(tmp_path, architecture)
    expected = greedy_tokens(monkeypatch, folder, "torch", device)
    windows, kernel = [], kernels.paged_attention.paged_attention

    def counting(*args, **kwargs):
        windows.append(kwargs.get("window", 0))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kernels.paged_attention, "paged_attention", counting)
    assert greedy_tokens(monkeypatch, folder, "triton", device) == expected
    assert windows, "the Triton kernel never ran"
    has_window = "sliding_window" in CHECKPOINTS[architecture][2]
    assert (WINDOW in windows) == has_window
    assert all(len(tokens) == 4 for tokens in expected)


def test_profiling_runs_on_the_serving_backend(tmp_path, monkeypatch, device):
    """The profiled step runs the Triton kernels (compiled at start on a GPU, and its peak theirs)."""
    from services.config.engine_args import EngineArgs
    from services.worker.forward_context import current_backend
    from services.worker.model_runner import ModelRunner

    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", "triton")
    folder = save_checkpoint(tmp_path, "Qwen3ForCausalLM")
    config = EngineArgs(
        model=str(folder), device=device.type, dtype="float32", block_size=16, max_model_len=64,
        max_num_batched_tokens=24, max_num_seqs=2, num_threads=1,
    ).create_engine_config()  # fmt: skip
    assert config.device.attention_backend == "triton"
    runner = ModelRunner(config, device)
    runner.load_model()
    seen, kernel = [], kernels.paged_attention.paged_attention

    def recording(query, *args, **kwargs):
        seen.append((current_backend(), query.shape[0]))
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(kernels.paged_attention, "paged_attention", recording)
    runner.profile_run()
    assert seen == [("triton", 24)] * 2  # each layer, over the whole step
