"""A model-free worker for executor tests, and its config.

The executor imports it by name in each worker process
("tests.worker.executor_fakes:FakeWorker"). What it does is steered by the
request ids it is given, so a test can make one rank fail or hang:

- ``fail-on-R``: rank R raises a RuntimeError;
- ``hang-on-R``: rank R blocks for good (as a rank stuck in a collective);

and by the served model name: ``refuse-start-on-R`` makes rank R raise a
ValueError while starting.
"""

from __future__ import annotations

import threading

from protocol import EngineConfig, ModelConfig, ModelRunnerOutput, SchedulerOutput
from protocol.config import DeviceConfig, ParallelConfig

FAKE_WORKER = "tests.worker.executor_fakes:FakeWorker"


def fake_config(tensor_parallel_size: int, name: str = "fake", num_threads: int = 1) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model="none", tokenizer="none", served_model_name=name, dtype="float32", max_model_len=64
        ),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        device=DeviceConfig(num_threads=num_threads),
    )


class FakeWorker:
    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        self.config = config
        self.rank = rank
        self.num_blocks: int | None = None

    def init_device(self) -> None:
        if self.config.model.served_model_name == f"refuse-start-on-{self.rank}":
            raise ValueError(f"rank {self.rank} refuses to start")

    def determine_num_blocks(self) -> int:
        return 100 - 10 * self.rank  # differs per rank: the executor must take the minimum

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if f"fail-on-{self.rank}" in req_ids:
            raise RuntimeError(f"boom on rank {self.rank}")
        if f"hang-on-{self.rank}" in req_ids:
            threading.Event().wait()
        # Each rank answers with its own rank and thread count: the executor must return the driver's.
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[self.rank, self.config.device.num_threads]] * len(req_ids)
        )

    def shutdown(self) -> None:
        pass
