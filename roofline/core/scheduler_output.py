"""The messages of the heartbeat: SchedulerOutput (scheduler -> workers) and ModelRunnerOutput
(workers -> scheduler).  msgspec Structs, so they cross process boundaries as msgpack, never pickle.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from roofline.core.kv_connector_messages import KVConnectorMetadata, KVConnectorOutput, merge_connector_outputs
from roofline.lora_request import LoRARequest


class SamplingSpec(msgspec.Struct, array_like=True):
    """The part of SamplingParams a worker needs to sample."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: Optional[int]
    min_tokens: int
    stop_token_ids: list[int]  # suppressed (with EOS) until min_tokens are out
    logprobs: Optional[int]
    prompt_logprobs: Optional[int]
    structured: bool = False  # a grammar constrains its tokens (never the greedy LM-head shortcut)


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingSpec
    generator_seed: int  # seeds the request's own RNG stream
    lora: Optional[LoRARequest] = None  # the LoRA adapter it runs under (roofline/lora); None: the base model


class ScheduledRequest(msgspec.Struct, array_like=True):
    req_id: str
    num_computed_tokens: int  # position of the first new token
    token_ids: list[int]  # the new tokens fed this step (C of them)
    block_ids: list[int]  # the whole block table
    sample: bool  # the last new token is the request's last known token: sample the next one
    # speculative decoding: the last num_draft_tokens of token_ids are proposals to verify (the runner
    # samples at each of the 1 + num_draft_tokens last rows and keeps the accepted prefix)
    num_draft_tokens: int = 0
    # hybrid KV layout (core/hybrid_kv_cache_manager.py): every group's table (block_ids is group 0's); [] without
    group_block_ids: list[list[int]] = []
    # recurrent state (linear-attention layers, attention/kv_spec.recurrent_spec): the request's state slot; -1: none
    state_slot: int = -1


class SchedulerOutput(msgspec.Struct, array_like=True):
    step: int
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]
    finished_req_ids: list[str]
    blocks_to_copy: list[tuple[int, int]]
    blocks_to_swap_out: list[tuple[int, int]]  # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]]  # (cpu block, device block)
    # structured outputs: the constrained sampling rows' token bitmask (structured_output/bitmask.py)
    grammar_req_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: Optional[bytes] = None  # int32 [len(grammar_req_ids) x ceil(V/32)], little-endian
    # speculative decoding: how many tokens the workers propose, after sampling, for each sampled request
    # (the scheduler's per-step choice; 0: none)
    num_tokens_to_propose: int = 0
    kv_connector_metadata: Optional[KVConnectorMetadata] = None  # the step's KV transfer plan (kv_transfer/)
    # data-parallel attention (core/dp_scheduler.py): each DP rank's own output, in DP-rank order; the
    # lists above are then their concatenation (the engine's view), and workers run their rank's part
    data_parallel: list[SchedulerOutput] = []
    # the scheduler's plan, for the live roofline (not read by the workers): the token budget the ITL budget
    # chose (core/step_budget.py; 0: none, max_num_batched_tokens alone), the step time it aimed at (0.0: no
    # decodes to protect, or no budget), the speculative draft length (-1: no speculation)
    token_budget: int = 0
    target_step_s: float = 0.0
    draft_length: int = -1

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    def for_workers(self) -> SchedulerOutput:
        """What the workers need: with data-parallel parts, the parts and the step-wide grammar bitmask
        only (the concatenated lists would travel twice)."""
        if not self.data_parallel:
            return self
        return SchedulerOutput(step=self.step, new_requests=[], scheduled=[], finished_req_ids=[], blocks_to_copy=[],
                               blocks_to_swap_out=[], blocks_to_swap_in=[], grammar_req_ids=self.grammar_req_ids,
                               grammar_bitmask=self.grammar_bitmask, data_parallel=self.data_parallel)

    def data_parallel_part(self, dp_rank: int) -> SchedulerOutput:
        """DP rank dp_rank's part, carrying the step's grammar bitmask (its rows are found by request id)."""
        part = self.data_parallel[dp_rank]
        part.grammar_req_ids, part.grammar_bitmask = self.grammar_req_ids, self.grammar_bitmask
        return part

    def restricted(self, req_ids: set[str], first: bool) -> SchedulerOutput:
        """The sub-step of the requests req_ids (fault isolation re-runs a step in parts): block moves,
        finished ids and the KV transfer plan go with the first part (repeating them is harmless)."""
        return SchedulerOutput(
            step=self.step, new_requests=[n for n in self.new_requests if n.req_id in req_ids],
            scheduled=[s for s in self.scheduled if s.req_id in req_ids],
            finished_req_ids=self.finished_req_ids if first else [],
            blocks_to_copy=self.blocks_to_copy if first else [],
            blocks_to_swap_out=self.blocks_to_swap_out if first else [],
            blocks_to_swap_in=self.blocks_to_swap_in if first else [],
            kv_connector_metadata=self.kv_connector_metadata if first else None,
            num_tokens_to_propose=self.num_tokens_to_propose,
            grammar_req_ids=self.grammar_req_ids, grammar_bitmask=self.grammar_bitmask,  # rows found by req id
            data_parallel=[p.restricted(req_ids, first) for p in self.data_parallel])


class PositionLogprobs(msgspec.Struct, array_like=True):
    """One position: token_ids[0] is the chosen/actual token, the rest the top-N; ranks are 1-based."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class StepParallelStats(msgspec.Struct, array_like=True):
    """What a distributed step cost in communication, and how evenly the experts were loaded (rank 0's view)."""

    collectives: dict[str, list[int]] = {}  # "<group>.<op>" -> [calls, bytes] issued this step
    expert_balancedness: list[float] = []  # per MoE layer after the last EPLB rebalance (empty: none yet)
    eplb_rebalances: int = 0  # rebalances so far
    # per MoE layer: the last rebalance's window under the placement it replaced (what the tokens did)
    expert_balancedness_before: list[float] = []


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]  # requests that sampled this step
    # per sampled request: one token, or with speculation the accepted drafts and then the target's token
    sampled_token_ids: list[list[int]]
    logprobs: list[Optional[list[PositionLogprobs]]]  # per sampled request, one per sampled token, when asked
    prompt_logprobs: dict[str, list[Optional[PositionLogprobs]]]  # per request, this chunk's positions
    # Requests that failed on the worker (e.g. their sampling state could not be set up): req_id -> error.
    # The engine fails them alone; they sampled nothing this step.
    failed: dict[str, str] = {}
    parallel: Optional[StepParallelStats] = None  # distributed runs only
    # speculative decoding: per sampled request (req_ids order), the tokens proposed for its next step
    draft_token_ids: list[list[int]] = []
    kv_connector_output: Optional[KVConnectorOutput] = None  # finished / failed KV transfers (kv_transfer/)


def merge_runner_outputs(parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One output from the outputs of disjoint sub-batches of a step."""
    out = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs={}, failed={})
    for p in parts:
        out.req_ids += p.req_ids
        out.sampled_token_ids += p.sampled_token_ids
        out.logprobs += p.logprobs
        out.prompt_logprobs.update(p.prompt_logprobs)
        out.failed.update(p.failed)
        if p.parallel is not None:
            if out.parallel is None:
                out.parallel = StepParallelStats()
            for name, (calls, nbytes) in p.parallel.collectives.items():
                c = out.parallel.collectives.setdefault(name, [0, 0])
                c[0] += calls
                c[1] += nbytes
            out.parallel.expert_balancedness = p.parallel.expert_balancedness
            out.parallel.eplb_rebalances = p.parallel.eplb_rebalances
            out.parallel.expert_balancedness_before = p.parallel.expert_balancedness_before
        out.draft_token_ids += p.draft_token_ids or [[] for _ in p.req_ids]
    out.kv_connector_output = merge_connector_outputs([p.kv_connector_output for p in parts])
    return out


encoder = msgspec.msgpack.Encoder()
scheduler_output_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
runner_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
