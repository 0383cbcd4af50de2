"""The GPU path's decisions, checked on CPU: CUDA facts and memory come from mocks.

- device, backend, block size and dtype decided in the engine process (``engine_device``);
- the tensor-parallel size against the visible GPUs;
- the GPU KV budget measured as vLLM does (``memory_profiling``), and its refusal;
- no CPU-kernel build for a model built for CUDA;
- a CUDA-graph capture that raises leaves the engine eager;
- profiling on the backend that serves.
"""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch

from services.config.engine_args import EngineArgs
from services.config.engine_device import CudaFacts, gpu_dtype, resolve_engine_device

H100 = CudaFacts(True, 1, (9, 0))
T4 = CudaFacts(True, 2, (7, 5))
NO_GPU = CudaFacts(False)
GIB = 1 << 30


@pytest.fixture(scope="module")
def api_config(tiny_llama_dir):
    """What an API node with device auto sends its engines."""
    return EngineArgs(model=str(tiny_llama_dir), max_model_len=256).create_engine_config(
        device_in_engine=True
    )


def test_the_api_node_carries_auto(api_config):
    assert api_config.device.device == "auto"
    assert api_config.device.attention_backend == "auto"
    assert api_config.cache.block_size == 0
    assert api_config.model.dtype == "auto"


def test_an_engine_with_a_gpu_decides_cuda_triton_16_and_bf16(api_config):
    config = resolve_engine_device(api_config, H100)
    assert (config.device.device, config.device.attention_backend) == ("cuda", "triton")
    assert (config.cache.block_size, config.model.dtype) == (16, "bfloat16")
    assert config.model.quantization == "none" and config.cache.available_memory is None


def test_pre_ampere_gpus_get_fp16():
    assert gpu_dtype((7, 5)) == "float16" and gpu_dtype((8, 0)) == "bfloat16"


def test_pre_ampere_engine(api_config):
    assert resolve_engine_device(api_config, T4).model.dtype == "float16"


def test_an_engine_without_cuda_decides_as_the_cpu_path_did(tiny_llama_dir, api_config):
    """On a CPU the engine's decisions are the ones the API node used to make itself."""
    local = EngineArgs(model=str(tiny_llama_dir), max_model_len=256, device="cpu").create_engine_config()
    resolved = resolve_engine_device(api_config, NO_GPU)
    same_memory = msgspec.structs.replace(resolved.cache, available_memory=local.cache.available_memory)
    assert msgspec.structs.replace(resolved, cache=same_memory) == local  # MemAvailable moves between reads


def test_explicit_choices_stay(tiny_llama_dir):
    config = EngineArgs(
        model=str(tiny_llama_dir), max_model_len=256, dtype="float32", block_size=32
    ).create_engine_config(device_in_engine=True)
    resolved = resolve_engine_device(config, H100)
    assert (resolved.model.dtype, resolved.cache.block_size) == ("float32", 32)


def test_tensor_parallel_size_checked_against_the_gpus(tiny_llama_dir):
    config = EngineArgs(
        model=str(tiny_llama_dir), max_model_len=256, tensor_parallel_size=2
    ).create_engine_config(device_in_engine=True)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 GPUs.*sees 1"):
        resolve_engine_device(config, H100)
    assert resolve_engine_device(config, T4).device.device == "cuda"
    explicit = EngineArgs(model=str(tiny_llama_dir), max_model_len=256, device="cuda").create_engine_config()
    with pytest.raises(ValueError, match="sees no usable CUDA device"):
        resolve_engine_device(explicit, NO_GPU)


class FakeGpu:
    """torch.cuda's memory queries over numbers a test sets: ``other`` bytes outside torch (context,
    NCCL, other processes), ``allocated`` by torch's allocator, and its peak."""

    def __init__(self, monkeypatch, total: int, other: int, count: int = 1) -> None:
        self.total, self.other, self.allocated, self.peak = total, other, 0, 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(
            cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated)
        )
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "set_device", lambda device: None)
        monkeypatch.setattr(cuda, "device_count", lambda: count)

    @property
    def free(self) -> int:
        return self.total - self.other - self.allocated

    def run(self, nbytes: int) -> None:
        """A step that allocates ``nbytes`` at its peak and frees them."""
        self.peak = max(self.peak, self.allocated + nbytes)


class FakeRunner:
    weights_bytes = 10 * GIB
    captures_graphs = True

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def profile_decode_graph(self) -> None:
        self.gpu.run(GIB // 2)


def cuda_worker(tiny_llama_dir, **cache):
    from services.worker.worker import Worker

    config = EngineArgs(
        model=str(tiny_llama_dir), max_model_len=256, device="cuda", **cache
    ).create_engine_config()
    return Worker(config)


def test_kv_budget_counts_what_torch_does_not_allocate_and_the_graph_pool(monkeypatch, tiny_llama_dir):
    from services.worker.memory_profiling import gpu_snapshot

    gpu = FakeGpu(monkeypatch, total=80 * GIB, other=GIB // 2)  # the CUDA context
    worker = cuda_worker(tiny_llama_dir, gpu_memory_utilization=0.9)
    worker.gpu_start = gpu_snapshot(worker.device)
    gpu.allocated = worker.model_bytes = 10 * GIB + 64 * 2**20  # weights and the rotary tables
    gpu.other += 2 * GIB  # cuBLAS and NCCL workspaces, made while loading and profiling
    worker.model_runner = FakeRunner(gpu)
    kv, source = worker.kv_budget(activation_peak=3 * GIB)
    assert kv == int(80 * GIB * 0.9) - (10 * GIB + 64 * 2**20) - 3 * GIB - 2 * GIB - GIB // 2
    assert "72.00 GiB, less 2.00 GiB outside torch" in source and "0.50 GiB for the CUDA graphs" in source


def test_start_is_refused_with_the_numbers_when_free_memory_is_short(monkeypatch, tiny_llama_dir):
    FakeGpu(monkeypatch, total=80 * GIB, other=20 * GIB)  # another process holds 20 GiB
    worker = cuda_worker(tiny_llama_dir, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"60.00 GiB free of 80.00 GiB.*0.9 x 80.00 GiB = 72.00 GiB.*0.75"):
        worker.init_device()


def test_a_worker_past_the_visible_gpus_says_so(monkeypatch, tiny_llama_dir):
    from services.worker.worker import check_device_visible

    FakeGpu(monkeypatch, total=80 * GIB, other=0, count=1)
    with pytest.raises(ValueError, match="runs on cuda:1, but 1 GPU.*tensor_parallel_size 2"):
        check_device_visible(torch.device("cuda:1"), 2)


def hf_configs() -> dict[str, dict]:
    import transformers as tf

    small = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return {
        "llama": tf.LlamaConfig(**small, **heads).to_dict(),
        "qwen3": tf.Qwen3Config(**small, **heads).to_dict(),
        "gemma3_text": tf.Gemma3TextConfig(**small, **heads, sliding_window=16).to_dict(),
    }


def test_a_model_built_for_cuda_builds_no_cpu_kernel(monkeypatch):
    from kernels import cpu_fused
    from services.worker.layers.kernel_device import building_for
    from services.worker.models.registry import model_class

    asked = []
    monkeypatch.setattr(cpu_fused, "available", lambda: asked.append("available") or False)
    monkeypatch.setattr(cpu_fused, "load", lambda: asked.append("load"))
    for name, hf_config in hf_configs().items():
        cls = model_class(hf_config)
        with building_for("cuda"), torch.device("meta"):
            model = cls(cls.args_class.from_hf_config(hf_config), 256, torch.bfloat16)
        assert next(model.parameters()).device.type == "meta"
        assert asked == [], f"{name}: the CPU kernels were loaded for a CUDA model"
    with building_for("cpu"), torch.device("meta"):  # the same construction for a CPU does ask
        cls(cls.args_class.from_hf_config(hf_config), 256, torch.float32)
    assert "available" in asked


def test_a_capture_that_raises_leaves_the_engine_eager(monkeypatch, caplog):
    from services.worker import cuda_graphs

    class FailingCapture(cuda_graphs.CudaGraphRunner):
        def __init__(self, *args, device, **kwargs):
            super().__init__(*args, device=torch.device("cpu"), **kwargs)

        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = dict(backend="triton", enforce_eager=False, max_num_seqs=8, block_size=16, max_model_len=64)
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        runner = cuda_graphs.maybe_capture_decode_graphs(
            None, [], device=torch.device("cuda"), runner_class=FailingCapture, **args
        )
    assert runner is None
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
    assert "run eagerly" in caplog.text


def test_when_graphs_are_captured():
    from services.worker.cuda_graphs import capture_sizes, graphs_wanted

    cuda = torch.device("cuda")
    assert graphs_wanted(cuda, "triton", False)
    assert not graphs_wanted(cuda, "triton", True)  # --enforce-eager
    assert not graphs_wanted(cuda, "triton", False, tp_size=2)  # NCCL all-reduces are not captured
    assert not graphs_wanted(cuda, "triton", False, kv_groups=2)  # one block table per replay
    assert not graphs_wanted(torch.device("cpu"), "triton", False)
    sizes = capture_sizes(512)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17  # vLLM's 51
    assert np.all(np.diff(sizes[sizes.index(256) :]) == 16) and np.all(
        np.diff(sizes[3 : sizes.index(256)]) == 8
    )
