"""DraftLengthPolicy: how many tokens to propose per request this step, 0 to num_speculative_tokens.

Verifying k drafts costs a step of (decodes * (1 + k) + other tokens) tokens and yields, per request,
on average E(k) = 1 + a + a^2 + ... + a^k tokens, a being the per-token acceptance probability.
While a step is bound by reading the weights (one stream, small batches) the extra tokens are almost
free and k is the largest allowed; once the step is compute bound (a large batch) each draft costs its
share of the step and pays only if it is accepted often enough.  Per step we take

    k* = argmax_k  num_decodes * (1 + f * (E(k) - 1)) / T(other + num_decodes * (1 + f * k))

with T(n) the engine's step-time estimate for n decode tokens (core/step_time.StepTimeModel, the one the
per-step token budget uses too: the planner's bound, max(bytes / BW, FLOPs / F) over the step's tokens,
scaled by the measured ratio of real step time to that bound for steps of about n tokens, since the bound
alone leaves out the per-step framework cost and rests on start-up probes of bandwidth and FLOP/s that a
shared machine makes noisy), a the running acceptance rate and f the
running share of decodes that had a proposal at all (prompt lookup often finds none).
a is estimated as accepted / (accepted + rejections), the maximum-likelihood estimate for run lengths
of independent acceptances, with exponential forgetting so that it follows the workload.
"""

from __future__ import annotations

from typing import Callable, Union

from roofline.core.step_time import StepTimeModel

DECAY = 0.98  # per observation: about the last 50 verifying request-steps weigh
# a longer draft must promise this much more throughput: proposing, verifying and rolling back cost
# host time the step-time estimate does not see (measured: W1 at 64 decodes lost 8% without it)
MARGIN = 0.05
PROBE_EVERY = 32  # steps: while k is 0, proposals are still asked for this often (a and f stay current)
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.0, 1.0  # a ~ 0.67 until measured: speculate at first


class DraftLengthPolicy:
    def __init__(self, max_k: int, step_time: Union[StepTimeModel, Callable[[int], float], None] = None) -> None:
        """step_time: the engine's StepTimeModel (the engine calibrates it after every step; the token budget
        shares it), or a bound num_tokens -> seconds (uncalibrated); None: always max_k (adaptivity off)."""
        self.max_k = max_k
        if step_time is not None and not isinstance(step_time, StepTimeModel):
            step_time = StepTimeModel(step_time)
        self.step_time = step_time
        self.accepted = PRIOR_ACCEPTED
        self.rejected = PRIOR_REJECTED
        self.steps_without_proposals = 0
        self.asked = 1.0  # decodes asked for a proposal (decayed)
        self.proposed = 1.0  # of those, with at least one draft

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @property
    def proposal_share(self) -> float:
        return self.proposed / self.asked

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (1 if num_accepted < num_drafts else 0)

    def observe_proposals(self, num_asked: int, num_with_drafts: int) -> None:
        if num_asked:
            self.asked = self.asked * DECAY + num_asked
            self.proposed = self.proposed * DECAY + num_with_drafts

    def num_to_propose(self, k: int) -> int:
        """Drafts to ask the proposer for after a step run with draft length k: k, or while k stays 0 the
        full length every PROBE_EVERY steps, so that a workload that turns repetitive is noticed."""
        if k > 0:
            self.steps_without_proposals = 0
            return k
        self.steps_without_proposals += 1
        if self.steps_without_proposals >= PROBE_EVERY:
            self.steps_without_proposals = 0
            return self.max_k
        return 0

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, num_decodes: int, other_tokens: int) -> int:
        if self.step_time is None:
            return self.max_k
        b = max(num_decodes, 1)
        f = self.proposal_share
        best_k, best = 0, -1.0
        for k in range(self.max_k + 1):
            gain = b * (1.0 + f * (self.expected_tokens(k) - 1.0))
            rate = gain / self.step_time(other_tokens + int(round(b * (1.0 + f * k))))
            if rate > best * (1.0 + MARGIN):  # a longer draft must pay for itself
                best_k, best = k, rate
        return best_k
