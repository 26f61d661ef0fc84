"""What the engine hands back: RequestOutput / CompletionOutput (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One position's logprobs: token id -> Logprob
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = most likely
    decoded_token: Optional[str] = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[LogprobsDict]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it
    # beam search: cumulative_logprob / len(token_ids) ** length_penalty, what the beams are ranked by
    score: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # A per-request error (the request was rejected or failed); the engine keeps serving others.
    error: Optional[str] = None
    # Set with error when the request's own input caused it (this field, e.g. "structured_outputs"): the API
    # answers 400 rather than 500.
    error_param: Optional[str] = None
    # A prefill for another engine (kv_transfer_params.do_remote_decode): what the decoder needs to
    # fetch its KV (do_remote_prefill, remote_engine_id, remote_block_ids, remote_host, remote_port, ...)
    kv_transfer_params: Optional[dict] = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of LLM.beam_search (vLLM's names): tokens holds the prompt and then the generated
    tokens (the EOS included when it ended on one); text is the generated text only."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / (generated tokens) ** length_penalty
    finish_reason: Optional[str] = None  # "stop" (EOS) | "length" (max_tokens)


@dataclass
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: its beam_width hypotheses, best (highest score) first."""

    sequences: list[BeamSearchSequence]
