"""What one decoder layer keeps in the paged KV cache, and every shape and size that follows from it.

A model declares one `KVCacheSpec` per layer (`model.kv_cache_specs()`); the worker sizes the pool,
allocates it, swaps and copies blocks, and the CUDA graphs and CPU layer stack bind to it, all from
these specs and never from the attention modules' attributes.

Every layer's cache is one tensor  [num_kv_slots, num_blocks, block_size, num_kv_heads, head_size]:
  * ordinary attention (MHA/GQA):  slots = 2 (index 0 = K, 1 = V), num_kv_heads x head_dim each;
  * multi-head latent attention (DeepSeek MLA): slots = 1, one shared "head" whose row is the
    normalised latent (kv_lora_rank values) followed by the roped shared key (qk_rope_head_dim).
  * the sparse-attention indexer's keys (DeepSeek-V3.2 DSA): slots = 1, one head of index_head_dim values,
    declared by the same layer right after its MLA latent and addressed by the same block ids.
A layer may declare more than one spec (the model's list holds them in layer order, each layer's together).
The block index is dim 1 for every kind, so block swaps and copies (`cache[:, dst] = cache[:, src]`)
are generic.  Which attention backend reads and writes the tensor follows from `kind`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

KINDS = ("attention", "mla", "indexer")


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # "attention" (K and V per KV head) | "mla" (one latent per token) | "indexer" (DSA's index keys)
    num_kv_heads: int
    head_size: int  # values per head and slot
    latent_rank: int = 0  # MLA: the latent's width (the first latent_rank values of the row)
    rope_dim: int = 0  # MLA: the roped shared key's width (the rest of the row)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache kind {self.kind!r}; one of {KINDS}")
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(f"KV cache spec needs positive heads and head size, got {self}")

    @property
    def num_slots(self) -> int:
        return 2 if self.kind == "attention" else 1

    @property
    def values_per_token(self) -> int:
        return self.num_slots * self.num_kv_heads * self.head_size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token * dtype_bytes(dtype)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_slots, num_blocks, block_size, self.num_kv_heads, self.head_size)


def attention_spec(num_kv_heads: int, head_dim: int) -> KVCacheSpec:
    """K and V of num_kv_heads x head_dim per token (MHA when the heads equal the query heads, else GQA)."""
    return KVCacheSpec("attention", num_kv_heads, head_dim)


def mla_spec(kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
    """MLA: one latent of kv_lora_rank + qk_rope_head_dim values per token, shared by every head."""
    return KVCacheSpec("mla", 1, kv_lora_rank + qk_rope_head_dim, latent_rank=kv_lora_rank, rope_dim=qk_rope_head_dim)


def indexer_spec(index_head_dim: int) -> KVCacheSpec:
    """DSA's lightning indexer: one key of index_head_dim values per token, scored against every query."""
    return KVCacheSpec("indexer", 1, index_head_dim)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """One block's bytes summed over every layer (a block id addresses the same block in all layers)."""
    return sum(s.bytes_per_token(dtype) for s in specs) * block_size


def allocate(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int,
             zeros: Callable[[tuple], torch.Tensor]) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer; zeros(shape) makes the tensor (device, dtype, pinning)."""
    return [zeros(s.shape(num_blocks, block_size)) for s in specs]


def uniform(specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    """The one spec all layers share (what the fused paths that bind every layer at once need)."""
    if not specs:
        raise ValueError("model declares no KV cache layers")
    first = specs[0]
    if any(s != first for s in specs[1:]):
        raise ValueError("layers declare different KV cache specs")
    return first
