"""RequestGrammar: one request's grammar state in the engine process.

It holds the compile Future until the grammar is ready (the scheduler leaves the request waiting
meanwhile), then an xgrammar GrammarMatcher that advances with every token the request accepts and
fills that request's row of the step's token bitmask.  dead_end() tells when the grammar allows no
next token at all (the engine then fails the request before it samples).  The matcher sees output tokens only, so a
request recomputed after preemption (same output tokens) keeps a consistent state.  rollback(k)
undoes the last k accepted tokens: the hook speculative decoding needs for rejected proposals.  With
start_after_token_id (a reasoning model's end-of-think) the request runs free until that token, and the
grammar constrains what follows it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Optional

import torch

from roofline.structured_output.bitmask import BITS, bitmask_width

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, compiled: Future, stop_token_ids: list[int], start_after_token_id: Optional[int] = None) -> None:
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids  # EOS (unless ignored) and the request's stop_token_ids
        self.waiting_for = start_after_token_id  # the constraint starts after this token (end of thinking)
        self._matcher: Any = None
        self.num_accepted = 0
        self.broken = False  # a token the grammar rejected was appended (see accept)
        self._mask: Optional[torch.Tensor] = None  # next_token_mask of the matcher's current state

    # -- compile state -----------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return not self.compiled.done()

    @property
    def error(self) -> Optional[str]:
        if not self.compiled.done() or self.compiled.cancelled():
            return "the grammar compile was cancelled" if self.compiled.cancelled() else None
        e = self.compiled.exception()
        return None if e is None else str(e)

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result(),
                                               override_stop_tokens=self.stop_token_ids or None)
        return self._matcher

    # -- per step ----------------------------------------------------------------------------------
    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained (ready, consistent and not terminated)."""
        return (self.waiting_for is None and not self.pending and self.error is None and not self.broken
                and not self.matcher.is_terminated())

    def next_token_mask(self, vocab_size: int) -> torch.Tensor:
        """int32 [ceil(V/32)]: the tokens the grammar allows next, filled once per matcher state (the
        dead-end check and the step's bitmask share it)."""
        if self._mask is None:
            mask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(mask, 0)
            self._mask = mask[0]
        return self._mask

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [R x ceil(V/32)], CPU)."""
        bitmask[row] = self.next_token_mask(bitmask.shape[1] * BITS)

    def dead_end(self, vocab_size: int, stops_suppressed: bool) -> bool:
        """The grammar allows no next token: none at all, or only stop tokens while min_tokens holds
        them back (stops_suppressed).  Sampling such a row would have nothing to pick from."""
        if not self.constrains:
            return False
        mask = self.next_token_mask(vocab_size)
        if stops_suppressed and self.stop_token_ids:
            mask = mask.clone()
            for t in self.stop_token_ids:
                mask[t // BITS] &= ~(1 << (t % BITS))
        return not bool(mask.any())

    def accept(self, token_ids: list[int]) -> None:
        """Advance over tokens the request appended.  The step's mask makes them grammatical; one that
        is not (only a bug could bring it) marks the grammar broken, and the engine fails the request
        rather than let it go on unconstrained."""
        if self.broken or self.pending or self.error is not None:
            return
        if self.waiting_for is not None:  # free until the start token; the grammar takes what follows it
            if self.waiting_for not in token_ids:
                return
            token_ids = token_ids[token_ids.index(self.waiting_for) + 1:]
            self.waiting_for = None
        m = self.matcher
        for tok in token_ids:
            if m.is_terminated():
                return
            self._mask = None
            if not m.accept_token(tok):
                logger.error("structured output: token %d does not match the grammar", tok)
                self.broken = True
                return
            self.num_accepted += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding: rejected proposals)."""
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_accepted} were accepted")
        if num_tokens:
            self._mask = None
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS would be allowed now)."""
        return self.matcher.is_completed()
