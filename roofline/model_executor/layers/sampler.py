"""Sampler: logits [B x V] -> one token per row, plus logprobs when asked.

Order per row: penalties (repetition on prompt+output, presence/frequency on output), stop-token
suppression until min_tokens, then greedy argmax or temperature -> top-k -> top-p -> min-p ->
a draw from the row's own generator (so a seeded request gets the same tokens whatever else shares
its batch).  Logprobs are those of the raw model distribution (log-softmax of unmodified logits).
The draw (`draw_rows`) inverts each row's CDF at one float64 uniform from the row's generator: exactly a
draw from p, for the price of a cumulative sum (a row's V exponentials, the Gumbel-style argmax(p / E)
this replaced, cost ~2 ms per row on the CPU: a third of a 32-row decode step of the default model).
A row that allows no token (every logit -inf after the grammar mask and stop-token suppression, or a NaN
best logit) gets NO_TOKEN instead of an arbitrary id: the model runner fails that request alone, and no
id outside [0, V) ever leaves a sampler (the same rule in gpu_sampler.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from roofline.core.scheduler_output import PositionLogprobs, SamplingSpec
from roofline.cpu import ops as cpu_ops


NO_TOKEN = -1  # a row with no allowed token (see allows_nothing); never fed to the model


def allows_nothing(adjusted: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """bool [R]: the rows of adjusted [R x V] (argmax [R] their argmax) whose best logit is -inf (every
    token masked) or NaN.  One gather and a compare, no host sync."""
    return ~(adjusted.gather(1, argmax[:, None]).squeeze(1) > float("-inf"))


@dataclass
class SamplingState:
    spec: SamplingSpec
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.spec.temperature < 1e-5

    @property
    def plain_greedy(self) -> bool:
        """Only the argmax of the raw logits is needed: greedy, no logprobs, penalties, grammar or
        stop-token suppression (the LM head may then skip the full logits: greedy_head.py)."""
        s = self.spec
        return (self.greedy and s.logprobs is None and not self.has_penalties and not s.structured
                and not (s.stop_token_ids and len(self.output_token_ids) < s.min_tokens))

    @property
    def has_penalties(self) -> bool:
        s = self.spec
        return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Each row's repetition penalty (on its prompt's and output's tokens), then its frequency and presence
    penalties (on its output's tokens), in place: one gather and scatter for the whole batch, the same
    fp32 operations per element as a row at a time."""
    rep_rows: list[int] = []
    rep_ids: list[int] = []
    rep_pen: list[float] = []
    cnt_rows: list[int] = []
    cnt_ids: list[int] = []
    cnt_n: list[int] = []
    freq: list[float] = []
    pres: list[float] = []
    for i, st in enumerate(states):
        if not st.has_penalties:
            continue
        s = st.spec
        if s.repetition_penalty != 1.0:
            seen = set(st.prompt_token_ids)
            seen.update(st.output_token_ids)
            rep_rows += [i] * len(seen)
            rep_ids += seen
            rep_pen += [s.repetition_penalty] * len(seen)
        if st.output_token_ids and (s.presence_penalty or s.frequency_penalty):
            counts = Counter(st.output_token_ids)
            cnt_rows += [i] * len(counts)
            cnt_ids += counts.keys()
            cnt_n += counts.values()
            freq += [s.frequency_penalty] * len(counts)
            pres += [s.presence_penalty] * len(counts)
    dev, dt = logits.device, logits.dtype
    if rep_rows:
        at = (torch.tensor(rep_rows, device=dev), torch.tensor(rep_ids, device=dev))
        vals, pen = logits[at], torch.tensor(rep_pen, device=dev, dtype=dt)
        logits[at] = torch.where(vals > 0, vals / pen, vals * pen)
    if cnt_rows:
        at = (torch.tensor(cnt_rows, device=dev), torch.tensor(cnt_ids, device=dev))
        n = torch.tensor(cnt_n, device=dev, dtype=dt)
        logits[at] -= torch.tensor(freq, device=dev, dtype=dt) * n + torch.tensor(pres, device=dev, dtype=dt)


def _suppress_stop_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """-inf on the stop tokens of each row that has not reached its min_tokens (one scatter for the batch)."""
    rows: list[int] = []
    ids: list[int] = []
    for i, st in enumerate(states):
        if st.spec.stop_token_ids and len(st.output_token_ids) < st.spec.min_tokens:
            rows += [i] * len(st.spec.stop_token_ids)
            ids += st.spec.stop_token_ids
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)] = float("-inf")


def _filter(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on rows that sample randomly. logits [R x V]."""
    device = logits.device
    temp = torch.tensor([s.temperature for s in specs], device=device, dtype=logits.dtype)
    logits = logits / temp[:, None]
    top_k = [s.top_k for s in specs]
    top_p = [s.top_p for s in specs]
    min_p = [s.min_p for s in specs]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if any(0 < k < vocab for k in top_k):
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
            mask |= torch.arange(vocab, device=device)[None, :] >= k[:, None]
        if any(p < 1.0 for p in top_p):
            probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
            p = torch.tensor(top_p, device=device, dtype=probs.dtype)
            mask |= before >= p[:, None]  # keep the smallest prefix reaching p (at least one token)
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        m = torch.tensor(min_p, device=device, dtype=probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * m[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: logits.argmax(-1), by the native CPU kernel where it applies (torch's CPU argmax
    runs on one thread: ~1.5 ms for 64 rows of a 49k vocabulary, where the kernel takes ~0.2)."""
    if logits.device.type == "cpu":
        tokens = cpu_ops.argmax_rows(logits)
        if tokens is not None:
            return tokens
    return logits.argmax(dim=-1)


def _top_logprobs(logprobs_row: torch.Tensor, token: int, k: int) -> PositionLogprobs:
    lp = logprobs_row[token]
    rank = int((logprobs_row > lp).sum().item()) + 1
    ids, lps, ranks = [token], [float(lp)], [rank]
    if k > 0:
        top = logprobs_row.topk(k)
        ids += top.indices.tolist()
        lps += top.values.tolist()
        ranks += list(range(1, k + 1))
    return PositionLogprobs(token_ids=ids, logprobs=lps, ranks=ranks)


def adjusted_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """logits (fp32) with each row's penalties and min_tokens stop-token suppression applied: the
    greedy rows' argmax and, through sampling_probs, the random rows' distribution."""
    logits = logits.float()
    if any(st.has_penalties for st in states) or any(st.spec.min_tokens for st in states):
        logits = logits.clone()
        _apply_penalties(logits, states)
        _suppress_stop_tokens(logits, states)
    return logits


def sampling_probs(adjusted: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """The distribution a random row samples from: temperature, top-k, top-p, min-p, softmax. [R x V]"""
    return _filter(adjusted, specs).softmax(dim=-1)


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [R x V] (each row a distribution, zeros allowed, any positive sum),
    row i drawn by generators[i] with one float64 uniform u: the first token whose cumulative sum (in
    float64) exceeds u times the row's sum, so a token of zero probability is never drawn. [R] long"""
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    cdf = probs.double().cumsum(dim=-1)
    # u < 1, so u * sum < sum exactly (a float64 product with a factor below 1 never rounds up to the
    # other factor): some token's cumulative sum exceeds it, and the first one has nonzero probability.
    # A row without a positive finite sum (nothing allowed, NaN) would search past the end: clamped into
    # the vocabulary here, and the samplers mark such a row NO_TOKEN anyway.
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return drawn.clamp_(max=probs.shape[-1] - 1)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[Optional[PositionLogprobs]]]:
        logits = logits.float()
        want_lp = [st.spec.logprobs is not None for st in states]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_lp) else None
        logits = adjusted_logits(logits, states)
        tokens = _argmax(logits)
        nothing = allows_nothing(logits, tokens)
        random_rows = [i for i, st in enumerate(states) if not st.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = sampling_probs(logits[rows], [states[i].spec for i in random_rows])
            tokens[rows] = draw_rows(probs, [states[i].generator for i in random_rows])
        token_list = tokens.masked_fill_(nothing, NO_TOKEN).tolist()
        lps: list[Optional[PositionLogprobs]] = [None] * len(states)
        if raw_logprobs is not None:
            for i, st in enumerate(states):
                if want_lp[i] and token_list[i] != NO_TOKEN:
                    lps[i] = _top_logprobs(raw_logprobs[i], token_list[i], st.spec.logprobs)
        return token_list, lps


def prompt_logprobs_rows(
    logits: torch.Tensor, next_tokens: list[int], k: int
) -> list[PositionLogprobs]:
    """Logprobs of the actual next prompt tokens (and top-k) at consecutive prompt positions."""
    logprobs = logits.float().log_softmax(dim=-1)
    return [_top_logprobs(logprobs[i], t, k) for i, t in enumerate(next_tokens)]
