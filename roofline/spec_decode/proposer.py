"""Proposer: after the target model has sampled, guess the next k tokens of each sampled request.

The runner calls `propose(batch)` once per step with the requests that sampled (their whole token
history: prompt + output, the tokens just sampled included) and gets back up to k draft tokens per
request, and for proposers that sample their drafts from a distribution q, q's rows (the rejection
sampler needs q(x) to accept with min(1, p/q)).  A proposer that runs a model of its own (draft
model, MTP, an EAGLE-style head) also receives the step's flat batch and the target's hidden states
through `ProposalBatch.target`; it keeps its own KV cache and writes its proposals' KV into the
lookahead slots the scheduler allocates (`num_lookahead_slots`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class ProposalBatch:
    req_ids: list[str]
    token_ids: list[list[int]]  # per request: prompt + output so far
    k: int  # the most drafts per request this step
    target: Any = None  # the step's forward (inputs, metadata, hidden states), for model-based proposers


@dataclass
class TargetForward:
    """The step the target just ran, as a model-based proposer sees it after sampling."""

    input_ids: torch.Tensor  # [N] the flat batch
    positions: torch.Tensor  # [N]
    meta: Any  # AttentionMetadata (block tables with the lookahead slots)
    items: list  # the ScheduledRequests in row order
    states: dict  # req_id -> SamplingState (its output holds this step's sampled tokens)
    hidden: Optional[torch.Tensor] = None  # [N, H] final hidden states (needs_target_hidden proposers)


@dataclass
class Proposals:
    token_ids: list[list[int]]  # per request, 0..k drafts
    # per request, q [len(drafts) x V] the drafts were drawn from; None: the drafts are deterministic
    # (q one-hot, e.g. prompt lookup or a greedy draft model)
    probs: Optional[list[Optional[torch.Tensor]]] = None


class Proposer(ABC):
    #: slots past a sampling request's step its proposals' KV needs (a model-based proposer: k)
    num_lookahead_slots: int = 0
    #: wants ProposalBatch.target (draft_model.TargetStep): the step's flat batch and block tables
    needs_target_step: bool = False
    #: a model-based proposer's KV cache tensors: the runner moves their blocks with the target's
    kv_caches: list = []

    #: wants TargetForward.hidden: the target's final hidden state at every row of the step (MTP,
    #: EAGLE-style heads); the runner then computes every row's hidden state, not only the sampled rows'
    needs_target_hidden: bool = False

    def follow_target(self, forward: "TargetForward") -> None:
        """Called every step, after sampling, with the target's forward (needs_target_step proposers):
        e.g. a draft model writes its own K/V for the same tokens, an MTP module from the target's
        hidden states and the tokens that follow them."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> Proposals: ...


class ModelBasedProposer(Proposer):
    """A proposer that runs a model of its own on the target's workers (a draft model, an MTP module):
    a KV pool in the target's block geometry and k lookahead slots past a sampling request's step."""

    needs_target_step = True

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], k: int, max_positions: int) -> None:
        """max_positions: positions the model may be run at (its rotary table, the engine's max_model_len)."""
        self.model = model
        self.kv_caches = kv_caches
        self.num_lookahead_slots = k
        self.max_positions = max_positions

    def start(self, batch: ProposalBatch, usable=None):
        """The requests that propose this step -- their k draft positions fit (one at the end of its room
        proposes nothing) and usable(req_id) -- as (batch indices, req ids, sampling states, empty drafts
        and q rows per request); None when none does."""
        t = batch.target
        fit = [i for i, r in enumerate(batch.req_ids)
               if (usable is None or usable(r)) and t.next_position[r] + batch.k <= self.max_positions]
        if batch.k <= 0 or not fit:
            return None
        rids = [batch.req_ids[i] for i in fit]
        return fit, rids, [t.states[r] for r in rids], [[] for _ in rids], [[] for _ in rids]
