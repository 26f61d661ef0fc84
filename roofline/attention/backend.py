"""The attention-backend interface and the metadata every backend reads.

Paged KV layout, one tensor per layer:  kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V).  A token at logical position p of a request lives in physical slot
    block_table[p // block_size] * block_size + p % block_size.

The flat batch holds the new tokens of R requests back to back (no padding):
    query rows of request r:   query_start_loc[r] .. query_start_loc[r+1]       (q_len_r = C_r)
    its context after this step: seq_lens[r] = S_r + C_r  (S_r cached tokens before this step)
Query row i of request r sits at position S_r + i and attends causally to positions 0 .. S_r + i,
reading K/V only through block_tables[r].  Requests with q_len == 1 (decodes) come first:
num_decodes of them, then the prefill chunks.

A layer may ask for `AttentionOptions` (Gemma's sliding windows and logit soft-capping, gpt-oss's sinks);
every backend honours them or refuses them by name -- none ignores one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int  # N: rows in the flat batch
    num_reqs: int  # R
    num_decodes: int  # the first num_decodes requests have exactly one query row
    query_start_loc: torch.Tensor  # [R+1] int32, device
    seq_lens: torch.Tensor  # [R] int32, device: context length after this step
    block_tables: torch.Tensor  # [R, max_blocks] int32, device (rows padded with 0)
    slot_mapping: torch.Tensor  # [N] int64, device: where each new token's K/V is written
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, for backends that loop on the host
    seq_lens_cpu: list[int]
    # hybrid KV layout (attention/kv_spec.plan_layout): one metadata per block-table group (its block_tables and
    # slot_mapping; the rest as here) and each layer's group; None: every layer reads the fields above
    group_metas: Optional[list] = None
    group_of_layer: Optional[tuple] = None
    # recurrent state (linear-attention layers, attention/kv_spec.recurrent_spec): per request its state slot
    # (host list; None where the model keeps none)
    state_slots_cpu: Optional[list] = None

    def for_layer(self, layer_idx: int) -> "AttentionMetadata":
        """The metadata layer layer_idx attends with (its group's block tables under a hybrid layout)."""
        return self if self.group_metas is None else self.group_metas[self.group_of_layer[layer_idx]]


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """How one layer's softmax differs from plain causal attention (all off by default):
      sliding_window  a query at position p sees keys p - sliding_window + 1 .. p (HF's `sliding_window`:
                      kv_idx > q_idx - sliding_window), not the whole prefix;
      logit_softcap   scaled scores s become softcap * tanh(s / softcap) before the mask and softmax (Gemma 2);
      sinks           [H_q] fp32, this rank's query heads: one extra logit per head in the softmax's denominator
                      that no value is attached to (gpt-oss's attention sinks)."""
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"attention logit soft-cap must be positive, got {self.logit_softcap}")

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.logit_softcap is None and self.sinks is None

    def first_key(self, position):
        """The first key position a query at `position` sees (an int or a tensor of positions)."""
        if self.sliding_window is None:
            return 0 * position
        lo = position - self.sliding_window + 1
        return lo.clamp(min=0) if isinstance(lo, torch.Tensor) else max(lo, 0)


PLAIN = AttentionOptions()


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention over it."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value [N, H_kv, D] -> kv_cache[:, slot] for each row's slot."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:
        """query [N, H_q, D] -> output [N, H_q, D]; GQA when H_q is a multiple of H_kv; `options` as
        AttentionOptions describes (sliding window, soft-capping, sinks)."""


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
