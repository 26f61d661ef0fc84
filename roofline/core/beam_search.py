"""Beam search: one request's hypotheses and the choice of its next beams (BeamSearch, no tensors, no
requests), and the scheduler's record of which engine Requests carry its live beams (BeamGroup).

Follows Hugging Face transformers' `GenerationMixin._beam_search` (transformers 5.24, the vectorised
version without a BeamScorer) with early_stopping=False and no logits processors.  W = the beam width,
L = tokens every live beam has generated so far, a beam's score = the sum of its tokens' logprobs
(log-softmax of the raw logits).
One step:
  1. candidates: (score_b + logprob(t | beam b), b, t) from each live beam's top 2W next tokens; the 2W best
     over all beams are kept (they are among each beam's best 2W).  HF keeps max(2, 1 + #EOS) * W; with one
     EOS id (or none, ignore_eos) that is 2W.  The first step has one live beam (HF's other initial beams
     score -1e9 and never win).
  2. a candidate hits a stop when t is EOS (not with ignore_eos) or it is the max_tokens-th token.
  3. the next live beams: the W best candidates that hit no stop, best first.
  4. the candidates ranked within the first W of the 2W that hit a stop join the finished hypotheses,
     scored (score_b + logprob) / (L + 1) ** length_penalty (L + 1 generated tokens, the EOS included);
     the W best finished hypotheses are kept.  So at max_tokens the W best candidates of the last step
     all finish, and the result mixes them with the earlier EOS-finished ones by normalised score.
  5. the search ends when no beam goes on (max_tokens), or when W hypotheses have finished and the best
     live beam's score / (L + 1) ** length_penalty is no better than the worst finished score (HF's
     early_stopping=False heuristic: the best live beam judged at its current length).
The result: the W finished hypotheses, best first (HF's sequences / sequences_scores with
num_return_sequences=W).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

from roofline.core.request import Request


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the EOS included when it ended on one
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what the hypotheses rank by
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    score: float  # sum of their logprobs


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, length_penalty: float = 1.0,
                 eos_token_id: Optional[int] = None) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.eos_token_id = eos_token_id  # None: EOS is an ordinary token (ignore_eos)
        self.beams: list[Beam] = [Beam([], 0.0)]  # live beams, best first
        self.finished: list[Hypothesis] = []  # at most width, best first
        self.done = False

    @property
    def num_logprobs(self) -> int:
        """The top next-token logprobs each live beam must report per step."""
        return 2 * self.width

    def _normalised(self, score: float, length: int) -> float:
        return score / length ** self.length_penalty

    def step(self, next_logprobs: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, int]]:
        """next_logprobs[b]: live beam b's top num_logprobs (token, logprob), best first.  Returns the next
        live beams (best first) as (index of the parent among the current live beams, token); empty once
        the search is done."""
        assert not self.done and len(next_logprobs) == len(self.beams)
        length = len(self.beams[0].token_ids) + 1  # generated tokens once this step's token is appended
        k = self.num_logprobs
        # 1. (cumulative score, parent, token): sorted() is stable, so ties keep beam order, then logprob rank
        candidates = sorted(((beam.score + lp, b, tok) for b, beam in enumerate(self.beams)
                             for tok, lp in next_logprobs[b][:k]), key=lambda c: -c[0])[:k]
        at_max = length >= self.max_tokens
        moves: list[tuple[int, int]] = []
        new_beams: list[Beam] = []
        new_finished: list[Hypothesis] = []
        for rank, (score, b, tok) in enumerate(candidates):
            is_eos = tok == self.eos_token_id
            if is_eos or at_max:  # 2. hits a stop: 4. a hypothesis when within the first W
                if rank < self.width:
                    new_finished.append(Hypothesis(self.beams[b].token_ids + [tok], score,
                                                   self._normalised(score, length), "stop" if is_eos else "length"))
            elif len(moves) < self.width:  # 3.
                moves.append((b, tok))
                new_beams.append(Beam(self.beams[b].token_ids + [tok], score))
        # the earlier hypotheses first among equal scores
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[: self.width]
        self.beams = new_beams
        # 5. HF's early_stopping=False heuristic: the best live beam, judged at its current length
        self.done = not new_beams or (len(self.finished) == self.width and
                                      self._normalised(new_beams[0].score, length) <= self.finished[-1].score)
        if self.done:
            self.beams = []
            return []
        return moves


@dataclass
class BeamGroup:
    """A beam-search request inside the scheduler: its search, and the engine Request of each live beam
    (aligned with search.beams).  Beams run as ordinary requests (one-token decodes after the first
    beam's prefill); one that has sampled waits, parked, until every live beam has reported its next-token
    logprobs, then the step (BeamSearch.step) continues, forks (copy-on-write) or ends them."""

    root: Request  # the first beam: its id is the user's request id
    search: BeamSearch
    beams: list[Request] = field(init=False)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # this step's, by beam request id
    num_scored: int = 0  # next-token positions computed for the search (one per live beam per step)
    fork_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.beams = [self.root]

    @property
    def group_id(self) -> str:
        return self.root.group_id

    def next_beam_id(self) -> str:
        return f"{self.group_id}#beam{next(self.fork_ids)}"
