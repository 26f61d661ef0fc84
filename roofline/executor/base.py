"""Executor interface: runs SchedulerOutputs on one or many workers and returns one ModelRunnerOutput."""

from __future__ import annotations

from abc import ABC, abstractmethod

from roofline.config import EngineConfig
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from roofline.model_executor.loader.source import ModelSource


class ExecutorDeadError(RuntimeError):
    """The executor cannot run any more steps (a worker died, hung or failed): the engine stops.
    Any other exception from execute() is taken as caused by the step's requests (see EngineCore)."""


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def block_bytes(self) -> int: ...

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the model's weights as rank 0's layers compute on them, by format."""
        return {}

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig, source: ModelSource, show_progress: bool = True) -> Executor:
    if config.parallel_config.world_size > 1 or config.parallel_config.nnodes > 1:
        from roofline.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source, show_progress)
    from roofline.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, source, show_progress)
