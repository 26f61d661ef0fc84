"""MTPProposer: DeepSeek-V3's multi-token prediction module (model_executor/models/deepseek_mtp.py)
proposes k tokens from the target's own hidden states, on the same workers.

Its KV cache is a pool of its own with the target's block geometry (like a draft model's: block i of
both pools holds the same tokens).  Per step, after the target has sampled:

  1. catch-up (follow_target): the module runs the step's rows -- at position p the target's final
     hidden state h_p and the token at p + 1 (the next prompt token, an accepted draft, or the token
     just sampled) -- writing its K/V for every row; rows past a request's accepted drafts see a wrong
     token and are rewritten the next step.  The output at a sampled request's last valid row (the
     position before its newest token) is kept: it predicts the first draft.
  2. propose: draft 1 from that output; each further draft re-applies the module at the next position
     to the previous draft and the module's own previous output (the target's hidden state there does
     not exist yet), writing into the lookahead slots the scheduler allocated.

Greedy requests take the argmax (q one-hot); random ones draw with their own sampling parameters and
generator, and q's rows go to the rejection sampler (draft_model.draw_drafts).
"""

from __future__ import annotations

import torch

from roofline.core.scheduler_output import ScheduledRequest
from roofline.spec_decode.draft_model import TargetStep, draw_drafts, gather_proposals
from roofline.spec_decode.proposer import ModelBasedProposer, ProposalBatch, Proposals, TargetForward


def known_tokens(state, start: int, end: int) -> list[int]:
    """The request's known tokens at positions [start, end) (prompt, then output), as far as they go."""
    prompt, output = state.prompt_token_ids, state.output_token_ids
    n = len(prompt)
    part = list(prompt[start:end]) if start < n else []
    if end > n:
        part += output[max(start - n, 0): end - n]
    return part


class MTPProposer(ModelBasedProposer):
    needs_target_hidden = True

    def __init__(self, module: torch.nn.Module, kv_caches: list[torch.Tensor], k: int, max_positions: int) -> None:
        super().__init__(module, kv_caches, k, max_positions)
        self._first: dict[str, torch.Tensor] = {}  # sampled request -> module output at its last valid row

    @torch.inference_mode()
    def follow_target(self, forward: TargetForward) -> None:
        """1. catch-up (module docstring)."""
        nxt: list[int] = []
        last_rows: dict[str, int] = {}
        for s in forward.items:
            st = forward.states[s.req_id]
            c = len(s.token_ids)
            following = known_tokens(st, s.num_computed_tokens + 1, s.num_computed_tokens + c + 1)
            if s.sample:
                newest = len(st.prompt_token_ids) + len(st.output_token_ids) - 1
                last_rows[s.req_id] = len(nxt) + newest - 1 - s.num_computed_tokens
            nxt += following + [0] * (c - len(following))
        ids = torch.tensor(nxt, dtype=torch.int64, device=forward.input_ids.device)
        y = self.model(ids, forward.positions, forward.hidden, self.kv_caches, forward.meta)
        self._first = {rid: y[row] for rid, row in last_rows.items()}

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> Proposals:
        """2. k drafts per request (module docstring)."""
        t: TargetStep = batch.target
        k = batch.k
        started = self.start(batch, usable=lambda r: r in self._first)
        if started is None:
            return Proposals([[] for _ in batch.req_ids])
        fit, rids, states, drafts, probs = started
        y = torch.stack([self._first[r] for r in rids])
        for step in range(k):
            tokens = draw_drafts(self.model.compute_logits(y), states, drafts, probs)
            if step == k - 1:
                break
            items = [ScheduledRequest(r, t.next_position[r] + step, [tok], t.block_ids[r], True)
                     for r, tok in zip(rids, tokens)]
            input_ids, positions, meta = t.prepare(items)
            y = self.model(input_ids, positions, y, self.kv_caches, meta)
        return gather_proposals(len(batch.req_ids), fit, drafts, probs)
