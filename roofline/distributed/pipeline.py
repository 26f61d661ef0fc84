"""Pipeline parallelism: which decoder layers each stage holds, and what stages hand each other.

    stage 0:  embed -> layers [0, a)        --(hidden, residual) [2 x N x d]-->
    stage 1:  layers [a, b)                 --(hidden, residual)-->   ...
    stage P-1: layers [.., L) -> final norm -> LM head -> sample     --ModelRunnerOutput--> rank 0

Stages are the members of this rank's PP group (parallel_state.get_pp_group(): same DP and TP
coordinates, first stage first); each TP rank of a stage sends its (replicated) hidden states to the
same TP rank of the next stage.  The split is even by default -- the remainder goes to the stages
before the last, which also holds the LM head -- or `--pp-layer-partition "a,b,..."` (one count per
stage, summing to the number of layers); the arithmetic of the split lives in layout.py (torch-free,
the planner uses it too).
"""

from __future__ import annotations

from typing import Optional

import torch

from roofline.distributed.layout import stage_layer_ranges
from roofline.distributed.parallel_state import get_pp_group

_PARTITION: Optional[list[int]] = None  # set from the configuration before the model is built


def set_partition(partition: Optional[list[int]]) -> None:
    global _PARTITION
    _PARTITION = None if partition is None else list(partition)


def stage_layers(num_layers: int) -> tuple[int, int]:
    """[start, end) of the layers this rank's stage holds (all of them without pipeline parallelism)."""
    pp = get_pp_group()
    if pp.world_size == 1:
        return 0, num_layers
    return stage_layer_ranges(num_layers, pp.world_size, _PARTITION)[pp.rank_in_group]


def is_first_stage() -> bool:
    return get_pp_group().is_first_rank


def is_last_stage() -> bool:
    return get_pp_group().is_last_rank


class MissingLayer(torch.nn.Module):
    """Where another stage holds a layer (or the embedding, norm, LM head): no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer lives on another pipeline stage")


def send_to_next_stage(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """hidden, residual [N x d] -> the next stage (one message [2 x N x d])."""
    pp = get_pp_group()
    pp.send(torch.stack([hidden, residual]), (pp.rank_in_group + 1) % pp.world_size)


def recv_from_prev_stage(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (hidden, residual) for this step's num_tokens rows."""
    pp = get_pp_group()
    buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    pp.recv(buf, (pp.rank_in_group - 1) % pp.world_size)
    return buf[0], buf[1]


def new_output_group(output_rank: int):
    """The gloo group of rank 0 and the last stage's driver, for step outputs (created by every rank)."""
    import torch.distributed as dist

    from roofline.distributed.parallel_state import CONTROL_TIMEOUT

    return dist.new_group([0, output_rank], backend="gloo", timeout=CONTROL_TIMEOUT)


def last_stage_driver() -> int:
    """Global rank that returns a step's ModelRunnerOutput to rank 0: the last stage's first TP rank."""
    from roofline.distributed.parallel_state import get_layout

    layout = get_layout()
    return layout.rank_of(dp=0, pp=layout.pp - 1, tp=0)
