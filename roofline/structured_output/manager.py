"""StructuredOutputManager: the engine core's one entry point for structured outputs.

  add_request:  grammars_for()   -> a RequestGrammar per child request (compile started or cached)
  step start:   take_failed()    -> requests whose compile failed (the core fails them alone, with
                                    RequestOutput.error naming the problem)
                wait_for_compile() when nothing else can run (instead of spinning)
  after schedule: attach_bitmask() -> the step's bitmask into the SchedulerOutput
  after update:   accept()       -> matchers advance over the appended tokens, and the requests whose
                                    grammar now allows no next token (a dead end) or rejected a token
                                    come back, to be failed before they sample again
A request's first position is checked the same way when it comes in (take_failed), and a grammar whose
first position allows nothing fails its compile (compiler.py): a 400 at the API.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable, NamedTuple, Optional

from roofline.core.scheduler_output import SchedulerOutput
from roofline.sampling_params import StructuredOutputsParams
from roofline.structured_output.bitmask import build_step_bitmask
from roofline.structured_output.compiler import GrammarCache
from roofline.structured_output.matcher import RequestGrammar

PARAM = "structured_outputs"
DEAD_END_ERROR = ("structured output: the constraint allows no token after {n} generated token(s): it has no "
                  "valid continuation here (a dead end, or only a stop token while min_tokens holds it back)")


class GrammarFailure(NamedTuple):
    request: Any
    error: str
    param: Optional[str]  # "structured_outputs" when the request's own constraint is at fault (a 400)


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
        return [RequestGrammar(fut, list(stop_token_ids), params.start_after_token_id) for _ in range(count)]

    def track(self, request: Any) -> None:
        """Watch a queued request until its compile is done and its first position checked (forked n>1
        siblings follow their first)."""
        if request.grammar is not None and request.index == 0:
            self.pending[request.request_id] = request

    def take_failed(self) -> list[GrammarFailure]:
        """Requests whose compile finished since the last call and failed, or whose first position
        allows no token, with the error."""
        failed = []
        for rid, req in list(self.pending.items()):
            if req.grammar.pending:
                continue
            del self.pending[rid]
            if req.is_finished:
                continue
            if req.grammar.error is not None:
                failed.append(GrammarFailure(req, req.grammar.error, PARAM))
            else:
                failed.extend(self.dead_ends([req]))
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

    def accept(self, touched: Iterable[tuple[Any, int]]) -> list[GrammarFailure]:
        """Advance the matchers over the tokens appended this step; returns the unfinished requests that
        cannot go on (dead_ends), with the error."""
        advanced = []
        for req, k in touched:
            if k and req.grammar is not None:
                req.grammar.accept(req.output_token_ids[-k:])
                if not req.is_finished:
                    advanced.append(req)
        return self.dead_ends(advanced) if advanced else []

    def dead_ends(self, requests: Iterable[Any]) -> list[GrammarFailure]:
        """The requests whose grammar rejected a token, or allows no next token (none at all, or only a
        stop token while min_tokens holds it back), with the error to fail them with."""
        out = []
        for req in requests:
            g = req.grammar
            n = req.num_output_tokens
            if g.broken:
                out.append(GrammarFailure(req, f"structured output: generated token {req.output_token_ids[-1]} "
                                               "does not match the constraint", None))
            elif g.dead_end(self.vocab_size, stops_suppressed=n < req.sampling_params.min_tokens):
                out.append(GrammarFailure(req, DEAD_END_ERROR.format(n=n), PARAM))
        return out

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.shutdown()
