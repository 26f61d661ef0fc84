"""create_executor: one process (UniProcExecutor), many (MultiprocExecutor) or Ray actors (RayExecutor,
--distributed-executor-backend ray) from the parallel configuration; the one place that knows them all."""

from __future__ import annotations

from roofline.config import EngineConfig
from roofline.executor.base import Executor
from roofline.model_executor.loader.source import ModelSource


def runs_in_process(config: EngineConfig) -> bool:
    """Whether the model runs in the engine's own process (UniProcExecutor), not in rank processes."""
    pc = config.parallel_config
    return pc.distributed_executor_backend != "ray" and pc.world_size == 1 and pc.nnodes == 1


def create_executor(config: EngineConfig, source: ModelSource, show_progress: bool = True) -> Executor:
    if config.parallel_config.distributed_executor_backend == "ray":
        from roofline.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, show_progress)
    if not runs_in_process(config):
        from roofline.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, source, show_progress)
    from roofline.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, source, show_progress)
