"""RequestGrammar: one request's grammar state in the engine process.

It holds the compile Future until the grammar is ready (the scheduler leaves the request waiting
meanwhile), then an xgrammar GrammarMatcher that advances with every token the request accepts and
fills that request's row of the step's token bitmask.  The matcher sees output tokens only, so a
request recomputed after preemption (same output tokens) keeps a consistent state.  rollback(k)
undoes the last k accepted tokens: the hook speculative decoding needs for rejected proposals.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Optional

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, compiled: Future, stop_token_ids: list[int]) -> None:
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids  # EOS (unless ignored) and the request's stop_token_ids
        self._matcher: Any = None
        self.num_accepted = 0
        self.broken = False  # a token the grammar rejected was appended (see accept)

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
        return (not self.pending and self.error is None and not self.broken
                and not self.matcher.is_terminated())

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [R x ceil(V/32)], CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_ids: list[int]) -> None:
        """Advance over tokens the request appended.  The mask makes them grammatical; a token that is
        not (a stop token after ignore_eos, or EOS while min_tokens held it back) leaves the matcher
        behind, and the request continues unconstrained."""
        if self.broken or self.pending or self.error is not None:
            return
        m = self.matcher
        for tok in token_ids:
            if m.is_terminated():
                return
            if not m.accept_token(tok):
                logger.warning("structured output: token %d does not match the grammar; "
                               "the rest of this request is unconstrained", tok)
                self.broken = True
                return
            self.num_accepted += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding: rejected proposals)."""
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_accepted} were accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS would be allowed now)."""
        return self.matcher.is_completed()
