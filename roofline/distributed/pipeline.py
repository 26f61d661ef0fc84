"""Pipeline parallelism: which decoder layers each stage holds, and what stages hand each other.

    stage 0:  embed -> layers [0, a)        --(hidden, residual) [2 x N x d]-->
    stage 1:  layers [a, b)                 --(hidden, residual)-->   ...
    stage P-1: layers [.., L) -> final norm -> LM head -> sample     --ModelRunnerOutput--> rank 0

Stages are the members of this rank's PP group (parallel_state.get_pp_group(): same DP and TP
coordinates, first stage first); each TP rank of a stage sends its (replicated) hidden states to the
same TP rank of the next stage.  The split is even by default -- the remainder goes to the stages
before the last, which also holds the LM head -- or `--pp-layer-partition "a,b,..."` (one count per
stage, summing to the number of layers).
"""

from __future__ import annotations

from typing import Optional

import torch

from roofline.distributed.parallel_state import get_pp_group

_PARTITION: Optional[list[int]] = None  # set from the configuration before the model is built


def parse_partition(text: Optional[str], pp: int) -> Optional[list[int]]:
    """'a,b,...' -> [a, b, ...] (one positive count per stage); ValueError naming the flag otherwise."""
    if text is None or text == "":
        return None
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated layer counts, got {text!r}") from None
    if len(counts) != pp:
        raise ValueError(f"pp_layer_partition {text!r} has {len(counts)} entries for pipeline_parallel_size={pp}")
    if any(c < 1 for c in counts):
        raise ValueError(f"pp_layer_partition {text!r}: every stage needs at least one layer")
    return counts


def stage_layer_ranges(num_layers: int, pp: int, partition: Optional[list[int]] = None) -> list[tuple[int, int]]:
    """[start, end) of every stage's layers."""
    if partition is None:
        if num_layers < pp:
            raise ValueError(f"pipeline_parallel_size={pp} needs at least {pp} layers, the model has {num_layers}")
        counts = [num_layers // pp] * pp
        for i in range(num_layers % pp):  # extras to the stages before the last (it holds the LM head)
            counts[(pp - 2 - i) % pp] += 1
    else:
        counts = list(partition)
        if len(counts) != pp or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {','.join(map(str, counts))} must give {pp} stages "
                             f"{num_layers} layers in all (the model's num_hidden_layers)")
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


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


def last_stage_driver() -> int:
    """Global rank that returns a step's ModelRunnerOutput to rank 0: the last stage's first TP rank."""
    from roofline.distributed.parallel_state import get_layout

    layout = get_layout()
    return layout.rank_of(dp=0, pp=layout.pp - 1, tp=0)
