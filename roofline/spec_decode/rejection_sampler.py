"""RejectionSampler: keep the drafts the target model would have produced, exactly in distribution.

For one request with drafts d_0 .. d_{k-1}, the target's logits rows L_0 .. L_k (row j computed with
d_0 .. d_{j-1} in the context) and q_j the distribution d_j was drawn from (one-hot for deterministic
drafts such as prompt lookup or a greedy draft model):

    p_j   = the target's sampling distribution at row j: the request's penalties (over prompt, output
            and d_0 .. d_{j-1}), min_tokens suppression, temperature, top-k, top-p, min-p
    greedy:  accept d_j while d_j == argmax p_j; at the first mismatch emit argmax p_j instead; when
             all are accepted emit the bonus argmax p_k
    random:  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
             draw from max(p_j - q_j, 0) normalized (the recovered token); when all are accepted emit
             a draw from p_k (the bonus token)

Each emitted token is then distributed exactly as p of its row (Leviathan et al. 2023, Chen et al.
2023), so the output is the target's, sampling parameters included.  Per request and step the
uniforms come first (k of them) and then the emitted token's draw (sampler.draw_rows, as in the
Sampler), all from the request's own generator: a seeded request is reproducible.  Logprobs are the
target model's raw log-softmax at each emitted token's row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from roofline.core.scheduler_output import PositionLogprobs
from roofline.model_executor.layers.sampler import (
    SamplingState,
    _argmax,
    _top_logprobs,
    adjusted_logits,
    draw_rows,
    sampling_probs,
)


def position_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """The request's sampling state at each of its 1 + k rows: row j has drafts[:j] in its output."""
    return [state] + [replace(state, output_token_ids=state.output_token_ids + drafts[:j])
                      for j in range(1, len(drafts) + 1)]


def accepted_prefix(drafts: list[int], accept: list[bool]) -> int:
    a = 0
    while a < len(drafts) and accept[a]:
        a += 1
    return a


def greedy_accept(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """Greedy verification: drafts while they equal the target's argmax, then the target's token at
    the first mismatch (or the bonus token after the last draft).  target_tokens: k + 1 argmaxes."""
    a = accepted_prefix(drafts, [x == y for x, y in zip(drafts, target_tokens)])
    return drafts[:a] + [target_tokens[a]]


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        drafts: list[list[int]],
        draft_probs: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> tuple[list[list[int]], list[Optional[list[PositionLogprobs]]]]:
        """logits [sum_r (k_r + 1) x V]: request r's rows in order.  Returns per request the emitted
        tokens (accepted drafts, then the target's token) and, when asked, their logprobs."""
        row_states: list[SamplingState] = []
        for st, d in zip(states, drafts):
            row_states += position_states(st, d)
        logits = logits.float()
        adjusted = adjusted_logits(logits, row_states)
        target_argmax = _argmax(adjusted).tolist()
        random_reqs = [i for i, st in enumerate(states) if not st.greedy]
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        emitted: list[list[int]] = []
        random_tokens = self._random_rows(adjusted, states, drafts, draft_probs, starts, random_reqs, row_states)
        for i, d in enumerate(drafts):
            if i in random_tokens:
                emitted.append(random_tokens[i])
                continue
            emitted.append(greedy_accept(d, target_argmax[starts[i] : starts[i + 1]]))
        lps: list[Optional[list[PositionLogprobs]]] = [None] * len(states)
        want = [i for i, st in enumerate(states) if st.spec.logprobs is not None]
        if want:
            raw = logits.log_softmax(dim=-1)
            for i in want:
                lps[i] = [_top_logprobs(raw[starts[i] + j], tok, states[i].spec.logprobs)
                          for j, tok in enumerate(emitted[i])]
        return emitted, lps

    def _random_rows(self, adjusted, states, drafts, draft_probs, starts, random_reqs, row_states):
        """Emitted tokens of the randomly sampling requests: request index -> tokens.  Batched over the
        requests: each request's k uniforms are drawn from its generator in request order, then the
        acceptance tests, the recovered or bonus rows and one draw per request (draw_rows, again in request
        order), so a request's own generator gives its uniforms first and then its draw, as one at a time."""
        if not random_reqs:
            return {}
        rows = [r for i in random_reqs for r in range(starts[i], starts[i + 1])]
        dev = adjusted.device
        p = sampling_probs(adjusted[torch.tensor(rows, device=dev)], [row_states[r].spec for r in rows])
        n = len(random_reqs)
        ks = [len(drafts[i]) for i in random_reqs]
        firsts = [0]  # request j's first row in p
        for k in ks:
            firsts.append(firsts[-1] + k + 1)
        qs = [draft_probs[i] if draft_probs is not None else None for i in random_reqs]
        accepted = [0] * n
        if sum(ks):
            us = [torch.rand(k, generator=states[i].generator, device=dev, dtype=p.dtype)
                  for i, k in zip(random_reqs, ks) if k]
            draft_rows = torch.tensor([firsts[j] + t for j, k in enumerate(ks) for t in range(k)], device=dev)
            tokens = torch.tensor([d for i in random_reqs for d in drafts[i]], device=dev)
            p_d = p[draft_rows, tokens]
            q_d = []  # each draft token's probability under the draft model (1 for a one-hot proposal)
            for i, q in zip(random_reqs, qs):
                if not drafts[i]:
                    continue
                idx = torch.tensor(drafts[i], device=dev)
                q_d.append(q[: len(idx)].to(p.dtype).gather(1, idx[:, None])[:, 0] if q is not None
                           else torch.ones(len(idx), dtype=p.dtype, device=dev))
            q_d = torch.cat(q_d)
            accept = (torch.cat(us) * q_d < p_d).tolist()
            off = 0
            for j, k in enumerate(ks):
                accepted[j] = accepted_prefix(drafts[random_reqs[j]], accept[off : off + k])
                off += k
        # the row each request draws its last token from: p at the first rejection less q there, clamped at 0
        # (a one-hot q: p without the rejected draft), or p after the last draft (the bonus token)
        emit_rows = torch.tensor([firsts[j] + a for j, a in enumerate(accepted)], device=dev)
        emit = p[emit_rows].clone()
        rejected = [j for j in range(n) if accepted[j] < ks[j]]
        with_q = [j for j in rejected if qs[j] is not None]
        if with_q:
            q_rows = torch.stack([qs[j][accepted[j]] for j in with_q]).to(p.dtype)
            idx = torch.tensor(with_q, device=dev)
            emit[idx] = (emit[idx] - q_rows).clamp_min(0.0)
        one_hot = [j for j in rejected if qs[j] is None]
        if one_hot:
            emit[torch.tensor(one_hot, device=dev),
                 torch.tensor([drafts[random_reqs[j]][accepted[j]] for j in one_hot], device=dev)] = 0.0
        if rejected:
            idx = torch.tensor(rejected, device=dev)
            empty = ~(emit[idx].sum(dim=-1) > 0)  # rounding only: p_a and q_a differ by less than float eps
            if bool(empty.any()):
                back = idx[empty]
                emit[back] = p[emit_rows[back]]
        last = draw_rows(emit, [states[i].generator for i in random_reqs]).tolist()
        return {i: drafts[i][: accepted[j]] + [last[j]] for j, i in enumerate(random_reqs)}
