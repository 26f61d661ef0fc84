"""EngineCore: the heartbeat.  add_request / abort_requests / step().

step():  Scheduler.schedule() -> Executor.execute() -> Scheduler.update_from_output()
         -> OutputProcessor (detokenize, stop strings) -> RequestOutputs.
Not thread-safe: call it from one thread (the async server runs it in its own loop thread).

Batches in flight (pipeline parallelism): with an executor that takes several steps at once
(max_batches_in_flight > 1), step() first fills the pipeline -- schedules and submits steps while
fewer than that many are out and the scheduler finds work (requests in a step still in flight are
skipped, see Scheduler) -- then collects the oldest step's output and processes it as usual.

Fault isolation: an exception caused by one request fails that request alone (FINISHED_ERROR: its
blocks freed, its output carrying the error) and the engine serves the rest.  Per-request failures
the workers detect come back in ModelRunnerOutput.failed; any other exception from a step (except
ExecutorDeadError, which stops the engine) is narrowed down by re-running the step's requests in
halves until the failing ones run alone.  Re-running a step is safe: it writes the same K/V into the
same slots and repeats the same block moves.

Beam search is one request: SamplingParams(n=W, use_beam_search=True, length_penalty=..., max_tokens=...,
ignore_eos=...) through add_request (BeamSearchParams.sampling_params() builds it).  It starts as one engine
request whose id is the user's; the scheduler forks and ends the beams (core/beam_search.py), and the
request's single RequestOutput, when the search ends, carries the W best hypotheses best first
(CompletionOutput.score, cumulative_logprob).  abort_requests([request_id]) ends every live beam.

LoRA adapters (enable_lora, roofline/lora): add_request(..., lora_request=LoRARequest(...)) runs a request
under an adapter.  The adapter is checked here before the request is queued (lora/mapping.AdapterValidator:
its files, every tensor mapped onto the model, its rank), so a bad adapter is a ValueError naming it, never
the base model's output.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from roofline.config import EngineArgs, EngineConfig, GiB, finalize_lengths
from roofline.core.request import Request, RequestStatus
from roofline.core.dp_scheduler import DataParallelScheduler
from roofline.core.scheduler import Scheduler
from roofline.core.step_budget import StepBudget
from roofline.core.step_time import StepTimeModel
from roofline.core.scheduler_output import (
    ModelRunnerOutput,
    SchedulerOutput,
    StepParallelStats,
    merge_runner_outputs,
)
from roofline.core.spec_decode_stats import SpecDecodeStats
from roofline.engine.output_processor import OutputProcessor
from roofline.executor.base import ExecutorDeadError
from roofline.executor.factory import create_executor, runs_in_process
from roofline.kv_transfer import create_scheduler_connector, request_params
from roofline.metrics.step_roofline import StepRoofline, is_decode, model_for_engine
from roofline.model_executor.loader.source import load_hf_config, load_tokenizer, resolve_source
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.draft_length import DraftLengthPolicy
from roofline.spec_decode.factory import MODEL_BASED_METHODS
from roofline.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (max_waiting_requests); retry later."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # bytes of the model's weights as its layers compute on them, by format ("Q4_1", "float32"; rank 0)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    # live roofline: the steps since the previous snapshot (oldest first; empty when switched off)
    step_roofline: list[StepRoofline] = field(default_factory=list)
    # distributed runs: "<group>.<op>" -> [calls, bytes] since start (rank 0's), steps they cover,
    # per-layer expert balancedness after the last EPLB rebalance, rebalances so far
    collectives: dict[str, list[int]] = field(default_factory=dict)
    parallel_steps: int = 0
    expert_balancedness: list[float] = field(default_factory=list)
    eplb_rebalances: int = 0
    # per-layer balancedness of the last rebalance's window under the placement it replaced
    expert_balancedness_before: list[float] = field(default_factory=list)
    spec_decode: Optional[SpecDecodeStats] = None  # speculative decoding counters (cumulative), when on
    # KV transfer (kv_transfer/): bytes of KV loaded from / handed to other engines or the storage
    kv_transfer_bytes_received: int = 0
    kv_transfer_bytes_sent: int = 0
    # data-parallel attention: per DP rank, requests running / waiting now and user requests placed so far
    data_parallel_running: list[int] = field(default_factory=list)
    data_parallel_waiting: list[int] = field(default_factory=list)
    data_parallel_requests: list[int] = field(default_factory=list)
    # LoRA adapters (enable_lora): adapters per step (0: LoRA off), names of those running / waiting now
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)


def _adapter_names(requests) -> list[str]:
    """The LoRA adapters of these requests, each once, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


# steps kept for the next get_stats() (a caller that never asks keeps only the latest ones)
STEP_RECORDS_KEPT = 16384
# a step with nothing to compute while KV transfers are in flight waits this long before the next poll
TRANSFER_POLL_S = 0.002


def check_recurrent_state(config: EngineConfig) -> None:
    """A model with recurrent-state layers (linear attention: attention/kv_spec.recurrent_spec) keeps one state
    per running request, not per block.  What cannot work with that is refused here, naming the reason; prefix
    caching is turned off (a state at a block boundary is not kept, so a cached prefix could not be resumed)."""
    from roofline.model_executor.models.registry import resolve_architecture

    _, cls = resolve_architecture(config.model_config.hf_config)
    if not getattr(cls, "has_recurrent_state", False):
        return
    name = cls.__name__
    pc, sc = config.parallel_config, config.scheduler_config
    blockers = [
        (config.speculative_config is not None, "speculative decoding (rejected drafts would have advanced the "
                                                "recurrent state, which cannot be rolled back)"),
        (config.kv_transfer_config is not None, "KV transfer (the recurrent state is not in the transferred blocks)"),
        (pc.pipeline_parallel_size > 1, "pipeline parallelism (not built for recurrent-state layers)"),
        (pc.data_parallel_size > 1, "data-parallel attention (not built for recurrent-state layers)"),
        (sc.preemption_mode == "swap", "preemption_mode 'swap' (the recurrent state is not in the swapped blocks; "
                                       "use 'recompute')"),
        (config.lora_config is not None, "LoRA adapters (not built for this model)"),
    ]
    for blocked, why in blockers:
        if blocked:
            raise ValueError(f"{name} keeps a recurrent state per request (linear-attention layers); it cannot run "
                             f"with {why}")
    if config.cache_config.enable_prefix_caching:
        logger.info("%s: prefix caching off (its linear-attention layers' recurrent state is not kept per block)",
                    name)
        config.cache_config.enable_prefix_caching = False


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        mc = config.model_config
        t0 = time.monotonic()
        dc = config.device_config
        # a cold cache: the kernels compile while the config loads (here when this process runs the model;
        # rank processes build their own)
        if dc.device == "cpu" and dc.cpu_kernels and runs_in_process(config):
            from roofline.cpu import ops as cpu_ops

            cpu_ops.build_in_background(dc.cpu_isa)
        self.source = resolve_source(mc.model, mc.load_format)
        mc.model_path, mc.gguf_file = self.source.path, self.source.gguf_file
        mc.hf_config = load_hf_config(self.source)
        if mc.served_model_name is None:
            mc.served_model_name = self.source.name
        self.tokenizer = load_tokenizer(self.source, mc.tokenizer)
        finalize_lengths(config, int(mc.hf_config.max_position_embeddings))
        self.model_config = mc
        self.vocab_size = int(mc.hf_config.vocab_size)
        self.eos_token_id = self._eos_token_id()
        self._check_draft_model()
        check_recurrent_state(config)
        self.lora_validator = None
        if config.lora_config is not None:  # LoRA adapters: checked against the model before they are used
            from roofline.lora.mapping import AdapterValidator

            self.lora_validator = AdapterValidator(mc.hf_config, config.lora_config.max_lora_rank)
        self.executor = create_executor(config, self.source, show_progress)
        self.weight_bytes = self.executor.weight_bytes()
        num_blocks = self.executor.determine_num_blocks()
        kv_groups = self.executor.kv_group_windows()  # a hybrid KV layout's block-table groups ([]: one table)
        num_state_slots = self.executor.kv_state_slots()  # linear-attention layers' recurrent-state slots (0: none)
        cc, sc = config.cache_config, config.scheduler_config
        num_swap = int(cc.swap_space * GiB) // self.executor.block_bytes() if sc.preemption_mode == "swap" else 0
        self.executor.init_kv_cache(num_blocks, num_swap)
        dp = config.parallel_config.data_parallel_size
        # the per-step token budget (core/step_budget.py): on unless target_itl_ms is 0; not without chunked
        # prefill (a prompt goes whole) nor under data-parallel attention (the ranks step in lock step)
        budget_on = sc.target_itl_ms != 0 and sc.enable_chunked_prefill and dp == 1
        self.step_roofline = None
        if config.observability_config.step_roofline or config.speculative_config is not None or budget_on:
            from roofline.worker.worker import resolve_dtype

            dev = config.device_config.device
            dtype = str(resolve_dtype(mc.dtype, dev)).replace("torch.", "")
            self.step_roofline = model_for_engine(mc.hf_config, dev, dtype, cc.kv_cache_dtype,
                                                  config.parallel_config.tensor_parallel_size,
                                                  config.observability_config.roofline_hardware)
            if set(self.weight_bytes) - {dtype}:  # layers kept in GGUF blocks: the bytes they really hold
                self.step_roofline.use_weight_bytes(sum(self.weight_bytes.values()))
        # the step-time estimate the scheduler plans with (the token budget, the draft length), calibrated
        # after every step
        spec = config.speculative_config
        uses_step_time = budget_on or (spec is not None and spec.adaptive)
        self.step_time = StepTimeModel(self.step_roofline) if uses_step_time else None
        policy, lookahead = self._speculation()
        budget = None
        if budget_on:
            target = sc.target_itl_ms / 1e3 if sc.target_itl_ms is not None else None
            budget = StepBudget(self.step_time, target)
            logger.info("per-step token budget: prefill joins the decodes within %s, %d tokens at most",
                        f"{sc.target_itl_ms:g} ms" if target is not None else
                        f"{budget.factor:g}x the decode step of the batch being built", sc.max_num_batched_tokens)
        max_loras = config.lora_config.max_loras if config.lora_config is not None else None
        schedulers = [Scheduler(sc, cc, num_blocks, num_swap, seed=mc.seed, draft_length_policy=policy,
                                num_lookahead_slots=lookahead, kv_connector=create_scheduler_connector(config),
                                kv_group_windows=kv_groups, max_loras=max_loras, num_state_slots=num_state_slots,
                                step_budget=budget)
                      for _ in range(dp)]  # data-parallel attention: a scheduler and KV pool per DP rank
        self.scheduler = schedulers[0] if dp == 1 else DataParallelScheduler(schedulers)
        self.kv_events, self.kv_event_publisher = self._kv_events(config, schedulers)
        self.kv_capacity_tokens = schedulers[0].kv.capacity_tokens()  # sliding layers' windows counted
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self.pending_outputs: list[RequestOutput] = []
        self.group_children: dict[str, list[str]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._step_records: deque[StepRoofline] = deque(maxlen=STEP_RECORDS_KEPT)
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()  # submitted, not collected (oldest first)
        self.collectives: dict[str, list[int]] = {}
        self.parallel_steps = 0
        self.last_parallel: Optional[StepParallelStats] = None
        logger.info("engine ready in %.1f s: %s, max_model_len=%d, %d KV blocks%s",
                    time.monotonic() - t0, mc.served_model_name, mc.max_model_len, num_blocks,
                    f" in {len(kv_groups)} block-table groups (windows {sorted(set(kv_groups))}), "
                    f"{self.kv_capacity_tokens} tokens for one request" if kv_groups else "")

    def _check_draft_model(self) -> None:
        """A draft model must share the target's vocabulary (its token ids are the target's); MTP needs a
        DeepSeek-V3 checkpoint that carries MTP layers."""
        spec = self.config.speculative_config
        if spec is not None and spec.method == "mtp":
            hf = self.model_config.hf_config
            archs = list(getattr(hf, "architectures", None) or [])
            mtp_archs = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
            if not set(mtp_archs) & set(archs) and getattr(hf, "model_type", "") not in ("deepseek_v3", "deepseek_v32"):
                raise ValueError(f"speculative_config.method 'mtp' needs a DeepSeek-V3 / V3.2 checkpoint with MTP layers; "
                                 f"this model is {archs[0] if archs else hf.model_type}")
            if int(getattr(hf, "num_nextn_predict_layers", 0) or 0) < 1:
                raise ValueError("speculative_config.method 'mtp' needs a checkpoint with MTP layers "
                                 "(num_nextn_predict_layers >= 1); this model has none")
            return
        if spec is None or spec.method != "draft_model":
            return
        try:
            draft_config = load_hf_config(resolve_source(spec.model, "auto"))
        except Exception as e:
            raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from None
        draft_vocab = int(draft_config.vocab_size)
        if draft_vocab != self.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft_vocab} tokens) differs "
                             f"from the target's ({self.vocab_size})")

    def _speculation(self):
        """Speculative decoding: the scheduler's DraftLengthPolicy (adaptive: the roofline's step-time
        estimate) and lookahead slots (a model-based proposer writes its drafts' KV there)."""
        spec = self.config.speculative_config
        if spec is None:
            return None, 0
        lookahead = spec.num_speculative_tokens if spec.method in MODEL_BASED_METHODS else 0
        return DraftLengthPolicy(spec.num_speculative_tokens, self.step_time if spec.adaptive else None), lookahead

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True) -> "EngineCore":
        return cls(args.create_engine_config(), show_progress)

    def _eos_token_id(self) -> Optional[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos

    # ---- intake -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, lora_request=None) -> SamplingParams:
        """Raise ValueError naming the offending values; returns params with max_tokens resolved."""
        self.check_lora(lora_request)
        n = len(prompt_token_ids)
        max_len = self.model_config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of range for a vocabulary of {self.vocab_size}")
        if n >= max_len:
            raise ValueError(f"the prompt ({n} tokens) is too long: max_model_len is {max_len}, "
                             "which leaves no room for a generated token")
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = max_len - n
        if n + params.max_tokens > max_len:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len ({max_len})"
            )
        lookahead = self.scheduler.num_lookahead_slots  # a draft model's slots past the last token
        if n + params.max_tokens + lookahead > self.kv_capacity_tokens:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens})"
                + (f" plus the draft model's {lookahead} lookahead slots" if lookahead else "")
                + f" exceeds the KV cache capacity ({self.kv_capacity_tokens} tokens)"
            )
        kv = self.scheduler.kv if hasattr(self.scheduler, "kv") else None
        if kv is not None and kv.grouped and not self.config.scheduler_config.enable_chunked_prefill:
            whole = kv.num_groups * -(-n // self.config.cache_config.block_size)  # one chunk: every group's blocks
            if whole > kv.pool.num_blocks:
                raise ValueError(f"the prompt ({n} tokens) needs {whole} KV blocks in one prefill (chunked prefill is "
                                 f"off) and the pool has {kv.pool.num_blocks}")
        if params.use_beam_search and self.config.speculative_config is not None:
            raise ValueError("use_beam_search does not run with speculative decoding")
        if params.use_beam_search and 2 * params.n > self.vocab_size:
            raise ValueError(f"beam_width (n) {params.n}: a step weighs each beam's top 2 * beam_width tokens, "
                             f"more than the vocabulary's {self.vocab_size}")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer, and this model has none")
        if params.kv_transfer_params is not None:
            request_params(self.scheduler.kv_transfer, params, params.n)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} out of range for a vocabulary of {self.vocab_size}")
        return params

    def check_lora(self, lora_request) -> None:
        """A request's adapter: None, or one this engine can apply (ValueError naming it otherwise)."""
        if lora_request is None:
            return
        if self.lora_validator is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} asked for, but "
                             "LoRA is not enabled (enable_lora / --enable-lora)")
        self.lora_validator.check(lora_request)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: Optional[str] = None, arrival_time: Optional[float] = None,
                    priority: int = 0, cache_salt: Optional[str] = None, lora_request=None) -> None:
        if request_id in self.group_children:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.validate(list(prompt_token_ids), params, lora_request)
        limit = self.config.scheduler_config.max_waiting_requests
        if limit is not None and self.scheduler.get_stats().num_waiting >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests)")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.use_beam_search:  # the first beam, under the user's id; the scheduler forks the others
            root = Request(request_id, prompt_token_ids, params, self.eos_token_id, arrival, priority, cache_salt,
                           lora_request=lora_request)
            self.output_processor.add_group(request_id, prompt, prompt_token_ids, params, [None] * params.n, arrival)
            self.group_children[request_id] = [request_id]  # finish_requests takes a beam search's id
            self.scheduler.add_request(root)
            return
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        reqs = [
            Request(cid, prompt_token_ids, params, self.eos_token_id, arrival, priority, cache_salt,
                    group_id=request_id, index=i, lora_request=lora_request)
            for i, cid in enumerate(child_ids)
        ]
        if params.structured_outputs is not None:  # the compile starts now (or is cached); the request waits
            stops = ([] if params.ignore_eos or self.eos_token_id is None else [self.eos_token_id])
            grammars = self.structured_output.grammars_for(params.structured_outputs, stops + params.stop_token_ids,
                                                           len(reqs))
            for r, g in zip(reqs, grammars):
                r.grammar = g
        if params.kv_transfer_params is not None:
            reqs[0].kv_transfer = request_params(self.scheduler.kv_transfer, params, len(reqs))
        for child in reqs[1:]:
            child.status = RequestStatus.WAITING_FOR_FORK
        reqs[0].forks_pending = reqs[1:]
        self.output_processor.add_group(request_id, prompt, prompt_token_ids, params, child_ids, arrival)
        self.group_children[request_id] = child_ids
        for r in reqs:
            self.scheduler.add_request(r)
            self.structured_output.track(r)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests now (their blocks return to the pool); a final output follows on step()."""
        for gid in request_ids:
            self._end_group(gid, RequestStatus.FINISHED_ABORTED)

    def _end_group(self, gid: str, status: RequestStatus, error: Optional[str] = None,
                   error_param: Optional[str] = None) -> None:
        """Finish every completion of user request gid now (blocks back to the pool) and queue its
        final output, carrying `error` when it failed (and error_param when the request's own input, that
        field, caused it)."""
        children = self.group_children.pop(gid, None)
        if children is None:
            return
        self.scheduler.finish_requests(children, status)
        self.output_processor.abort_group(gid, time.monotonic(), status.finish_reason)
        out = self.output_processor.make_output(gid, set())
        if out is not None:
            out.error, out.error_param = error, error_param
            self.pending_outputs.append(out)

    def _fail_requests(self, failed: dict[str, str], params: Optional[dict[str, str]] = None) -> None:
        """Fail the user requests owning these engine requests (req_id -> error), alone; params: req_id ->
        the request field at fault, for errors the request's own input caused."""
        for rid, error in failed.items():
            req = self.scheduler.requests.get(rid)  # a beam is known to the scheduler only
            gid = req.group_id if req is not None else self.output_processor.group_of(rid)
            if gid is not None and gid in self.group_children:
                logger.warning("request %s failed, the engine carries on: %s", gid, error)
                self._end_group(gid, RequestStatus.FINISHED_ERROR, error, (params or {}).get(rid))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.pending_outputs) or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.group_children)

    # ---- the heartbeat ------------------------------------------------------------------------
    def _structured_output_intake(self) -> None:
        """Fail the requests whose grammar did not compile; idle briefly while only compiles are pending."""
        so, sched = self.structured_output, self.scheduler
        for f in so.take_failed():
            self._end_group(f.request.group_id, RequestStatus.FINISHED_ERROR, f.error, f.param)
        if so.pending and not sched.running and not sched.swapped and len(sched.waiting) == len(so.pending):
            so.wait_for_compile(timeout=0.05)

    def _kv_events(self, config: EngineConfig, schedulers) -> tuple:
        """(the recorder the KV pool reports to, the ZMQ publisher), or (None, None): --kv-events-config."""
        ev = config.kv_events_config
        if ev is None or not ev.publishes:
            return None, None
        if len(schedulers) > 1:
            raise ValueError("kv_events_config with data_parallel_size > 1 is not supported yet (one event stream "
                             "per engine: run one engine per data-parallel rank)")
        from roofline.core.kv_events import KVEventRecorder
        from roofline.engine.kv_event_publisher import ZmqEventPublisher

        medium = "GPU" if config.device_config.device.startswith("cuda") else "CPU"
        recorder = KVEventRecorder(config.cache_config.block_size, medium)
        schedulers[0].kv.pool.events = recorder
        return recorder, ZmqEventPublisher(ev)

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.kv_events is not None:
            events = self.kv_events.drain()
            if events:
                from roofline.core.kv_events import KVEventBatch

                self.kv_event_publisher.publish(KVEventBatch(time.time(), events))
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.structured_output.pending:
            self._structured_output_intake()
        if self.executor.max_batches_in_flight > 1:
            return self._step_pipelined()
        if not self.scheduler.has_unfinished_requests():
            outputs, self.pending_outputs = self.pending_outputs, []
            return outputs
        t_start = time.perf_counter()
        sched_out = self._schedule()
        return self._finish_step(sched_out, self._execute_isolating(sched_out), t_start)

    def _schedule(self, max_requests: Optional[int] = None) -> SchedulerOutput:
        sched_out = self.scheduler.schedule(max_requests)
        self.structured_output.attach_bitmask(sched_out, self.scheduler.requests)
        now = time.monotonic()
        requests = self.scheduler.requests
        for item in sched_out.scheduled:
            self.output_processor.mark_scheduled(requests[item.req_id].group_id, now)
        return sched_out

    def _step_pipelined(self) -> list[RequestOutput]:
        """Fill the pipeline up to max_batches_in_flight steps, then finish the oldest one.  Each step
        takes at most 1/max_batches_in_flight of the requests, so that every stage has a batch to run."""
        depth = self.executor.max_batches_in_flight
        while len(self._in_flight) < depth and self.scheduler.has_unfinished_requests():
            t_start = time.perf_counter()
            s = self.scheduler
            share = -(-(len(s.running) + len(s.waiting) + len(s.swapped)) // depth)
            out = self._schedule(max(share, 1))
            if not (out.scheduled or out.finished_req_ids or out.blocks_to_copy or out.blocks_to_swap_out
                    or out.blocks_to_swap_in):
                break  # every runnable request is in flight
            self.executor.submit(out)
            self._in_flight.append((out, t_start))
        if not self._in_flight:
            outputs, self.pending_outputs = self.pending_outputs, []
            return outputs
        sched_out, t_start = self._in_flight.popleft()
        try:
            result = self.executor.collect()
        except ExecutorDeadError:
            raise
        except Exception as e:  # the step's requests fail; with steps in flight there is no re-running in halves
            logger.exception("step %d failed", sched_out.step)
            result = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs={},
                                       failed={s.req_id: f"{type(e).__name__}: {e}" for s in sched_out.scheduled})
        return self._finish_step(sched_out, result, t_start)

    def _finish_step(self, sched_out: SchedulerOutput, result: ModelRunnerOutput, t_start: float) -> list[RequestOutput]:
        """The step's results into the scheduler, the output processor and RequestOutputs."""
        if result.parallel is not None:
            self._record_parallel(result.parallel)
        if result.failed:
            self._fail_requests(result.failed)
        touched = self.scheduler.update_from_output(sched_out, result)
        transfers = self.scheduler.kv_transfer
        if transfers is not None and transfers.failed:
            self._fail_requests(transfers.take_failed())
        grammar_failed = self.structured_output.accept(touched)
        now = time.monotonic()
        op = self.output_processor
        for rid, entries in result.prompt_logprobs.items():
            op.record_prompt_logprobs(rid, entries)
        lp_by_req = dict(zip(result.req_ids, result.logprobs))
        by_group: dict[str, set[int]] = {}
        stopped: list[str] = []
        failed: dict[str, str] = {}
        for req, k in touched:
            if k == 0:
                continue
            new_tokens = req.output_token_ids[-k:]
            if req.num_output_tokens == k and req.index == 0:
                self.prompt_tokens += req.num_prompt_tokens
            self.generation_tokens += k
            lp = lp_by_req.get(req.request_id)
            try:
                stop = op.process(req, new_tokens, lp[:k] if lp is not None else None, now)
            except Exception as e:  # detokenizing this request failed: it alone fails
                failed[req.request_id] = f"output processing failed: {type(e).__name__}: {e}"
                continue
            if stop is not None:
                req.stop_reason = stop
                stopped.append(req.request_id)
            by_group.setdefault(req.group_id, set()).add(req.index)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if failed:
            self._fail_requests(failed)
        outputs, self.pending_outputs = self.pending_outputs, []
        outputs += self._finished_beam_searches(now)
        for gid, idxs in by_group.items():
            if gid not in self.group_children:
                continue  # failed above: its final output is already out
            out = op.make_output(gid, idxs)
            if out is not None:
                outputs.append(out)
                if out.finished:
                    self.group_children.pop(gid, None)
                    if transfers is not None:
                        out.kv_transfer_params = transfers.take_result(gid)
        if grammar_failed:  # nothing to sample next step: fail them now, after this step's tokens went out
            self._fail_requests({f.request.request_id: f.error for f in grammar_failed if not f.request.is_finished},
                                {f.request.request_id: f.param for f in grammar_failed if f.param})
            outputs += self.pending_outputs
            self.pending_outputs = []
        if not sched_out.scheduled and transfers is not None and transfers.busy:
            time.sleep(TRANSFER_POLL_S)  # only transfers in flight: poll them without spinning a core
        self._account_step(sched_out, time.perf_counter() - t_start, now)
        return outputs

    def _account_step(self, sched_out: SchedulerOutput, seconds: float, now: float) -> None:
        """The step against its bound (the live roofline's record), and its measured time into the step-time
        estimate the scheduler plans with."""
        keep = self.config.observability_config.step_roofline
        if self.step_roofline is None or not sched_out.scheduled or not (keep or self.step_time is not None):
            return
        record = self.step_roofline.account(sched_out.scheduled, seconds, now, self.scheduler.kv_cache_usage())
        if self.step_time is not None:
            n, p = record.prefill_tokens + record.decode_tokens, record.prefill_tokens
            decodes = [(s.num_computed_tokens, len(s.token_ids)) for s in sched_out.scheduled
                       if is_decode(len(s.token_ids), s.num_draft_tokens)] if p else ()
            record.predicted_s = self.step_time.finished(n, seconds, record.bound_s, p, decodes)
            record.tail_margin = self.step_time.tail_margin()
        if keep:
            record.token_budget, record.target_s = sched_out.token_budget, sched_out.target_step_s
            record.draft_length = sched_out.draft_length
            self._step_records.append(record)

    def _finished_beam_searches(self, now: float) -> list[RequestOutput]:
        """The final outputs of the beam searches that ended this step."""
        outputs = []
        for group in self.scheduler.take_finished_beam_groups():
            gid = group.group_id
            if self.group_children.pop(gid, None) is None:
                continue  # failed or aborted meanwhile: its final output is already out
            self.prompt_tokens += group.root.num_prompt_tokens
            self.generation_tokens += group.num_scored
            out = self.output_processor.finish_beam_group(gid, group.search.finished, group.root.num_cached_tokens,
                                                          group.root.num_preemptions, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _record_parallel(self, p: StepParallelStats) -> None:
        self.parallel_steps += 1
        self.last_parallel = p
        for name, (calls, nbytes) in p.collectives.items():
            c = self.collectives.setdefault(name, [0, 0])
            c[0] += calls
            c[1] += nbytes

    def _execute_isolating(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """executor.execute(out); if it raises (other than ExecutorDeadError), the step's requests run
        again in halves until every failing request has run alone: those fail, the rest get their tokens."""
        try:
            return self.executor.execute(out)
        except ExecutorDeadError:
            raise
        except Exception as e:
            if len(out.scheduled) <= 1:
                logger.exception("step %d failed", out.step)
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs={},
                                         failed={s.req_id: f"{type(e).__name__}: {e}" for s in out.scheduled})
            logger.warning("step %d failed (%s: %s); isolating the request(s) that cause it", out.step,
                           type(e).__name__, e)
        half = len(out.scheduled) // 2
        parts = []
        for i, items in enumerate((out.scheduled[:half], out.scheduled[half:])):
            sub = out.restricted({s.req_id for s in items}, first=i == 0)
            parts.append(self._execute_isolating(sub))
        return merge_runner_outputs(parts)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            data_parallel_running=s.data_parallel_running, data_parallel_waiting=s.data_parallel_waiting,
            data_parallel_requests=s.data_parallel_requests,
            num_running=s.num_running, num_waiting=s.num_waiting + s.num_swapped,
            kv_cache_usage=s.kv_cache_usage, num_total_blocks=s.num_total_blocks,
            num_free_blocks=s.num_free_blocks, num_cached_blocks=s.num_cached_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, weight_bytes=dict(self.weight_bytes),
            step_roofline=self._drain_step_records(),
            spec_decode=s.spec_decode.copy() if s.spec_decode is not None else None,
            kv_transfer_bytes_received=self.scheduler.kv_transfer.bytes_received if self.scheduler.kv_transfer else 0,
            kv_transfer_bytes_sent=self.scheduler.kv_transfer.bytes_sent if self.scheduler.kv_transfer else 0,
            collectives={k: list(v) for k, v in self.collectives.items()}, parallel_steps=self.parallel_steps,
            expert_balancedness=list(self.last_parallel.expert_balancedness) if self.last_parallel else [],
            eplb_rebalances=self.last_parallel.eplb_rebalances if self.last_parallel else 0,
            expert_balancedness_before=(list(self.last_parallel.expert_balancedness_before)
                                        if self.last_parallel else []),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        """EngineStats' LoRA fields (LoRA runs on one scheduler: data parallelism is refused with it)."""
        if self.config.lora_config is None:
            return {}
        sched = self.scheduler
        return dict(max_lora=self.config.lora_config.max_loras, running_lora_adapters=_adapter_names(sched.running),
                    waiting_lora_adapters=_adapter_names(list(sched.waiting) + list(sched.swapped)))

    def _drain_step_records(self) -> list[StepRoofline]:
        records = list(self._step_records)
        self._step_records.clear()
        return records

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()
