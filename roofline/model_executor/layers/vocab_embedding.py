"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

Embedding: rows outside the rank's slice give zeros; one all-reduce sums the ranks' lookups.
LM head: each rank computes logits for its slice; an all-gather joins them (sampling sees full rows).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from roofline.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from roofline.cpu import gemm as cpu_gemm, greedy_head


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=None):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)  # last shard padded
        self.start = self.tp_rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.end - self.start
        param.data[:n].copy_(loaded[self.start : self.end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    cpu_packed = None  # set by cpu_prepare.pack_model after loading (CPU)
    cpu_greedy = None  # greedy_head.GreedyScreen, set by cpu_prepare.prepare_model (CPU, tp 1)

    def greedy_tokens(self, hidden: torch.Tensor, rows: list[int]) -> Optional[torch.Tensor]:
        """compute_logits(hidden[rows]).argmax(-1) (first maximum) without the full logits, through the
        int8 screen of greedy_head.py, or None where it does not apply (then compute the logits)."""
        screen = self.cpu_greedy
        if (screen is None or self.tp_size != 1 or not greedy_head.SWITCH.on() or hidden.dtype != torch.float32
                or len(rows) > greedy_head.MAX_ROWS):
            return None
        h = hidden if rows == list(range(hidden.shape[0])) else hidden[torch.tensor(rows, device=hidden.device)]
        runs = greedy_head.route_runs_for(h, self.weight, self.cpu_packed)
        if runs is None:
            return None
        return screen.tokens(h, self.cpu_packed, self.weight, runs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_gemm.linear(hidden, self.weight, self.cpu_packed)  # [T, V/tp]
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]
