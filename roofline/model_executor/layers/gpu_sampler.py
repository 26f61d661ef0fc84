"""GpuSampler: the Sampler of sampler.py (same interface, same semantics, same tokens) without host
syncs inside per-request loops.

What Sampler does per step on a GPU, and what this one does instead:

  * penalties: one torch.tensor(...) upload and, for presence/frequency, a tensor.unique() (a device
    sync: its output size is data-dependent) per penalised request.
    -> the (row, token[, count]) pairs of every request are built on the host with numpy (np.unique)
       and applied with one gather/where/index_put per penalty kind for the whole batch.
  * stop-token suppression until min_tokens: one indexed write per request.
    -> one index_put for all (row, stop token) pairs.
  * temperature / top-k / top-p / min-p: four small uploads of per-row parameters.
    -> every per-row parameter and index list of the step goes up in ONE host->device copy (an int64
       buffer; float parameters travel as their fp32 bit patterns), built once per step.
  * logprobs: for each request that asked, .item() + two .tolist() (three syncs per request), and a
    log-softmax of every row even when one request asked.
    -> log-softmax of the rows that asked only; chosen-token logprob, rank and top-k for all of them
       in batched ops.
  * the sampled tokens, ranks, top-k ids and logprobs come back in ONE device->host copy (the only
    sync of the step).

Kept exactly as in Sampler (so seeded requests give the same tokens with either sampler): the
per-request torch.Generator and the draw from it (sampler.draw_rows: one uniform per random row,
asynchronous, no sync -- a batched draw would need a counter-based RNG and would change the sampled
streams), the op order, and the arithmetic of every step (temperature
division, sort-based top-k/top-p masks, min-p threshold, penalties).  On CPU the results are
bit-identical to Sampler (tests/model_executor/test_gpu_sampler.py); on CUDA the only possible
difference is that Sampler divides by the repetition penalty as a host scalar, which CUDA turns into a
multiplication by its reciprocal, while this class divides by a tensor (correctly rounded).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from roofline.core.scheduler_output import PositionLogprobs
from roofline.model_executor.layers.sampler import NO_TOKEN, SamplingState, allows_nothing, draw_rows


class _Upload:
    """Collects int and float32 arrays for one host->device copy; floats travel as fp32 bits."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add_int(self, values) -> slice:
        arr = np.asarray(values, dtype=np.int64).reshape(-1)
        sl = slice(self.size, self.size + arr.size)
        self.parts.append(arr)
        self.size += arr.size
        return sl

    def add_float(self, values) -> slice:
        bits = np.asarray(values, dtype=np.float32).reshape(-1).view(np.int32).astype(np.int64)
        return self.add_int(bits)

    def ship(self, device: torch.device) -> torch.Tensor:
        host = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(host).to(device, non_blocking=True)


def _floats(buf: torch.Tensor, sl: slice) -> torch.Tensor:
    return buf[sl].to(torch.int32).view(torch.float32)


class _Download:
    """Collects device int tensors and fp32 tensors for one device->host copy (one sync)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def _add(self, t: torch.Tensor) -> slice:
        t = t.reshape(-1)
        sl = slice(self.size, self.size + t.numel())
        self.parts.append(t)
        self.size += t.numel()
        return sl

    def add_int(self, t: torch.Tensor) -> slice:
        return self._add(t.to(torch.int64))

    def add_float(self, t: torch.Tensor) -> slice:
        return self._add(t.to(torch.float32).view(torch.int32).to(torch.int64))

    def fetch(self) -> np.ndarray:
        if not self.parts:
            return np.zeros(0, dtype=np.int64)
        return torch.cat(self.parts).cpu().numpy()


def _host_floats(host: np.ndarray, sl: slice) -> np.ndarray:
    return host[sl].astype(np.int32).view(np.float32)


def _batched_top_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int], down: _Download
) -> tuple[slice, slice, slice, slice, int]:
    """Device side of PositionLogprobs for rows of logprobs [L x V] with chosen tokens [L]:
    chosen logprob, its 1-based rank (1 + number of strictly larger logprobs) and the top-max(k)."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    kmax = min(max(ks, default=0), logprobs.shape[-1])
    s_chosen, s_rank = down.add_float(chosen), down.add_int(ranks)
    if kmax > 0:
        top = logprobs.topk(kmax, dim=-1)
        s_ids, s_vals = down.add_int(top.indices), down.add_float(top.values)
    else:
        s_ids = s_vals = slice(0, 0)
    return s_chosen, s_rank, s_ids, s_vals, kmax


def _assemble(host, token_list, ks, slices) -> list[PositionLogprobs]:
    s_chosen, s_rank, s_ids, s_vals, kmax = slices
    chosen = _host_floats(host, s_chosen).tolist()
    ranks = host[s_rank].tolist()
    ids = host[s_ids].reshape(-1, kmax).tolist() if kmax else None
    vals = _host_floats(host, s_vals).reshape(-1, kmax).tolist() if kmax else None
    out = []
    for j, (tok, k) in enumerate(zip(token_list, ks)):
        if k > 0:
            out.append(PositionLogprobs(token_ids=[tok] + ids[j][:k], logprobs=[chosen[j]] + vals[j][:k],
                                        ranks=[ranks[j]] + list(range(1, k + 1))))
        else:
            out.append(PositionLogprobs(token_ids=[tok], logprobs=[chosen[j]], ranks=[ranks[j]]))
    return out


class GpuSampler:
    """Drop-in for Sampler: __call__(logits [B x V], states) -> (tokens, logprobs per row or None)."""

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[Optional[PositionLogprobs]]]:
        num_rows = len(states)
        if num_rows == 0:
            return [], []
        device = logits.device
        logits = logits.float()
        vocab = logits.shape[-1]
        specs = [st.spec for st in states]

        # ---- host: every per-row parameter and index list of the step, one upload -----------
        up = _Upload()
        lp_rows = [i for i, s in enumerate(specs) if s.logprobs is not None]
        random_rows = [i for i, st in enumerate(states) if not st.greedy]
        s_lp_rows = up.add_int(lp_rows)
        s_random = up.add_int(random_rows)

        rep_r, rep_c, rep_v = [], [], []
        fp_r, fp_c, fp_n, fp_f, fp_p = [], [], [], [], []
        stop_r, stop_c = [], []
        for i, st in enumerate(states):
            s = st.spec
            if st.has_penalties:
                if s.repetition_penalty != 1.0:
                    seen = np.unique(np.asarray(st.prompt_token_ids + st.output_token_ids, dtype=np.int64))
                    rep_r.append(np.full(seen.size, i, dtype=np.int64))
                    rep_c.append(seen)
                    rep_v.append(np.full(seen.size, s.repetition_penalty, dtype=np.float32))
                if st.output_token_ids and (s.presence_penalty or s.frequency_penalty):
                    ids, counts = np.unique(np.asarray(st.output_token_ids, dtype=np.int64), return_counts=True)
                    fp_r.append(np.full(ids.size, i, dtype=np.int64))
                    fp_c.append(ids)
                    fp_n.append(counts.astype(np.float32))
                    fp_f.append(np.full(ids.size, s.frequency_penalty, dtype=np.float32))
                    fp_p.append(np.full(ids.size, s.presence_penalty, dtype=np.float32))
            if s.stop_token_ids and len(st.output_token_ids) < s.min_tokens:
                stop_r.append(np.full(len(s.stop_token_ids), i, dtype=np.int64))
                stop_c.append(np.asarray(s.stop_token_ids, dtype=np.int64))
        cat = np.concatenate
        modify = any(st.has_penalties for st in states) or any(s.min_tokens for s in specs)
        if rep_r:
            s_rep = (up.add_int(cat(rep_r)), up.add_int(cat(rep_c)), up.add_float(cat(rep_v)))
        if fp_r:
            s_fp = (up.add_int(cat(fp_r)), up.add_int(cat(fp_c)), up.add_float(cat(fp_n)),
                    up.add_float(cat(fp_f)), up.add_float(cat(fp_p)))
        if stop_r:
            s_stop = (up.add_int(cat(stop_r)), up.add_int(cat(stop_c)))

        if random_rows:
            rspecs = [specs[i] for i in random_rows]
            do_top_k = any(0 < s.top_k < vocab for s in rspecs)
            do_top_p = any(s.top_p < 1.0 for s in rspecs)
            do_min_p = any(s.min_p > 0.0 for s in rspecs)
            s_temp = up.add_float([s.temperature for s in rspecs])
            s_top_k = up.add_int([s.top_k if 0 < s.top_k < vocab else vocab for s in rspecs]) if do_top_k else None
            s_top_p = up.add_float([s.top_p for s in rspecs]) if do_top_p else None
            s_min_p = up.add_float([s.min_p for s in rspecs]) if do_min_p else None
        buf = up.ship(device)

        # ---- device: the same computation as Sampler, batched --------------------------------
        raw_logprobs = None
        if lp_rows:
            raw = logits if len(lp_rows) == num_rows else logits[buf[s_lp_rows]]
            raw_logprobs = raw.log_softmax(dim=-1)
        if modify:
            logits = logits.clone()
            if rep_r:
                rows, cols, pen = buf[s_rep[0]], buf[s_rep[1]], _floats(buf, s_rep[2])
                vals = logits[rows, cols]
                logits[rows, cols] = torch.where(vals > 0, vals / pen, vals * pen)
            if fp_r:
                rows, cols = buf[s_fp[0]], buf[s_fp[1]]
                counts, freq, pres = _floats(buf, s_fp[2]), _floats(buf, s_fp[3]), _floats(buf, s_fp[4])
                logits[rows, cols] = logits[rows, cols] - (freq * counts + pres)
            if stop_r:
                logits[buf[s_stop[0]], buf[s_stop[1]]] = float("-inf")
        tokens = logits.argmax(dim=-1)
        nothing = allows_nothing(logits, tokens)
        if random_rows:
            rows = buf[s_random]
            x = logits[rows] / _floats(buf, s_temp)[:, None]
            if do_top_k or do_top_p:
                sorted_logits, idx = x.sort(dim=-1, descending=True)
                mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
                if do_top_k:
                    mask |= torch.arange(vocab, device=device)[None, :] >= buf[s_top_k][:, None]
                if do_top_p:
                    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
                    before = probs.cumsum(dim=-1) - probs
                    mask |= before >= _floats(buf, s_top_p)[:, None]
                sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
                x = torch.empty_like(x).scatter_(-1, idx, sorted_logits)
            if do_min_p:
                probs = x.softmax(dim=-1)
                threshold = probs.max(dim=-1, keepdim=True).values * _floats(buf, s_min_p)[:, None]
                x = x.masked_fill(probs < threshold, float("-inf"))
            probs = x.softmax(dim=-1)
            tokens[rows] = draw_rows(probs, [states[i].generator for i in random_rows])  # async, no sync
        tokens = tokens.masked_fill(nothing, NO_TOKEN)

        # ---- one device->host copy -------------------------------------------------------------
        down = _Download()
        s_tokens = down.add_int(tokens)
        lp_ks = [specs[i].logprobs for i in lp_rows]
        if lp_rows:
            lp_slices = _batched_top_logprobs(raw_logprobs, tokens[buf[s_lp_rows]].clamp(min=0), lp_ks, down)
        host = down.fetch()
        token_list = host[s_tokens].tolist()
        lps: list[Optional[PositionLogprobs]] = [None] * num_rows
        if lp_rows:
            for i, plp in zip(lp_rows, _assemble(host, [token_list[i] for i in lp_rows], lp_ks, lp_slices)):
                lps[i] = plp if token_list[i] != NO_TOKEN else None
        return token_list, lps


def prompt_logprobs_rows(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[PositionLogprobs]:
    """sampler.prompt_logprobs_rows, batched: logprobs of the actual next prompt tokens (and top-k) at
    consecutive prompt positions, with one upload and one download."""
    if not next_tokens:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    toks = torch.from_numpy(np.asarray(next_tokens, dtype=np.int64)).to(logits.device, non_blocking=True)
    down = _Download()
    ks = [k] * len(next_tokens)
    slices = _batched_top_logprobs(logprobs[: len(next_tokens)], toks, ks, down)
    return _assemble(down.fetch(), list(next_tokens), ks, slices)
