"""Request: one sequence's state as the scheduler sees it (tokens, progress, status). No tensors."""

from __future__ import annotations

import enum
import time
from typing import Optional

from roofline.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FORK = 1  # a sibling of an n>1 request, waiting for the first one's prefill
    RUNNING = 2
    PREEMPTED = 3  # waiting again after preemption by recompute
    SWAPPED = 4  # its KV lives in the CPU swap pool
    WAITING_FOR_REMOTE_KVS = 5  # its blocks are allocated; a KV connector is filling them (kv_transfer/)
    WAITING_FOR_BEAMS = 6  # a beam that reported its next-token logprobs, waiting for its search's step
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13  # this request alone failed inside the engine; the others keep running

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {10: "stop", 11: "length", 12: "abort", 13: "error"}.get(int(self))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        group_id: Optional[str] = None,
        index: int = 0,
        lora_request=None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id or request_id  # the user's request id (n>1 shares one)
        self.index = index  # which of the n completions
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # lora/request.LoRARequest: the adapter it runs under (None: base)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling; -1 = not yet
        self.status = RequestStatus.WAITING
        self.stop_reason: object = None
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.forks_pending: list["Request"] = []  # siblings that fork from this one after prefill
        # Prompt logprobs need logits at every prompt position, so such requests skip cache hits.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        self.grammar = None  # structured outputs: its RequestGrammar (waits unscheduled while pending)
        # speculative decoding: tokens proposed to follow all_token_ids, verified at the next step; never
        # part of all_token_ids (so never hashed into the prefix cache) until accepted
        self.spec_token_ids: list[int] = []
        # KV transfer (kv_transfer/): the request's KVTransferParams, the tokens a load is bringing in,
        # and whether a load failed (it then computes its whole prompt here)
        self.kv_transfer = None
        self.num_loading_tokens = 0
        self.kv_load_failed = False

    @property
    def lora_key(self) -> Optional[str]:
        """The adapter's identity in the prefix cache's block hashes (None: the base model)."""
        return self.lora_request.cache_key if self.lora_request is not None else None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
