"""Greedy decoding on the CPU without the full fp32 logits: an int8 screen of the LM head, then the
exact fp32 logit of the few tokens that can still be the maximum.

A greedy row needs argmax_v F_v, F_v = h . W_v as the fp32 route computes it (the packed GEMM for a
batch of 2+ rows, the native GEMV for one: cpu_gemm.linear).  The LM head is the largest projection
(49k x 576 for the default model: ~10% of a W1 run's FLOPs, 113 MB of fp32 per single-stream step).
`GreedyScreen` keeps it a third time, as int8 with a scale per token and block of 32 inputs (the layout
of GGUF's Q8_0: the default model's tied embedding is Q8_0, so its int8 copy is exact), and
cpu_kernels.c `greedy_head_f32` computes, per row:

    h = t hq + dh                 hq int16 (|hq| <= 32767), t = max|h| / 32767, dh what rounding leaves
    W_v = What_v + dw_v           What_vb = s_vb Wq_vb: Wq int8 (|Wq| <= 127), s_vb = max|W_vb| / 127
    A_v = t sum_b s_vb (hq_b . Wq_vb)   exact int32 dot products per block (int16 pairs, vpmaddwd)
    |F_v - A_v| <= |h| (|dw_v| + c |W_v|) + |dh| |What_v| + 1e-5 |A_v| =: B_v

from F_v - h.W_v (the fp32 route's rounding), h.dw_v, dh.What_v (Cauchy-Schwarz for the two) and the
screen's own rounding: c = 2 (K + 64) 2^-24 + 4 (2 nb + 8) 2^-24 covers a K-term fp32 sum's roundings
and the screen's nb block sums, 1e-5 |A_v| the few roundings of A_v and of B_v's own arithmetic (the
per-token terms are stored rounded up by a factor 1 + 1e-5).  A token with A_v + B_v < max_u (A_u - B_u)
is below some F_u, so it is not the argmax; every other token (on the default model: one or two a row)
gets F_v computed exactly as its route does (same products, same order) and the first maximum wins, as
in the sampler's argmax.  The tokens are the full path's, bit for bit, whatever the data (tested against
it, ties included).

What it saves: the screen reads a quarter of the fp32 weight bytes, which is what a few rows cost (one
stream decoding: the LM head 5.3 -> 1.8 ms on the 2-core reference machine); its integer dot products
run no faster than fp32 FMAs there, so batches of more than MAX_ROWS rows keep the fp32 GEMM.  It
applies to rows that sample greedily without logprobs, penalties or min_tokens suppression
(ModelRunner picks them), tp 1, fp32 on the CPU, with the native kernels loaded; elsewhere the logits
are computed as before.  Costs: the int8 copy (V x K bytes) and a
float per token and block.  Switch: --cpu-greedy-head (on by default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from roofline.config import Switch
from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops

logger = logging.getLogger(__name__)

SWITCH = Switch("cpu_greedy_head")

W_MAX = 127  # int8 weights
HQ_MAX = cpu_ops.GREEDY_HQ_MAX  # int16 hidden states (a block's int32 sum stays far from overflow)
BLOCK = 32  # inputs per weight scale (GQ_BLOCK)
PANEL = cpu_ops.PANEL  # tokens per panel (GEMM_NR)
ROUNDING_SLACK = 1 + 1e-5  # per-token bound terms are stored rounded up by this factor
_CHUNK = 4096  # tokens quantized at a time (bounds the float64 scratch)
# Batches up to this many rows take the screen.  Its integer dot products run at about the fp32 FMA rate
# on the AVX2 machines measured (Zen 3: the LM head of the default model at 64 rows 33 vs 31 ms, 32 rows
# 16.5 vs 16.1), so it pays where the LM head streams its weight from memory rather than computes:
# 1 row 5.3 -> 1.8 ms, 12 rows 8.6 -> 6.2 ms (2 threads).
MAX_ROWS = 16


def gemv_runs(k: int, nthreads: int) -> int:
    """cpu_kernels.c gemv_runs: how many runs of weight rows the single-row GEMV sums separately."""
    return max(1, min(k // 16, nthreads))


@dataclass
class GreedyScreen:
    """The int8 copy of an LM head weight [V, K] and the per-token terms of the bound (module doc)."""

    vocab: int  # V: tokens screened (the LM head's first V rows)
    k: int  # K: hidden size
    panels: torch.Tensor  # int8 [ceil(V/16), ceil(K/2), 2, 8, 2]: panel, input pair, token half, token, input
    scales: torch.Tensor  # fp32 [ceil(V/16), ceil(K/32), 16]: s_vb per panel, block, token
    bound_w: torch.Tensor  # fp32 [V]: (|dw_v| + c |W_v|) rounded up
    bound_q: torch.Tensor  # fp32 [V]: |What_v| rounded up
    wnorm_max: float  # max_v |W_v|: rows whose |h| max|W_v| could overflow fp32 go the full path

    @staticmethod
    def build(weight: torch.Tensor, vocab: Optional[int] = None) -> Optional["GreedyScreen"]:
        """The screen of weight [V', K] (any strides, fp32, V' >= vocab), or None when it cannot be used:
        native kernels off, not fp32, or a non-finite weight."""
        if not cpu_ops.available() or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        vocab = weight.shape[0] if vocab is None else vocab
        k = weight.shape[1]
        kp, nb, npan = (k + 1) // 2, -(-k // BLOCK), -(-vocab // PANEL)
        c = (2 * (k + 64) + 4 * (2 * nb + 8)) * 2.0**-24
        q8 = torch.zeros((npan * PANEL, 2 * kp), dtype=torch.int8)
        scales = torch.zeros((npan * PANEL, nb), dtype=torch.float32)
        bound_w = torch.empty(vocab, dtype=torch.float32)
        bound_q = torch.empty(vocab, dtype=torch.float32)
        wnorm_max = 0.0
        with torch.no_grad():
            for v0 in range(0, vocab, _CHUNK):
                w = weight[v0 : min(v0 + _CHUNK, vocab)].double()
                n = w.shape[0]
                if not torch.isfinite(w).all():
                    return None
                blocks = torch.nn.functional.pad(w, (0, nb * BLOCK - k)).view(n, nb, BLOCK)
                s = (blocks.abs().amax(dim=2) / W_MAX).float()  # the scales as the kernel reads them
                sd = s.double()[:, :, None]
                q = torch.where(sd > 0, torch.round(blocks / torch.where(sd > 0, sd, 1.0)), 0.0).clamp_(-W_MAX, W_MAX)
                w_hat = (sd * q).view(n, nb * BLOCK)[:, :k]
                wn = w.norm(dim=1)
                scales[v0 : v0 + n] = s
                bound_w[v0 : v0 + n] = ((w - w_hat).norm(dim=1) + c * wn) * ROUNDING_SLACK
                bound_q[v0 : v0 + n] = w_hat.norm(dim=1) * ROUNDING_SLACK
                q8[v0 : v0 + n, :k] = q.view(n, nb * BLOCK)[:, :k].to(torch.int8)
                wnorm_max = max(wnorm_max, float(wn.max()) * ROUNDING_SLACK)
        # [token, input] -> [panel, input pair, half, token in half, input in pair]: per pair, the 32 bytes
        # of a panel are tokens 0-7 then 8-15, each token's two inputs side by side (vpmaddwd pairs)
        panels = q8.view(npan, 2, 8, kp, 2).permute(0, 3, 1, 2, 4).contiguous()
        scales = scales.view(npan, PANEL, nb).permute(0, 2, 1).contiguous()
        return GreedyScreen(vocab, k, panels, scales, bound_w, bound_q, wnorm_max)

    @staticmethod
    def cached(weight: torch.Tensor, vocab: Optional[int] = None) -> Optional["GreedyScreen"]:
        """build(), through an on-disk cache (config.cache_dir()/greedy-head-<key>.safetensors) keyed by
        the weight's bytes (xxh3-128), shape, vocab and SCREEN_FORMAT: a restart of the same model reads its
        screen (tens of ms) instead of building it (0.5-1 s for the default model).  A cache that cannot
        be read or written is ignored (the screen is built)."""
        if not cpu_ops.available() or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        vocab = weight.shape[0] if vocab is None else vocab
        path = _cache_path(weight, vocab) if weight.numel() * 4 >= CACHE_MIN_BYTES else None
        if path is not None and path.exists():
            try:
                return _load(path, vocab, weight.shape[1])
            except Exception:  # a damaged entry: rebuild and overwrite it
                logger.warning("greedy head cache %s unreadable; rebuilding it", path, exc_info=True)
        screen = GreedyScreen.build(weight, vocab)
        if screen is not None and path is not None:
            _save(screen, path)
        return screen

    def tokens(self, hidden: torch.Tensor, fp32_panels: Optional[torch.Tensor], dense: torch.Tensor,
               route_runs: int, candidates: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """argmax over the first `vocab` logits of hidden [R, K] as the fp32 route computes them: the
        packed GEMM (route_runs 0, over fp32_panels) or the GEMV with route_runs runs (over dense, the
        weight [V', K] stored [in x out]-major).  None when a row is not finite or could overflow (the
        caller computes the logits).  candidates: int64 [R], filled with how many tokens were rescored."""
        r = hidden.shape[0]
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        approx = torch.empty((r, self.vocab), dtype=torch.float32)
        out = torch.empty(r, dtype=torch.int64)
        bad = cpu_ops.greedy_head(hidden, self, fp32_panels, dense, route_runs, approx, out, candidates)
        return None if bad else out


CACHE_MIN_BYTES = 8 << 20  # smaller LM heads build in milliseconds: not worth a cache entry
SCREEN_FORMAT = 1  # bump when build() or the panel layout changes: older cache entries are then never read


def _cache_path(weight: torch.Tensor, vocab: int):
    import xxhash

    from roofline.config import cache_dir

    # the weight's memory as it lies ([out x in] or, as cpu_prepare.relayout leaves an LM head, [in x out])
    memory = next((t for t in (weight, weight.t()) if t.is_contiguous()), None)
    if memory is None:
        return None  # hashing a strided view would need a copy: build instead
    digest = xxhash.xxh3_128_hexdigest(memoryview(memory.numpy()).cast("B"))
    return cache_dir() / f"greedy-head-{SCREEN_FORMAT}-{vocab}x{weight.shape[1]}-{digest}.safetensors"


def _load(path, vocab: int, k: int) -> GreedyScreen:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta, t = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    if int(meta["vocab"]) != vocab or int(meta["k"]) != k:
        raise ValueError(f"cache entry for {meta['vocab']}x{meta['k']}, wanted {vocab}x{k}")
    return GreedyScreen(vocab, k, t["panels"], t["scales"], t["bound_w"], t["bound_q"], float(meta["wnorm_max"]))


def _save(screen: GreedyScreen, path) -> None:
    from safetensors.torch import save_file

    from roofline.config import write_cache_file

    tensors = {"panels": screen.panels, "scales": screen.scales, "bound_w": screen.bound_w, "bound_q": screen.bound_q}
    meta = {"vocab": str(screen.vocab), "k": str(screen.k), "wnorm_max": repr(screen.wnorm_max)}
    if not write_cache_file(path, lambda tmp: save_file(tensors, tmp, metadata=meta)):
        logger.warning("could not write the greedy head cache %s", path)


def route_runs_for(rows: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor]) -> Optional[int]:
    """Which fp32 route cpu_gemm.linear takes for these rows over this weight, as GreedyScreen.tokens
    names it (0: packed GEMM; T > 0: the GEMV's runs), or None when it is one the screen cannot mirror."""
    if cpu_gemm.use_packed(rows):
        return 0 if packed is not None else None
    if cpu_ops.can_gemv(rows, weight):
        return gemv_runs(rows.shape[1], torch.get_num_threads())
    return None
