"""DraftModelProposer: a smaller model with the target's vocabulary proposes k tokens by decoding k
steps of its own, on the same workers (split like the target under tensor parallelism).

Its KV cache is a pool of its own with the target's block geometry: block i of the draft pool holds the
draft's K/V for the same tokens as block i of the target pool, so the scheduler's block tables,
prefix-cache hits, copy-on-write copies and swaps serve both (the runner moves the draft's blocks with
the target's).  Per step, after the target has sampled:

  1. catch-up: the draft runs the step's flat batch (same tokens, positions, slots) for its K/V;
     rows past the accepted drafts hold rejected tokens and are rewritten the next step
  2. k decode steps from each sampled request's new last token at position P: the draft's K/V for
     P .. P + k - 1 goes into the lookahead slots the scheduler allocated past the step's tokens

Greedy requests take the draft's argmax (q one-hot); random ones draw from the draft's distribution
with the request's sampling parameters and generator, and q's rows go to the rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from roofline.core.scheduler_output import ScheduledRequest
from roofline.model_executor.layers.sampler import adjusted_logits, draw_rows, sampling_probs
from roofline.spec_decode.proposer import ModelBasedProposer, ProposalBatch, Proposals, TargetForward
from roofline.spec_decode.rejection_sampler import position_states


@dataclass
class TargetStep:
    """What a model-based proposer sees of the step the target just ran."""

    next_position: dict[str, int]  # sampled request -> position of its newest token (K/V not yet written)
    block_ids: dict[str, list[int]]  # sampled request -> block table (lookahead slots included)
    states: dict[str, Any]  # sampled request -> SamplingState (output includes the newest tokens)
    prepare: Callable  # ModelRunner._prepare: ScheduledRequests -> (input_ids, positions, meta)


class DraftModelProposer(ModelBasedProposer):

    @torch.inference_mode()
    def follow_target(self, forward: TargetForward) -> None:
        """1. catch-up: the draft's K/V for the step's tokens (one output row, unused)."""
        ids = forward.input_ids
        self.model(ids, forward.positions, self.kv_caches, forward.meta,
                   torch.tensor([ids.shape[0] - 1], device=ids.device))

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> Proposals:
        t: TargetStep = batch.target
        k = batch.k
        started = self.start(batch)
        if started is None:
            return Proposals([[] for _ in batch.req_ids])
        fit, rids, states, drafts, probs = started
        tokens = [batch.token_ids[i][-1] for i in fit]
        for step in range(k):  # 2. k decode steps
            items = [ScheduledRequest(r, t.next_position[r] + step, [tok], t.block_ids[r], True)
                     for r, tok in zip(rids, tokens)]
            input_ids, positions, meta = t.prepare(items)
            logits = self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))
            tokens = draw_drafts(logits, states, drafts, probs)
        return gather_proposals(len(batch.req_ids), fit, drafts, probs)


def draw_drafts(logits: torch.Tensor, states: list, drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> list[int]:
    """One draft token per request from a proposer model's logits [R, V]: the argmax for greedy requests,
    else a draw from the distribution the request's sampling parameters make of them (its generator),
    whose row q goes to probs for the rejection sampler.  Appends to drafts / probs; returns the tokens."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, st in enumerate(states) if not st.greedy]
    if random_rows:
        row_states = [position_states(states[i], drafts[i])[-1] for i in random_rows]
        sel = torch.tensor(random_rows, device=logits.device)
        q = sampling_probs(adjusted_logits(logits[sel], row_states), [s.spec for s in row_states])
        drawn = draw_rows(q, [s.generator for s in row_states]).tolist()
        for j, i in enumerate(random_rows):
            tokens[i] = drawn[j]
            probs[i].append(q[j])
    for i, tok in enumerate(tokens):
        drafts[i].append(tok)
    return tokens


def gather_proposals(num_requests: int, fit: list[int], drafts: list[list[int]],
                     probs: list[list[torch.Tensor]]) -> Proposals:
    """Proposals for every request of the batch from those of the requests `fit` (the rest: none)."""
    out_drafts: list[list[int]] = [[] for _ in range(num_requests)]
    out_probs: list = [None] * num_requests
    for j, i in enumerate(fit):
        out_drafts[i] = drafts[j]
        out_probs[i] = torch.stack(probs[j]) if probs[j] else None
    return Proposals(out_drafts, out_probs if any(q is not None for q in out_probs) else None)
