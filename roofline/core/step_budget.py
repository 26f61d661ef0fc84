"""StepBudget: how many prefill tokens join a step's decodes, so that the step stays within an inter-token
latency target (--target-itl-ms).

A step that carries decodes is one inter-token interval of each of them: prefill tokens that join it
lengthen every running request's ITL.  Per step the scheduler hands the budget the step's shape -- the
decodes it will run (each (start, 1 + drafts)) and the prompts that could be prefilled, in the order they
would get tokens -- and the budget returns the largest number P of prefill tokens for which the predicted
step time stays within the target:

    T(decodes + the first P tokens of the prompts, in order) * margin <= target

T is the engine's step-time estimate (core/step_time.StepTimeModel: the live roofline's bound for that shape,
every request at its own context, times the measured ratio of real step time to the bound) and margin its
tail margin (what a step with prefill takes at its 90th percentile over that estimate, at least 1), so that
nine steps in ten, not one in two, stay within the target.  P is found by
bisection over whole tokens, so every token of slack goes to prefill.  The step's token budget is then
decodes + P, never more than --max-num-batched-tokens (a hard cap).

The target:
  - --target-itl-ms given: that, for every step.
  - default: DEFAULT_ITL_FACTOR (1.25) times the predicted decode-only step of the batch being built: the running
    decodes plus the requests that join them as decodes once prefilled (the prompts in prefill and the waiting
    queue behind them, as far as max_num_seqs leaves seats; the scheduler passes them as `joining`).  A step
    with prefill then takes at most a quarter more than a decode step of that batch, so a stream's ITL, at its
    P99 too, stays within half again its steady-state value while prompts advance: the steps of a 2-core CPU
    scatter by 10-25% around the estimate (the tail margin covers nine steps in ten), and at 1.5 the slowest
    chunk steps of W4 ran 1.75-2.05x the decoders' P99 before the long prompt (1.3: 1.18-1.49x with the 4-token
    floor).  The price is the long prompt's TTFT: 16-19 s -> 21-22 s in W4 on that CPU (1.5 with an 8-token
    floor against 1.25 with 4; late in the prompt the floor, not the factor, sets the chunk).  A burst of prompts meeting few
    decodes is admitted at the pace the full batch will run at: with the running decodes alone as the
    reference, the first few decodes of a burst (a 2-core CPU: 1-15 decodes at 14-80 ms a step, beside 32
    arriving prompts at ~1.7 ms a prefill token) would have left prefill only the minimum chunk, and any larger
    floor made those steps 5-30x their decodes' own time (W2s: P99 ITL 450-640 ms against 100 ms steady).
    A memory-bound decode step (a GPU below its ridge point) leaves a large slack (the prefill's FLOPs fit under
    the weight reads).

Rules that hold whatever the estimate says:
  - nothing to protect: a step without decodes gets the cap (time to first token as without the budget);
  - no starvation: P is at least the minimum chunk (MIN_CHUNK_TOKENS), so the oldest prompt in prefill
    advances by that much every step however tight the target (a target below the decodes' own time gives
    exactly that).  It is small on purpose: late in a long prompt each prefill token attends to the whole
    prefix, and a floor of 32 tokens alone made a step 2-3x its decodes' time there (W4, 2048-token prompt,
    16 decoders, 2-core CPU), so the floor, not the target, set the decoders' ITL; at 8 tokens the floor still
    bound through the last third of that prompt (8 tokens over a 1.5-2k prefix: ~40-60 ms beside a 60-85 ms
    step of 16 decodes, the slowest steps of the window all at the floor); at 4 it still binds there, but those
    steps stay within the decoders' 1.5x;
  - order: prefill tokens go to the oldest first (running prompts in admission order, then swapped ones, then
    the waiting queue in its order: FCFS or priority), decodes before any of them (the scheduler reserves the
    decodes' tokens, so a long prompt ahead of them in the running list cannot take their place);
  - the cap stays hard: when the decodes and the minimum chunk exceed it, the cap wins, as without the budget
    (the minimum chunk is still given, so decodes behind a prompt in the running list may wait a step).

The step-time estimate is injected (anything with `predictor(decodes) -> (chunks -> seconds)`), so tests
substitute a fake one; the scheduler sees this class only through `plan()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

Chunks = Sequence[tuple[int, int]]  # (start: tokens already computed, new tokens) per request

DEFAULT_ITL_FACTOR = 1.25
MIN_CHUNK_TOKENS = 4


class StepTimeEstimate(Protocol):
    """core/step_time.StepTimeModel, or a test's fake."""

    def predictor(self, decodes: Chunks) -> Callable[[Chunks], float]:
        ...

    def tail_margin(self) -> float:
        ...


@dataclass
class StepPlan:
    """One step's budget: tokens in all (decodes + prefill_tokens, at most the cap), the prefill tokens of
    them, and the step time aimed at (0.0: no decodes to protect, the cap applies)."""

    budget: int
    prefill_tokens: int
    target_s: float


def first_tokens(prefills: Chunks, p: int) -> list[tuple[int, int]]:
    """The chunks that give the first p prefill tokens, oldest prompt first."""
    out = []
    for start, n in prefills:
        if p <= 0:
            break
        k = min(n, p)
        out.append((start, k))
        p -= k
    return out


class StepBudget:
    def __init__(self, step_time: StepTimeEstimate, target_s: Optional[float] = None,
                 factor: float = DEFAULT_ITL_FACTOR) -> None:
        """target_s: the ITL target in seconds (None: the default, factor times the decode step of the batch
        being built).  The minimum chunk is MIN_CHUNK_TOKENS (a chunk need not end on a KV block boundary)."""
        if target_s is not None and target_s <= 0:
            raise ValueError(f"target_s must be positive, got {target_s}")
        self.step_time = step_time
        self.target_s = target_s
        self.factor = factor
        self.min_chunk = MIN_CHUNK_TOKENS

    def plan(self, decodes: Chunks, prefills: Chunks, cap: int, joining: Chunks = ()) -> StepPlan:
        """The budget of a step of these decodes, with these prompts waiting for prefill tokens (in order);
        joining: the decodes the prompts in prefill and the waiting ones with a seat become (each (its
        context, 1)), which the default target counts in the batch being built."""
        decode_tokens = sum(n for _, n in decodes)
        if decode_tokens == 0:
            return StepPlan(cap, cap, 0.0)
        predict = self.step_time.predictor(decodes)
        if self.target_s is not None:
            target = self.target_s
        else:
            target = self.factor * (self.step_time.predictor(list(decodes) + list(joining))(()) if joining
                                    else predict(()))
        room = max(cap - decode_tokens, 0)  # what the cap leaves beside the decodes
        within = target / self.step_time.tail_margin()  # the mean estimate's limit
        lo, hi = 0, min(room, sum(n for _, n in prefills))
        if predict(first_tokens(prefills, hi)) <= within:  # all of it fits (the usual case at low load)
            lo = hi
        while lo < hi:  # the largest P whose step is predicted within the target
            mid = (lo + hi + 1) // 2
            if predict(first_tokens(prefills, mid)) <= within:
                lo = mid
            else:
                hi = mid - 1
        prefill = min(max(lo, self.min_chunk), cap)
        return StepPlan(min(cap, decode_tokens + prefill), prefill, target)
