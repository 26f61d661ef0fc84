"""StepTimeModel: the engine's one estimate of how long a step will take, for the decisions made before it runs
(the per-step token budget, core/step_budget.py; the speculative draft length, spec_decode/draft_length.py).

    decode-only step:           T = r_decode(n) * bound(step)
    step with prefill chunks:   T = r_decode(n - P) * bound(its decodes alone)
                                  + r_prefill(P) * (bound(step) - bound(its decodes alone))

bound(...) is the live roofline's bound for that shape (metrics/step_roofline.py: the planner's cost model,
max(bytes / BW, FLOPs / F_peak), every request's KV reads and attention FLOPs at its own context); a ratio
is the measured time over the bound, as the live roofline records it for each finished step, kept as an
EMA per power-of-two bucket (the bound leaves out the per-step framework cost and rests on start-up probes
of bandwidth and FLOP/s, so the ratio is what makes it a time).  Two tables:
  - r_decode, per bucket of the token count n, from decode-only steps (every request fed one token, or a
    decode verifying its drafts);
  - r_prefill, per bucket of the prefill tokens P, from steps with a prefill chunk: what the chunks added to
    the step's time (its time less its decodes' share at r_decode) over what they added to its bound.
The two run at different fractions of their bounds -- a chunk's attention over a long prefix runs well below
the matmul peak its FLOPs are priced at, a batch of decodes well below the bandwidth -- so one ratio per
token count mixed them: a step of 16 decodes and a few prefill tokens shares the bucket of 16-31 tokens with
the 16 decodes alone, the ratio the budget's default target comes from (the decode step) took the chunk
steps' cost, and a whole-step ratio learned at one chunk size mispredicted the next (W4 on a 2-core CPU:
the decoders' p99 ITL 2-3x their steady value under a 1.5x target).  A chunk that adds under
MIN_INCREMENT of the step's bound (a memory-bound decode batch with room for it) teaches r_prefill nothing,
and an observation below MIN_RATIO counts as MIN_RATIO; before any decode-only step is seen, a step with prefill teaches it the whole step's ratio.

A bucket not seen in the last STALE_AFTER observations of its table counts as unseen (its ratio is old news,
and a decision that avoids it -- a budget kept below it by a ratio measured in a slow spell -- would never
see it again); steps of the other kind do not age it, so the decode-only ratio measured before a long prompt
arrived is still the reference while the prompt's chunks run beside the decodes.  An unseen bucket borrows
the ratio of the nearest seen bucket of its table below (above when none is below); a table with no bucket
seen borrows the other's; 1 before any step.  A stale bucket seen again starts over from the new
measurement.

The estimate is a mean, and a step's measured time scatters around it (a shared CPU, the allocator, the
caches: W4 on a 2-core CPU, measured over predicted for the chunk steps, median 1.03, p90 1.12, p99 1.17).
A budget that fills a step up to its target with the mean would see half its steps above the target, and the
tail is what a client's P99 ITL reads, so the model also tracks the TAIL_QUANTILE quantile of measured over
expected for steps with prefill (TailMargin: a streaming quantile estimate, from 1, within [1, MAX_MARGIN]);
the budget plans a step's predicted time times that margin against its target.

The cost model reaches this module as an object (`StepCost`: the engine passes its StepRooflineModel), so
that the core imports nothing from metrics or the planner; a plain callable n -> seconds (`TokenBound`) stands
in for it where only the token count matters (tests, a fixed bound).  Costs are cached per (start, tokens,
phase): a decode's cost depends only on its context, and the contexts of a batch repeat from step to step.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, Union

TYPICAL_CONTEXT = 512  # positions each decode attends to in the token-count estimate (the KV term is minor at small b)
COST_CACHE_SIZE = 1 << 16  # (start, tokens, phase) entries kept before the cache starts over
STALE_AFTER = 32  # steps: a ratio bucket not observed for this long counts as unseen (the EMA's memory is ~10)
MIN_INCREMENT = 0.05  # of a step's bound: prefill chunks that add less to it teach r_prefill nothing
MIN_RATIO = 0.5  # r_prefill's floor: the bound is a physical floor, so a chunk's share below half of it is
# the noise of subtracting the decodes' share (a 0 would price the next chunks, and a prefill-only step, at 0)

TAIL_QUANTILE = 0.9  # of the steps with prefill, the share the budget means to keep within its target
TAIL_RATE = 0.02  # the quantile estimate's step per observation: up 0.9x it when a step overshoots, down 0.1x
MAX_MARGIN = 1.5  # the margin's ceiling (a spell of 1.5x slow steps would otherwise starve prefill)


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


class RatioTable:
    """Measured step time over bound for one kind of step, per power-of-two bucket of the token count (an EMA
    per bucket; staleness counted in this table's own observations)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.ratios: dict[int, float] = {}
        self.seen: dict[int, int] = {}  # bucket -> the observation it was last seen at
        self.steps = 0  # observations

    @staticmethod
    def bucket(n: int) -> int:
        return max(n, 1).bit_length()

    def observe(self, n: int, r: float) -> None:
        self.steps += 1
        b = self.bucket(n)
        old = self.ratios.get(b) if self.steps - self.seen.get(b, self.steps) <= STALE_AFTER else None
        self.ratios[b] = r if old is None else old * self.decay + r * (1.0 - self.decay)
        self.seen[b] = self.steps

    def lookup(self, n: int) -> Optional[float]:
        """The ratio for n tokens (the nearest fresh bucket below, else above); None when none is fresh."""
        b = self.bucket(n)
        fresh = [k for k in self.ratios if self.steps - self.seen[k] <= STALE_AFTER]
        if b in fresh:
            return self.ratios[b]
        below = [k for k in fresh if k < b]
        if below:
            return self.ratios[max(below)]
        return self.ratios[min(fresh)] if fresh else None


class TailMargin:
    """The TAIL_QUANTILE quantile of measured / expected step time, by stochastic approximation: each
    observation moves it up by TAIL_RATE * q when above it, down by TAIL_RATE * (1 - q) when not, so it settles
    where a share q of the observations lie below it.  Kept within [1, MAX_MARGIN]: the budget never plans past
    the mean estimate."""

    def __init__(self, quantile: float = TAIL_QUANTILE, rate: float = TAIL_RATE) -> None:
        self.quantile, self.rate = quantile, rate
        self.value = 1.0

    def observe(self, error: float) -> None:
        step = self.quantile if error > self.value else self.quantile - 1.0
        self.value = min(max(self.value + self.rate * step, 1.0), MAX_MARGIN)


class StepTimeModel:
    def __init__(self, cost: Union[StepCost, Callable[[int], float]], decay: float = 0.9,
                 context: int = TYPICAL_CONTEXT) -> None:
        """cost: the cost model (StepCost) or a bound n -> seconds; decay: the ratio's EMA weight on the past;
        context: where decodes sit in the token-count estimate __call__."""
        self.cost = cost if hasattr(cost, "request_cost") else TokenBound(cost)
        self.decay = decay
        self.context = context
        self.tables = {False: RatioTable(decay), True: RatioTable(decay)}  # with prefill: False / True
        self._costs: dict[tuple[int, int, str], tuple[float, float]] = {}
        self.margin = TailMargin()  # measured / expected of the steps with prefill, its upper quantile

    @property
    def steps(self) -> int:
        """Steps observed, of both kinds."""
        return self.tables[False].steps + self.tables[True].steps

    # ---- calibration -----------------------------------------------------------------------------
    def observe(self, num_tokens: int, seconds: float, bound_s: float = 0.0, prefill_tokens: int = 0,
                decodes: Chunks = ()) -> None:
        """A finished step: its token count, measured wall time and bound (the live roofline's record of it;
        0: the token-count bound of __call__); with prefill chunks, their tokens and the step's decodes
        ((start, tokens) each, the requests fed one token or verifying drafts)."""
        self._observe(num_tokens, seconds, bound_s, prefill_tokens, *self._decodes_bound(decodes, prefill_tokens))

    def finished(self, num_tokens: int, seconds: float, bound_s: float, prefill_tokens: int = 0,
                 decodes: Chunks = ()) -> float:
        """The engine's call after each step: what the estimate expected of it (estimate()), then observe() it --
        its decodes' bound computed once for both; a step with prefill also moves the tail margin."""
        dec = self._decodes_bound(decodes, prefill_tokens)
        expected = self._estimate(num_tokens, bound_s, prefill_tokens, *dec)
        if prefill_tokens > 0 and expected > 0 and seconds > 0:
            self.margin.observe(seconds / expected)
        self._observe(num_tokens, seconds, bound_s, prefill_tokens, *dec)
        return expected

    def _observe(self, num_tokens: int, seconds: float, bound_s: float, prefill_tokens: int, n_dec: int,
                 dec_bound: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bound = bound_s if bound_s > 0 else self.decode_bound(num_tokens)
        if bound <= 0:
            return
        if prefill_tokens <= 0:
            self.tables[False].observe(num_tokens, seconds / bound)
            return
        r_dec = self.tables[False].lookup(n_dec) if n_dec else 0.0
        if r_dec is None:  # no decode-only step seen: the whole step's ratio (which the estimate then gives back)
            self.tables[True].observe(prefill_tokens, seconds / bound)
            return
        increment = bound - dec_bound
        if increment < MIN_INCREMENT * bound:
            return
        self.tables[True].observe(prefill_tokens, max((seconds - r_dec * dec_bound) / increment, MIN_RATIO))

    def tail_margin(self) -> float:
        """What a step with prefill takes at its TAIL_QUANTILE over its estimate (>= 1): the budget's margin."""
        return self.margin.value

    def ratio(self, n: int, prefill: bool = False) -> float:
        """r_decode for a step of n tokens, or r_prefill for n prefill tokens."""
        r = self.tables[bool(prefill)].lookup(n)
        if r is None:
            r = self.tables[not prefill].lookup(n)
        return 1.0 if r is None else r

    def estimate(self, num_tokens: int, bound_s: float, prefill_tokens: int = 0, decodes: Chunks = ()) -> float:
        """T for a step of this shape whose bound is bound_s (the formula above; arguments as for observe)."""
        return self._estimate(num_tokens, bound_s, prefill_tokens, *self._decodes_bound(decodes, prefill_tokens))

    def _estimate(self, num_tokens: int, bound_s: float, prefill_tokens: int, n_dec: int, dec_bound: float) -> float:
        if prefill_tokens <= 0:
            return self.ratio(num_tokens) * bound_s
        return self._mixed(n_dec, dec_bound, prefill_tokens, bound_s)

    def _mixed(self, n_dec: int, dec_bound: float, prefill_tokens: int, bound_s: float) -> float:
        return ((self.ratio(n_dec) * dec_bound if n_dec else 0.0)
                + self.ratio(prefill_tokens, True) * max(bound_s - dec_bound, 0.0))

    def _totals(self, decodes: Chunks) -> tuple[int, float, float]:
        """(tokens, KV bytes, attention FLOPs) of these decodes."""
        tokens, kv, attn = 0, 0.0, 0.0
        for start, n in decodes:
            k, a = self.request_cost(start, n, "decode")
            tokens, kv, attn = tokens + n, kv + k, attn + a
        return tokens, kv, attn

    def _decodes_bound(self, decodes: Chunks, prefill_tokens: int) -> tuple[int, float]:
        """(tokens, bound) of a step's decodes alone; (0, 0.0) for a decode-only step, which does not use it."""
        if prefill_tokens <= 0:
            return 0, 0.0
        tokens, kv, attn = self._totals(decodes)
        return tokens, (self.cost.bound(tokens, kv, attn) if tokens else 0.0)

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
        takes the chunks ((start, tokens) each, in any number; a chunk of one token counts with the decodes)
        and gives seconds by the formula above.  The decodes' part is summed once here, so that a search over
        chunk sizes costs one chunk's cost (and a bound of the decode-like part) per try."""
        tokens, kv, attn = self._totals(decodes)

        def predict(chunks: Chunks) -> float:
            t, k, a = tokens, kv, attn  # the whole step
            dt, dk, da, p = tokens, kv, attn, 0  # its decode-like part; prefill tokens
            for start, n in chunks:
                ck, ca = self.request_cost(start, n, "decode" if n == 1 else "prefill")
                t, k, a = t + n, k + ck, a + ca
                if n > 1:
                    p += n
                else:
                    dt, dk, da = dt + n, dk + ck, da + ca
            if not t:
                return 0.0
            bound = self.cost.bound(t, k, a)
            if not p:
                return self.ratio(t) * bound
            return self._mixed(dt, self.cost.bound(dt, dk, da) if dt else 0.0, p, bound)

        return predict
