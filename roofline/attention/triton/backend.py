"""Triton attention backend for the paged KV cache (our own kernels, in kernels.py).

Same semantics as TorchAttentionBackend (roofline/attention/torch_backend.py), the correctness
baseline; the layout and flat-batch conventions are those of roofline/attention/backend.py.

Kernel design
-------------
write_kv  (_write_kv_kernel)
    grid (N,): one program per new token.  It loads slot_mapping[t], splits it into
    (physical block, offset) = (slot // block_size, slot % block_size) and copies the token's
    [H_kv, D] key and value tiles (any strides) into kv_cache[0/1, block, offset], cast to the cache
    dtype.  slot < 0 means "skip" (padding rows): every load/store is masked off.

paged attention  (_paged_attn_kernel)  -- one kernel for mixed batches (decodes + prefill chunks)
    grid (N // BLOCK_Q + R, H_kv, NUM_SPLITS).
    * Query tile = BLOCK_M rows = BLOCK_Q tokens x G query heads, G = H_q // H_kv: the GQA group that
      shares one KV head is packed into the M dimension (row m -> token m // G, head
      kv_head * G + m % G), so every K/V tile is read once per group and K/V are never expanded.
      BLOCK_M is 16 (or next_pow2(G)) for decode-only batches, 64/128 when any prefill is present.
    * Tile -> request: request r owns axis-0 ids [qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1),
      which is >= cdiv(q_len_r, BLOCK_Q) ids, so a binary search over query_start_loc finds the
      request of a tile; surplus ids return at once.  No host-side tile map, nothing to sync.
    * Row i of request r is at position q = seq_len_r - q_len_r + i and sees keys 0..q.  The program
      walks keys 0 .. (last row's position) in BLOCK_N steps (64 for D <= 128).  For each key tile it
      gathers the physical block id of every key from block_tables[r, pos // block_size] (BLOCK_N /
      block_size distinct pages per step when BLOCK_N is a multiple of the page size; the pages
      can be anywhere in the pool) and addresses K^T [D, BLOCK_N] and V [BLOCK_N, D] at
      block * stride_block + (pos % block_size) * stride_slot.  block_size is a constexpr, so // and
      % are shifts and masks.
    * S = Q K^T and O += P V are tl.dot on the tiles; online softmax (FlashAttention-2 style) in
      base 2 with fp32 running max m, sum l and accumulator acc [BLOCK_M, D] -- the [L x L] score
      matrix never exists.  Key tiles entirely below the tile's first row position are processed
      without any position mask; only the diagonal / tail tiles apply the causal and length mask.
      P is cast to the cache dtype for the PV product (bf16/fp16 tensor-core dot, fp32 accumulate);
      fp32 caches use input_precision="ieee" so results match the fp32 reference.
    * Head dims: HEAD_DIM is a constexpr, padded to a power of two >= 16 with masks (64 and 128
      are the tuned cases).

split-KV / FlashDecoding  (same kernel with NUM_SPLITS > 1, then _split_kv_reduce_kernel)
    With few sequences, R * H_kv programs cannot fill the GPU's SMs while each one streams a long
    context.  Axis 2 then cuts each tile's key range [0, kv_end) into NUM_SPLITS segments of
    cdiv(cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N keys; each program writes its normalised partial
    output o_s [N, H_q, S, D] and base-2 log-sum-exp lse_s [N, H_q, S] (-inf for an empty segment or
    a row that saw no key there).  The reduce kernel, grid (N, H_q), combines them:
    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s.
    The path is exact for any batch (prefill tiles too); the heuristic picks it only when
        the batch is decode-only (max_query_len == 1), R * H_kv < num_SMs (the plain grid would leave
        SMs idle) and max_seq_len >= SPLIT_MIN_SEQ_LEN (512);
    NUM_SPLITS = largest power of two <= min(MAX_SPLITS (16), cdiv(2 * num_SMs, R * H_kv),
    max_seq_len // SPLIT_MIN_SEGMENT (256)), and at least 2.
    Force either path with TritonAttentionBackend(split_kv=True / False) (num_splits=k to pin the
    count); the default split_kv=None is the heuristic.

AttentionOptions: a sliding window starts each tile's key loop at its first row's window (every tile then
masked by position from both sides); soft-capping applies cap * tanh(s / cap) to each score tile; sinks start
the online softmax with the sink as its running max and a sum of 1 (a key with no value), on the plain path.

dtypes: fp32, bf16 and fp16 caches (query/output may be any float dtype; accumulation is fp32).
Under TRITON_INTERPRET=1 (CPU tests) bf16 dot operands are upcast to fp32 first because the
interpreter's tl.dot does not handle bf16; the products are identical (bf16 x bf16 is exact in fp32).
"""

from __future__ import annotations

import torch

from roofline.attention.backend import PLAIN, AttentionBackend, AttentionMetadata, AttentionOptions
from roofline.attention.triton import kernels

SPLIT_MIN_SEQ_LEN = 512
SPLIT_MIN_SEGMENT = 256
MAX_SPLITS = 16
_DEFAULT_NUM_SMS = 132  # H100 SXM


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_properties(device).multi_processor_count
        except Exception:  # pragma: no cover - odd drivers
            return _DEFAULT_NUM_SMS
    return _DEFAULT_NUM_SMS


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels: write_kv by slot, one paged-attention kernel for mixed batches, split-KV.

    split_kv: None = heuristic, True = always split (num_splits or 4 segments), False = never.
    num_splits: pin the number of segments (a power of two) when splitting.
    block_m / block_n: override the tile shapes (mainly for tests and tuning).
    """

    name = "triton"

    def __init__(
        self,
        split_kv: bool | None = None,
        num_splits: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
    ) -> None:
        self.split_kv = split_kv
        self.num_splits = num_splits
        self.block_m = block_m
        self.block_n = block_n
        self._sms: dict[str, int] = {}

    # -- write --------------------------------------------------------------------------------
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        kernels.write_kv(key, value, kv_cache, slot_mapping)

    # -- attention ----------------------------------------------------------------------------
    def choose_num_splits(self, meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
        """1 = the plain kernel; > 1 = split-KV with that many segments (see module docstring)."""
        if self.split_kv is False:
            return 1
        if self.split_kv is True:
            return _pow2_floor(self.num_splits or 4)
        if meta.max_query_len != 1 or meta.num_reqs == 0:
            return 1
        key = str(device)
        if key not in self._sms:
            self._sms[key] = _num_sms(device)
        sms = self._sms[key]
        programs = meta.num_reqs * num_kv_heads
        if programs >= sms or meta.max_seq_len < SPLIT_MIN_SEQ_LEN:
            return 1
        if self.num_splits is not None:
            return _pow2_floor(self.num_splits)
        splits = min(MAX_SPLITS, -(-2 * sms // programs), meta.max_seq_len // SPLIT_MIN_SEGMENT)
        splits = _pow2_floor(splits)
        return splits if splits >= 2 else 1

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        num_splits = self.choose_num_splits(meta, kv_cache.shape[3], query.device)
        return kernels.paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            num_tokens=meta.num_tokens,
            num_reqs=meta.num_reqs,
            max_query_len=meta.max_query_len,
            scale=scale,
            num_splits=num_splits,
            block_m=self.block_m,
            block_n=self.block_n,
            sliding_window=options.sliding_window,
            logit_softcap=options.logit_softcap,
            sinks=options.sinks,
        )
