"""The token bitmask of one step: built in the engine process, applied to logits in the worker.

Layout (xgrammar's): int32 [R x ceil(V/32)]; bit j of word w of row r set = token 32*w + j allowed.
Only rows that sample this step for a constrained request get one; the SchedulerOutput carries the
rows' request ids and the raw little-endian bytes (msgspec, so every tensor-parallel rank gets it).
apply_token_bitmask is plain torch (no xgrammar in the worker): one vectorized unpack and masked
fill on the logits' own device -- the same code on CPU and GPU.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def build_step_bitmask(grammars: Sequence[tuple[str, Any]], vocab_size: int) -> tuple[list[str], Optional[bytes]]:
    """(req_id, RequestGrammar) of the rows that sample this step -> (req ids of the constrained
    rows, their bitmask bytes); ([], None) when none is constrained."""
    rows = [(rid, g) for rid, g in grammars if g.constrains]
    if not rows:
        return [], None
    mask = torch.zeros((len(rows), bitmask_width(vocab_size)), dtype=torch.int32)
    for r, (_, g) in enumerate(rows):
        g.fill(mask, r)
    return [rid for rid, _ in rows], mask.numpy().tobytes()


def bitmask_tensor(data: bytes, num_rows: int, device: torch.device) -> torch.Tensor:
    """The bytes of build_step_bitmask as an int32 [R x W] tensor on device."""
    host = torch.from_numpy(np.frombuffer(data, dtype=np.int32).reshape(num_rows, -1).copy())
    return host.to(device, non_blocking=True)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0.  logits [B x V] (V below 32 * W:
    the tail bits are ignored; V above: the tokens past 32 * W are masked), bitmask int32 [len(rows) x W] on
    logits' device."""
    if not len(rows):
        return
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(BITS, dtype=torch.int32, device=logits.device)
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).reshape(bitmask.shape[0], -1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        idx = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
