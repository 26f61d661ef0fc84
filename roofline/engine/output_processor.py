"""OutputProcessor: per-request detokenization, stop strings, logprob formatting, and the
RequestOutputs handed to callers (one per user request, n completions inside).

Incremental detokenization keeps two offsets into the token list: text is decoded from
`prefix_offset` and only the part past the already-emitted prefix is new; while the newest
tokens end inside a multi-byte character (decode gives U+FFFD) nothing is emitted yet.
Stop strings are searched across token boundaries in the text; the text stops before them.
In streaming (DELTA) mode, the last len(longest stop)-1 characters are held back until they
cannot be the start of a stop string.
A beam search (use_beam_search) streams nothing: its n completions are filled in once, with the search's
best hypotheses, when it ends (finish_beam_group), whatever the output kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from roofline.core.beam_search import Hypothesis
from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler_output import PositionLogprobs
from roofline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from roofline.sampling_params import RequestOutputKind, SamplingParams


class IncrementalDetokenizer:
    CONTEXT = 6  # prompt tokens kept as left context so leading spaces decode right

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.tokens.extend(token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full_text[len(prefix_text) :]
        return ""


@dataclass
class CompletionState:
    index: int
    request_id: Optional[str]  # the engine-level (child) request id; None: a beam search's completion
    detok: Optional[IncrementalDetokenizer]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    score: Optional[float] = None  # beam search: the hypothesis' length-normalised score
    sent_text: int = 0  # characters already emitted (DELTA)
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finished_sent: bool = False


@dataclass
class GroupState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[CompletionState]
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, GroupState] = {}
        self.child_to_group: dict[str, tuple[str, int]] = {}

    def add_group(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                  params: SamplingParams, child_ids: list[Optional[str]], arrival_time: float) -> None:
        """child_ids: the engine request feeding each completion (None for all n of a beam search)."""
        comps = []
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens) \
                if self.tokenizer is not None else None
            comps.append(CompletionState(
                index=i, request_id=cid, detok=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            ))
            if cid is not None:
                self.child_to_group[cid] = (request_id, i)
        self.groups[request_id] = GroupState(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids), params=params,
            metrics=RequestMetrics(arrival_time=arrival_time), completions=comps,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def has_group(self, request_id: str) -> bool:
        return request_id in self.groups

    def _logprob_dict(self, plp: PositionLogprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for tid, lp, rank in zip(plp.token_ids, plp.logprobs, plp.ranks):
            if tid not in out:
                dec = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
                out[tid] = Logprob(logprob=lp, rank=rank, decoded_token=dec)
        return out

    def record_prompt_logprobs(self, child_id: str, entries: list[PositionLogprobs]) -> None:
        gid, idx = self.child_to_group.get(child_id, (None, 0))
        if gid is None or idx != 0:
            return
        g = self.groups[gid]
        if g.prompt_logprobs is None:
            return
        for e in entries:
            if len(g.prompt_logprobs) < len(g.prompt_token_ids):  # recompute after preemption repeats rows
                g.prompt_logprobs.append(self._logprob_dict(e))

    def process(self, req: Request, new_token_ids: list[int], logprobs: list[Optional[PositionLogprobs]],
                now: float) -> Optional[str]:
        """Absorb a child's new tokens. Returns a stop string if one ended the text (caller stops it)."""
        gid, idx = self.child_to_group[req.request_id]
        g = self.groups[gid]
        c = g.completions[idx]
        p = g.params
        m = g.metrics
        if req.num_cached_tokens >= 0 and idx == 0:
            g.num_cached_tokens = m.num_cached_tokens = req.num_cached_tokens
        m.num_preemptions = max(m.num_preemptions, req.num_preemptions)
        if new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        stop_hit = None
        last = len(new_token_ids) - 1
        for j, (tok, lp) in enumerate(zip(new_token_ids, logprobs or [None] * len(new_token_ids))):
            c.token_ids.append(tok)
            if c.logprobs is not None and lp is not None:
                c.logprobs.append(self._logprob_dict(lp))
                c.cumulative_logprob += lp.logprobs[0]
            if c.detok is None:
                continue
            # the stop token itself (EOS or a stop_token_id) is not part of the text
            is_stop_token = j == last and req.status == RequestStatus.FINISHED_STOPPED
            if is_stop_token and not p.include_stop_str_in_output:
                c.text += c.detok.add([], final=True)
                continue
            before = len(c.text)
            c.text += c.detok.add([tok], final=req.is_finished)
            if p.stop and len(c.token_ids) >= p.min_tokens:
                stop_hit = self._find_stop(c, before, p)
                if stop_hit is not None:
                    break
        if req.is_finished and c.finish_reason is None:
            c.finish_reason = req.status.finish_reason
            c.stop_reason = req.stop_reason
        if stop_hit is not None:
            c.finish_reason, c.stop_reason = "stop", stop_hit
        if g.finished and m.finished_time is None:
            m.finished_time = now
        return stop_hit

    @staticmethod
    def _find_stop(c: CompletionState, before: int, p: SamplingParams) -> Optional[str]:
        longest = max(len(s) for s in p.stop)
        start = max(0, before - longest + 1)
        best = None
        for s in p.stop:
            i = c.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        c.text = c.text[: i + len(s)] if p.include_stop_str_in_output else c.text[:i]
        return s

    def mark_scheduled(self, gid: str, now: float) -> None:
        g = self.groups.get(gid)
        if g is not None and g.metrics.first_scheduled_time is None:
            g.metrics.first_scheduled_time = now

    def group_of(self, child_id: str) -> Optional[str]:
        """The user request an engine request belongs to (None once it is finished)."""
        return self.child_to_group.get(child_id, (None, 0))[0]

    def abort_group(self, gid: str, now: float, reason: str = "abort") -> None:
        """Every completion of gid not finished yet ends with `reason`."""
        g = self.groups.get(gid)
        if g is None:
            return
        for c in g.completions:
            if c.finish_reason is None:
                c.finish_reason = reason
        if g.metrics.finished_time is None:
            g.metrics.finished_time = now

    def finish_beam_group(self, gid: str, hypotheses: list[Hypothesis], num_cached_tokens: int,
                          num_preemptions: int, now: float) -> Optional[RequestOutput]:
        """A beam search's final output: completion i is the i-th best hypothesis (the EOS it ended on is
        in its token_ids, not in its text, as with any request)."""
        g = self.groups[gid]
        p = g.params
        g.num_cached_tokens = g.metrics.num_cached_tokens = max(num_cached_tokens, 0)
        g.metrics.num_preemptions = num_preemptions
        g.metrics.first_token_time = g.metrics.first_token_time or now
        g.metrics.last_token_time = g.metrics.finished_time = now
        for c, h in zip(g.completions, hypotheses):
            c.token_ids = list(h.token_ids)
            c.cumulative_logprob, c.score = h.cumulative_logprob, h.score
            c.finish_reason = h.finish_reason
            if c.detok is not None:
                eos_hidden = h.finish_reason == "stop" and not p.include_stop_str_in_output
                c.text = c.detok.add(h.token_ids[:-1] if eos_hidden else list(h.token_ids), final=True)
        return self.make_output(gid, {c.index for c in g.completions})

    def make_output(self, gid: str, touched: set[int]) -> Optional[RequestOutput]:
        """The RequestOutput to emit now for group gid (None when nothing is due)."""
        g = self.groups[gid]
        kind = g.params.output_kind
        finished = g.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        holdback = max((len(s) for s in g.params.stop), default=1) - 1
        outs = []
        for c in g.completions:
            if kind == RequestOutputKind.DELTA:
                if c.index not in touched and not (c.finish_reason and not c.finished_sent):
                    continue
                end = len(c.text) if c.finish_reason else max(c.sent_text, len(c.text) - holdback)
                text = c.text[c.sent_text : end]
                toks = c.token_ids[c.sent_tokens :]
                lps = c.logprobs[c.sent_logprobs :] if c.logprobs is not None else None
                c.sent_text, c.sent_tokens = end, len(c.token_ids)
                c.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            else:
                text, toks = c.text, list(c.token_ids)
                lps = list(c.logprobs) if c.logprobs is not None else None
            if c.finish_reason:
                c.finished_sent = True
            outs.append(CompletionOutput(
                index=c.index, text=text, token_ids=toks, cumulative_logprob=c.cumulative_logprob,
                logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason, score=c.score,
            ))
        if not outs and not finished:
            return None
        out = RequestOutput(
            request_id=gid, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
            prompt_logprobs=g.prompt_logprobs, outputs=outs, finished=finished, metrics=g.metrics,
            num_cached_tokens=g.num_cached_tokens,
        )
        if finished:
            for c in g.completions:
                self.child_to_group.pop(c.request_id, None)
            del self.groups[gid]
        return out
