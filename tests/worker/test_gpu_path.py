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
    return EngineArgs(model=str(tiny_llama_dir), max_model_len=256).create_engine_config(device_in_engine=True)


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
