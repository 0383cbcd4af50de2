"""The device, attention backend, block size and dtype, decided where the model runs.

The API node may have no GPU while its engines do (a CPU-only API container in front of GPU
engine nodes), or a GPU driver where CUDA cannot run (a CPU build of torch,
``CUDA_VISIBLE_DEVICES=""``). So with ``--device auto`` the API's ``EngineConfig`` carries
``auto`` for these four (``device``, ``attention_backend``, block size 0, ``dtype``), and
``resolve_engine_device`` decides them in the engine process from what torch there sees:
``torch.cuda.is_available()`` and the compute capability. bf16 runs in Triton's ``tl.dot`` from
compute capability 8.0 (Ampere) on; older GPUs get fp16, as vLLM does.

The API node still plans the choices that only a CPU makes (GGUF weights kept packed, the dense
copy, the int8 KV cache, the node's memory) from a torch-free probe of its own node; an engine
that finds CUDA where that probe saw none drops them, and says so.

Torch-free: the caller passes in what torch reported (``cuda_facts`` reads it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from protocol import EngineConfig

logger = logging.getLogger(__name__)

AUTO = "auto"


@dataclass(frozen=True)
class CudaFacts:
    available: bool
    device_count: int = 0
    capability: tuple[int, int] = (0, 0)  # of device 0; the engine's GPUs are alike


def cuda_facts() -> CudaFacts:
    """What this process's torch sees (imports torch: call it in the engine process only)."""
    import torch

    if not torch.cuda.is_available():
        return CudaFacts(False)
    return CudaFacts(True, torch.cuda.device_count(), tuple(torch.cuda.get_device_capability(0)))


def gpu_dtype(capability: tuple[int, int]) -> str:
    """``auto`` on a GPU: bf16 from compute capability 8.0 on, fp16 below (no bf16 ``tl.dot``)."""
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


def is_auto(config: EngineConfig) -> bool:
    return AUTO in (config.device.device, config.device.attention_backend, config.model.dtype) or (
        config.cache.block_size == 0
    )


def resolve_engine_device(config: EngineConfig, facts: CudaFacts | None = None) -> EngineConfig:
    """``config`` with every ``auto`` of the four decided here, and the tensor-parallel size checked
    against the GPUs this process sees."""
    from services.config.engine_args import default_block_size, resolve_attention_backend, resolve_dtype

    if not is_auto(config) and config.device.device != "cuda":
        return config
    facts = cuda_facts() if facts is None else facts
    device = config.device.device
    if device == AUTO:
        device = "cuda" if facts.available else "cpu"
    if device == "cuda":
        check_gpu_count(config.parallel.tensor_parallel_size, facts)
    model, cache, dev = config.model, config.cache, config.device
    if device == "cuda" and model.quantization == "gguf" and config.device.device == AUTO:
        logger.info(
            "This engine runs on CUDA, where the API node planned for a CPU: GGUF weights are "
            "dequantized to the model dtype (no packed kernels on GPUs), and CPU-only choices are dropped."
        )
        model = msgspec.structs.replace(
            model, quantization="none", dense_min_rows=0, dense_copy_dtype="model"
        )
    if device == "cuda" and config.device.device == AUTO:
        cache = msgspec.structs.replace(
            cache,
            available_memory=None,
            cache_dtype="model" if cache.cache_dtype == AUTO else cache.cache_dtype,
        )
    if model.dtype == AUTO:
        dtype = (
            gpu_dtype(facts.capability)
            if device == "cuda"
            else resolve_dtype(AUTO, "cpu", model.quantization, dense_copy=model.dense_min_rows > 0)
        )
        model = msgspec.structs.replace(model, dtype=dtype)
    if cache.block_size == 0:
        cache = msgspec.structs.replace(cache, block_size=default_block_size(device))
    backend = dev.attention_backend
    if backend == AUTO:
        backend = resolve_attention_backend(device)
    dev = msgspec.structs.replace(dev, device=device, attention_backend=backend)
    resolved = msgspec.structs.replace(config, model=model, cache=cache, device=dev)
    if is_auto(config):
        logger.info(
            "Resolved in the engine process: device %s, attention backend %s, block size %d, dtype %s.",
            device,
            backend,
            cache.block_size,
            model.dtype,
        )
    return resolved


def check_gpu_count(tensor_parallel_size: int, facts: CudaFacts) -> None:
    """One GPU per tensor-parallel worker, or a ValueError that says what to change."""
    if not facts.available:
        raise ValueError(
            "device cuda: torch in this engine process sees no usable CUDA device (a CPU build of torch, "
            "CUDA_VISIBLE_DEVICES empty, or no driver); use --device cpu or auto."
        )
    if tensor_parallel_size > facts.device_count:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} needs {tensor_parallel_size} GPUs, one per worker; "
            f"this engine process sees {facts.device_count} (CUDA_VISIBLE_DEVICES selects them). Lower "
            "--tensor-parallel-size or make more GPUs visible."
        )
