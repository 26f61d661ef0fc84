"""Executor interface: runs SchedulerOutputs on one or many workers and returns one ModelRunnerOutput."""

from __future__ import annotations

from abc import ABC, abstractmethod

from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """The executor cannot run any more steps (a worker died, hung or failed): the engine stops.
    Any other exception from execute() is taken as caused by the step's requests (see EngineCore)."""

    # the scheduler and block pool of the core that saw this are whole (only the executor failed): its
    # requests can still be aborted there, which gives back every block
    core_state_intact = True


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def block_bytes(self) -> int: ...

    @abstractmethod
    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None: ...

    def kv_group_windows(self) -> list[int]:
        """The block-table groups of the workers' hybrid KV layout (each one's sliding window, 0: full); []
        when every layer reads one table per request."""
        return []

    def kv_state_slots(self) -> int:
        """Recurrent-state slots the workers' pools keep (attention/kv_spec.recurrent_spec); 0: none."""
        return 0

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    # Batches in flight: an executor that takes more than one step at once (pipeline stages) says how
    # many, and runs submit() / collect() (outputs in submission order) as well as execute().
    max_batches_in_flight = 1

    def submit(self, out: SchedulerOutput) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs one step at a time (execute)")

    def collect(self) -> ModelRunnerOutput:
        raise NotImplementedError(f"{type(self).__name__} runs one step at a time (execute)")

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the model's weights as rank 0's layers compute on them, by format."""
        return {}

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass
