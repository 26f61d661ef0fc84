"""StepTimeModel: the engine's one estimate of how long a step will take, for the decisions made before it runs
(the per-step token budget, core/step_budget.py; the speculative draft length, spec_decode/draft_length.py).

    T(step) = ratio(n) * bound(step)

bound(step) is the live roofline's bound for the step's shape (metrics/step_roofline.py: the planner's cost
model, max(bytes / BW, FLOPs / F_peak), every request's KV reads and attention FLOPs at its own context);
ratio(n) is the measured step time over that bound, as the live roofline records it for each finished step,
kept per power-of-two bucket of the step's token count n as an EMA (the bound leaves out the per-step
framework cost and rests on start-up probes of bandwidth and FLOP/s, so the ratio is what makes it a time).
A bucket not seen in the last STALE_AFTER steps counts as unseen (its ratio is old news, and a decision that
avoids it -- a budget kept below it by a ratio measured in a slow spell -- would never see it again); an
unseen bucket borrows the ratio of the nearest seen bucket below (above when none is below), 1 before any
step.  A stale bucket seen again starts over from the new measurement.

The cost model reaches this module as an object (`StepCost`: the engine passes its StepRooflineModel), so
that the core imports nothing from metrics or the planner; a plain callable n -> seconds (`TokenBound`) stands
in for it where only the token count matters (tests, a fixed bound).  Costs are cached per (start, tokens,
phase): a decode's cost depends only on its context, and the contexts of a batch repeat from step to step.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, Union

TYPICAL_CONTEXT = 512  # positions each decode attends to in the token-count estimate (the KV term is minor at small b)
COST_CACHE_SIZE = 1 << 16  # (start, tokens, phase) entries kept before the cache starts over
STALE_AFTER = 32  # steps: a ratio bucket not observed for this long counts as unseen (the EMA's memory is ~10)


class StepCost(Protocol):
    """What the estimate needs from the cost model (metrics/step_roofline.StepRooflineModel has it)."""

    def request_cost(self, start: int, new_tokens: int, phase: str) -> tuple[float, float]:
        """(KV bytes read, attention FLOPs) of one request's new tokens after `start` computed ones."""

    def bound(self, n_tokens: int, kv_bytes: float, attn_flops: float) -> float:
        """The roofline bound in seconds of a step of n_tokens with these KV bytes and attention FLOPs."""


class TokenBound:
    """A StepCost from a function of the token count alone (no per-request term)."""

    def __init__(self, fn: Callable[[int], float]) -> None:
        self.fn = fn

    def request_cost(self, start: int, new_tokens: int, phase: str) -> tuple[float, float]:
        return 0.0, 0.0

    def bound(self, n_tokens: int, kv_bytes: float, attn_flops: float) -> float:
        return self.fn(n_tokens)


# a step's requests as (start, new tokens): start is the number of tokens already computed
Chunks = Sequence[tuple[int, int]]


class StepTimeModel:
    def __init__(self, cost: Union[StepCost, Callable[[int], float]], decay: float = 0.9,
                 context: int = TYPICAL_CONTEXT) -> None:
        """cost: the cost model (StepCost) or a bound n -> seconds; decay: the ratio's EMA weight on the past;
        context: where decodes sit in the token-count estimate __call__."""
        self.cost = cost if hasattr(cost, "request_cost") else TokenBound(cost)
        self.decay = decay
        self.context = context
        self.ratios: dict[int, float] = {}
        self.seen: dict[int, int] = {}  # bucket -> the step it was last observed at
        self.steps = 0  # steps observed
        self._costs: dict[tuple[int, int, str], tuple[float, float]] = {}

    # ---- calibration -----------------------------------------------------------------------------
    @staticmethod
    def bucket(n: int) -> int:
        return max(n, 1).bit_length()

    def observe(self, num_tokens: int, seconds: float, bound_s: float = 0.0) -> None:
        """A finished step: its token count, measured wall time and bound (the live roofline's record of it;
        0: the token-count bound of __call__)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        bound = bound_s if bound_s > 0 else self.decode_bound(num_tokens)
        if bound <= 0:
            return
        self.steps += 1
        b = self.bucket(num_tokens)
        r = seconds / bound
        old = self.ratios.get(b) if self.steps - self.seen.get(b, self.steps) <= STALE_AFTER else None
        self.ratios[b] = r if old is None else old * self.decay + r * (1.0 - self.decay)
        self.seen[b] = self.steps

    def ratio(self, n: int) -> float:
        b = self.bucket(n)
        fresh = [k for k in self.ratios if self.steps - self.seen[k] <= STALE_AFTER]
        if b in fresh:
            return self.ratios[b]
        below = [k for k in fresh if k < b]
        if below:
            return self.ratios[max(below)]
        return self.ratios[min(fresh)] if fresh else 1.0

    # ---- estimates -------------------------------------------------------------------------------
    def request_cost(self, start: int, n: int, phase: str) -> tuple[float, float]:
        key = (start, n, phase)
        c = self._costs.get(key)
        if c is None:
            if len(self._costs) >= COST_CACHE_SIZE:
                self._costs.clear()
            c = self._costs[key] = self.cost.request_cost(start, n, phase)
        return c

    def decode_bound(self, n: int) -> float:
        """The bound of a step of n decode tokens at the typical context."""
        n = max(n, 1)
        kv, attn = self.request_cost(self.context - 1, 1, "decode")
        return self.cost.bound(n, n * kv, n * attn)

    def __call__(self, n: int) -> float:
        """T(n) for a step of n decode tokens at the typical context (the draft length's estimate)."""
        return self.ratio(n) * self.decode_bound(n)

    def predictor(self, decodes: Chunks) -> Callable[[Chunks], float]:
        """T for steps of these decodes (each (start, 1 + drafts)) plus prefill chunks: the returned function
        takes the chunks ((start, tokens) each, in any number) and gives seconds.  The decodes' part is summed
        once here, so that a search over chunk sizes costs one chunk's cost per try."""
        tokens, kv, attn = 0, 0.0, 0.0
        for start, n in decodes:
            k, a = self.request_cost(start, n, "decode")
            tokens, kv, attn = tokens + n, kv + k, attn + a

        def predict(chunks: Chunks) -> float:
            t, k, a = tokens, kv, attn
            for start, n in chunks:
                ck, ca = self.request_cost(start, n, "decode" if n == 1 else "prefill")
                t, k, a = t + n, k + ck, a + ca
            return self.ratio(t) * self.cost.bound(t, k, a) if t else 0.0

        return predict
