"""The wire: every message and config that crosses a process boundary.

Only stdlib, msgspec, pyzmq and numpy may be imported here.
"""

from protocol.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from protocol.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    TokenLogprobs,
)
from protocol.pooling_params import PoolingParams, PoolingType
from protocol.sampling_params import SamplingParams, SamplingType
from protocol.scheduler import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from protocol.structured_outputs import StructuredOutputsParams

__all__ = [
    "CacheConfig",
    "CachedRequestData",
    "DeviceConfig",
    "EngineConfig",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "FinishReason",
    "ModelConfig",
    "ModelRunnerOutput",
    "NewRequestData",
    "ParallelConfig",
    "PoolingParams",
    "PoolingType",
    "SamplingParams",
    "SamplingType",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "StructuredOutputsParams",
    "TokenLogprobs",
]
