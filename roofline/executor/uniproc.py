"""Single-process executor: the worker lives in the engine's own process."""

from __future__ import annotations

from roofline.config import EngineConfig
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from roofline.executor.base import Executor
from roofline.model_executor.loader.source import ModelSource
from roofline.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, show_progress: bool = True) -> None:
        self.worker = Worker(config, source, rank=0, show_progress=show_progress)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def block_bytes(self) -> int:
        return self.worker.block_bytes()

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks, num_swap_blocks)

    def kv_group_windows(self) -> list[int]:
        return self.worker.kv_group_windows()

    def kv_state_slots(self) -> int:
        return self.worker.num_state_slots()

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.worker.weight_bytes)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(out)

    def shutdown(self) -> None:
        self.worker.shutdown()
