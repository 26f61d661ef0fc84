"""StructuredOutputManager: the engine core's one entry point for structured outputs.

  add_request:  grammars_for()   -> a RequestGrammar per child request (compile started or cached)
  step start:   take_failed()    -> requests whose compile failed (the core fails them alone, with
                                    RequestOutput.error naming the problem)
                wait_for_compile() when nothing else can run (instead of spinning)
  after schedule: attach_bitmask() -> the step's bitmask into the SchedulerOutput
  after update:   accept()       -> matchers advance over the appended tokens
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable, Optional

from roofline.core.scheduler_output import SchedulerOutput
from roofline.structured_output.bitmask import build_step_bitmask
from roofline.structured_output.compiler import GrammarCache
from roofline.structured_output.matcher import RequestGrammar
from roofline.structured_output.params import StructuredOutputsParams


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache: Optional[GrammarCache] = None
        self.pending: dict[str, Any] = {}  # request id -> Request whose compile was not done when last seen

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(self.tokenizer, self.vocab_size)  # ValueError without a tokenizer
        return self._cache

    def grammars_for(self, params: StructuredOutputsParams, stop_token_ids: list[int],
                     count: int) -> list[RequestGrammar]:
        """count fresh matchers' holders on one (shared, cached) compile; a failed compile fails the
        request at the next step (take_failed), like one that fails later."""
        fut = self.cache.get(params)
        return [RequestGrammar(fut, list(stop_token_ids)) for _ in range(count)]

    def track(self, request: Any) -> None:
        """Watch a queued request until its compile is done (forked n>1 siblings follow their first)."""
        if request.grammar is not None and request.index == 0 and (request.grammar.pending or request.grammar.error):
            self.pending[request.request_id] = request

    def take_failed(self) -> list[tuple[Any, str]]:
        """Requests whose compile finished since the last call and failed, with the error."""
        failed = []
        for rid, req in list(self.pending.items()):
            if req.grammar.pending:
                continue
            del self.pending[rid]
            if req.grammar.error is not None and not req.is_finished:
                failed.append((req, req.grammar.error))
        return failed

    def wait_for_compile(self, timeout: float) -> None:
        futs = [r.grammar.compiled for r in self.pending.values()]
        if futs:
            concurrent.futures.wait(futs, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def attach_bitmask(self, out: SchedulerOutput, requests: dict[str, Any]) -> None:
        rows = []
        for item in out.scheduled:
            if item.sample:
                req = requests.get(item.req_id)
                if req is not None and req.grammar is not None:
                    rows.append((item.req_id, req.grammar))
        if rows:
            out.grammar_req_ids, out.grammar_bitmask = build_step_bitmask(rows, self.vocab_size)

    @staticmethod
    def accept(touched: Iterable[tuple[Any, int]]) -> None:
        for req, k in touched:
            if k and req.grammar is not None:
                req.grammar.accept(req.output_token_ids[-k:])

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()
