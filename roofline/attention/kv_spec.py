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

Sliding-window layers (an attention spec with `sliding_window`) need only their window's blocks.  `plan_layout`
groups the layers so that those blocks can go back to the pool (vLLM's hybrid allocator): layers are cut into
groups of k layers of one window each (k = the gcd of each window's layer count); a group has its own block
table per request, and the pool keeps k slot tensors, layer j of every group in slot j -- a block id belongs
to one group at a time, so a block holds k layers' K/V whichever group owns it.  Gemma 3 1B (4 full, 22
sliding layers): k = 2, 2 full groups and 11 sliding ones; a request of L tokens holds 4 L + 22 W layer-rows
instead of 26 L.  Without windows (or with the plan switched off) the layout is the identity: one group,
one slot per layer.

Recurrent state (linear attention: Qwen3-Next's Gated DeltaNet layers): a `recurrent_spec` layer keeps no KV per
token but a fixed-size state per running request -- its causal convolution's last conv_kernel - 1 inputs
(conv_dim channels) and the delta rule's matrix state (num_v_heads x k_head_dim x v_head_dim), both fp32 -- in
one tensor  [num_state_slots, state_values]  (conv state first, then the matrix state).  Its bytes per KV block
are 0; the pool sizing subtracts num_state_slots states (`state_bytes`), one slot per request the scheduler
may run at once (max_num_seqs).  The scheduler's KV manager hands each request a slot with its first blocks
and takes it back with them (finish, abort, recompute preemption); the slot's state is zeroed by the layer
when a request starts at position 0.  Such a state cannot be rebuilt from a prefix of blocks: a model with
recurrent layers runs with prefix caching off, recomputes on preemption (no swap), and its forked requests
(n > 1, beams) recompute their prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

KINDS = ("attention", "mla", "indexer", "recurrent")
STATE_DTYPE = torch.float32  # recurrent states are kept in fp32 whatever the model dtype


@dataclass(frozen=True)
class KVCacheSpec:
    kind: str  # "attention" (K and V per KV head) | "mla" (one latent per token) | "indexer" (DSA's index keys)
    #            | "recurrent" (a fixed-size state per request: linear attention)
    num_kv_heads: int
    head_size: int  # values per head and slot
    latent_rank: int = 0  # MLA: the latent's width (the first latent_rank values of the row)
    rope_dim: int = 0  # MLA: the roped shared key's width (the rest of the row)
    sliding_window: int = 0  # attention: a query sees its last sliding_window keys only (0: all)
    conv_dim: int = 0  # recurrent: the causal convolution's channels (num_kv_heads = value heads, head_size = v dim)
    conv_kernel: int = 0  # recurrent: the convolution's width (its state keeps conv_kernel - 1 inputs)
    k_head_dim: int = 0  # recurrent: the matrix state's key dimension

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache kind {self.kind!r}; one of {KINDS}")
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(f"KV cache spec needs positive heads and head size, got {self}")

    @property
    def num_slots(self) -> int:
        return 2 if self.kind == "attention" else 1

    @property
    def recurrent(self) -> bool:
        return self.kind == "recurrent"

    @property
    def values_per_token(self) -> int:
        return 0 if self.recurrent else self.num_slots * self.num_kv_heads * self.head_size

    @property
    def conv_state_values(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def state_values(self) -> int:
        """Recurrent: one request's state (conv inputs, then the matrix state); 0 for per-token kinds."""
        if not self.recurrent:
            return 0
        return self.conv_state_values + self.num_kv_heads * self.k_head_dim * self.head_size

    def state_shape(self, num_state_slots: int) -> tuple[int, int]:
        return (num_state_slots, self.state_values)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token * dtype_bytes(dtype)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_slots, num_blocks, block_size, self.num_kv_heads, self.head_size)


def attention_spec(num_kv_heads: int, head_dim: int, sliding_window: int = 0) -> KVCacheSpec:
    """K and V of num_kv_heads x head_dim per token (MHA when the heads equal the query heads, else GQA);
    sliding_window > 0: the layer's queries see their last sliding_window keys only."""
    return KVCacheSpec("attention", num_kv_heads, head_dim, sliding_window=sliding_window)


def mla_spec(kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
    """MLA: one latent of kv_lora_rank + qk_rope_head_dim values per token, shared by every head."""
    return KVCacheSpec("mla", 1, kv_lora_rank + qk_rope_head_dim, latent_rank=kv_lora_rank, rope_dim=qk_rope_head_dim)


def indexer_spec(index_head_dim: int) -> KVCacheSpec:
    """DSA's lightning indexer: one key of index_head_dim values per token, scored against every query."""
    return KVCacheSpec("indexer", 1, index_head_dim)


def recurrent_spec(conv_dim: int, conv_kernel: int, num_v_heads: int, k_head_dim: int, v_head_dim: int) -> KVCacheSpec:
    """Linear attention (Gated DeltaNet): per request a conv state of conv_dim x (conv_kernel - 1) inputs and a
    num_v_heads x k_head_dim x v_head_dim matrix state, fp32; nothing per token."""
    if conv_dim <= 0 or conv_kernel < 1 or k_head_dim <= 0:
        raise ValueError("a recurrent spec needs positive conv_dim, conv_kernel and k_head_dim")
    return KVCacheSpec("recurrent", num_v_heads, v_head_dim, conv_dim=conv_dim, conv_kernel=conv_kernel,
                       k_head_dim=k_head_dim)


def has_recurrent(specs: Sequence[KVCacheSpec]) -> bool:
    return any(s.recurrent for s in specs)


def num_state_slots(specs: Sequence[KVCacheSpec], max_num_seqs: int) -> int:
    """State slots the pool keeps: one per request that may run at once, where any layer is recurrent."""
    return max_num_seqs if has_recurrent(specs) else 0


def state_bytes(specs: Sequence[KVCacheSpec], num_slots: int) -> int:
    """The recurrent layers' states of num_slots requests, in bytes (fp32)."""
    return sum(s.state_values for s in specs) * num_slots * dtype_bytes(STATE_DTYPE)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """One block's bytes summed over every layer (a block id addresses the same block in all layers)."""
    return sum(s.bytes_per_token(dtype) for s in specs) * block_size


def allocate(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int,
             zeros: Callable[[tuple], torch.Tensor], num_state_slots: int = 0) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer; zeros(shape) makes the tensor (device, dtype, pinning).  A recurrent
    layer's tensor holds num_state_slots states in fp32 on the same device."""
    out = []
    for s in specs:
        if s.recurrent:
            if num_state_slots <= 0:
                raise ValueError("a recurrent layer needs state slots (num_state_slots > 0)")
            out.append(zeros((0,)).new_zeros(s.state_shape(num_state_slots), dtype=STATE_DTYPE))
        else:
            out.append(zeros(s.shape(num_blocks, block_size)))
    return out


def uniform(specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    """The one spec all layers share (what the fused paths that bind every layer at once need)."""
    if not specs:
        raise ValueError("model declares no KV cache layers")
    first = specs[0]
    if any(s != first for s in specs[1:]):
        raise ValueError("layers declare different KV cache specs")
    return first


@dataclass(frozen=True)
class KVCacheLayout:
    """Where each layer keeps its cache and which block table it reads (module docstring).
      group_windows   per block-table group: its layers' sliding window (0: full attention)
      group_of_layer  per layer (the model's spec order): its group
      slot_of_layer   per layer: the slot tensor holding its cache
      slot_specs      per slot tensor: its spec (without a window: the shape)"""
    group_windows: tuple
    group_of_layer: tuple
    slot_of_layer: tuple
    slot_specs: tuple

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        """Whether block tables differ from the one plain table (several groups, or windows)."""
        return self.num_groups > 1 or any(self.group_windows)

    def layer_caches(self, slots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's cache tensor (slot tensors shared by the groups' layers)."""
        return [slots[j] for j in self.slot_of_layer]


def identity_layout(specs: Sequence[KVCacheSpec]) -> KVCacheLayout:
    """One group, one slot per layer: every layer keeps every block of a request."""
    n = len(specs)
    return KVCacheLayout((0,), (0,) * n, tuple(range(n)), tuple(specs))


def plan_layout(specs: Sequence[KVCacheSpec]) -> tuple[KVCacheLayout, str]:
    """The grouped layout for layers with sliding windows, or the identity; and why not grouped ("" when it is)."""
    if not specs or not any(s.sliding_window for s in specs):
        return identity_layout(specs), "no sliding-window layers"
    shapes = {replace(s, sliding_window=0) for s in specs}
    if any(s.kind != "attention" for s in specs) or len(shapes) != 1:
        return identity_layout(specs), "layers cache different shapes"
    by_window: dict[int, list[int]] = {}
    for i, s in enumerate(specs):
        by_window.setdefault(s.sliding_window, []).append(i)
    k = math.gcd(*(len(layers) for layers in by_window.values()))
    group_of, slot_of = [0] * len(specs), [0] * len(specs)
    windows: list[int] = []
    for window, layers in by_window.items():
        for c in range(0, len(layers), k):
            for j, layer in enumerate(layers[c:c + k]):
                group_of[layer], slot_of[layer] = len(windows), j
            windows.append(window)
    (shape,) = shapes
    return KVCacheLayout(tuple(windows), tuple(group_of), tuple(slot_of), (shape,) * k), ""
