"""Engine configuration: one place for every knob, named as vLLM names its flags.

`EngineArgs` is the flat, user-facing form (what `LLM(**kwargs)` and `roofline serve --flags` take);
`EngineArgs.create_engine_config()` validates it and splits it into the parts each module owns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from roofline.json_config import json_fields

GiB = 1 << 30
QUANTIZED_WEIGHTS = ("native", "dequantize")  # how quantized layers (GGUF blocks, FP8 blocks) are computed
FP8_GEMMS = ("auto", "w8a8", "weight_only")  # the CUDA route of FP8 block weights
CPU_ISAS = ("auto", "avx512", "avx2", "neon", "portable")  # builds of the native CPU kernels
GGUF_ACTIVATIONS = ("fp32", "q8")  # what the native kernels multiply the blocks with


@dataclass
class ModelConfig:
    model: Optional[str]  # HF directory, .gguf file, or None for the embedded default
    tokenizer: Optional[str] = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    quantized_weights: str = "native"  # native (layers computed on GGUF / FP8 blocks) | dequantize (at load)
    gguf_activations: str = "fp32"  # fp32 | q8 (native blocks: 8-bit activations, integer dot products)
    fp8_gemm: str = "auto"  # CUDA, FP8 blocks: auto | w8a8 | weight_only
    max_model_len: Optional[int] = None
    served_model_name: Optional[str] = None
    trust_remote_code: bool = False
    hf_config: Any = None  # the model's HF config (hf_config.ConfigSnapshot), filled by the loader
    # Resolved at config time
    model_path: Optional[str] = None  # directory holding config/tokenizer
    gguf_file: Optional[str] = None  # file name inside model_path when loading GGUF


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # force the pool size (blocks of every layer; see worker.determine_num_blocks)
    kv_cache_memory: Optional[int] = None  # bytes for the KV pool (CPU); default: 2 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True  # sliding-window layers in their own block tables (attention/kv_spec.plan_layout)
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    kv_cache_dtype: str = "auto"


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    enable_chunked_prefill: bool = True
    max_waiting_requests: Optional[int] = None
    # the per-step token budget (core/step_budget.py): prefill tokens join a step's decodes while its predicted
    # time stays within this inter-token latency target, in ms; None: 1.25x the decode step of the batch being
    # built; 0: off (max_num_batched_tokens every step; the offline LLM class's default, engine/llm.py)
    target_itl_ms: Optional[float] = None


ALL2ALL_BACKENDS = ("all_to_all", "allgather_reducescatter")


@dataclass
class EPLBConfig:
    """Expert-parallel load balancing (--eplb-config JSON, vLLM's names)."""

    window_size: int = 1000  # steps of per-expert token counts the rebalance looks at
    step_interval: int = 3000  # steps between rebalances
    num_redundant_experts: int = 0  # extra physical expert slots per MoE layer, given to hot experts
    log_balancedness: bool = False  # log mean/max tokens per rank per layer at every rebalance

    @classmethod
    def from_json(cls, text: Optional[str]) -> "EPLBConfig":
        import json

        if not text:
            return cls()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"eplb_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("eplb_config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"eplb_config: unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**d)
        for name in ("window_size", "step_interval"):
            if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) <= 0:
                raise ValueError(f"eplb_config.{name} must be a positive integer, got {getattr(cfg, name)!r}")
        if not isinstance(cfg.num_redundant_experts, int) or cfg.num_redundant_experts < 0:
            raise ValueError(f"eplb_config.num_redundant_experts must be an integer >= 0, "
                             f"got {cfg.num_redundant_experts!r}")
        return cfg


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: Optional[str] = None  # "a,b,...": layers per pipeline stage; None: even split
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE layers: whole experts spread over DP x TP ranks
    all2all_backend: str = "all_to_all"  # expert-parallel dispatch/combine: see ALL2ALL_BACKENDS
    enable_eplb: bool = False
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    enable_dbo: bool = False  # dual-batch overlap of the expert exchanges (moe/expert_parallel.py)
    dbo_decode_token_threshold: int = 32  # DBO for steps of decodes alone with at least this many tokens
    dbo_prefill_token_threshold: int = 512  # DBO for steps holding a prefill with at least this many tokens
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    distributed_backend: Optional[str] = None  # gloo on CPU, nccl on CUDA when None
    distributed_executor_backend: str = "mp"  # mp: processes started here (and `roofline worker`) | ray: Ray actors
    ray_placement_strategy: str = "PACK"  # the ranks' placement group (executor/ray_executor.py)
    ray_placement_timeout: float = 60.0  # seconds to wait for the placement group before failing

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass
class DeviceConfig:
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    enforce_eager: bool = False
    # the CPU fast paths (one place: the worker applies them, worker.apply_cpu_settings)
    cpu_kernels: bool = True  # the native C kernels (cpu/ops.py); off: torch ops
    cpu_isa: str = "auto"  # the kernels' build: auto (the best this CPU runs) | avx512 | avx2 | neon | portable
    cpu_layer_stack: bool = True  # Llama-family decoder stack in one native call (llama_cpu_stack.py)
    cpu_greedy_head: bool = True  # greedy rows' LM head through the int8 screen (greedy_head.py)
    cpu_moe_kernels: bool = True  # native per-expert GEMMs (moe/cpu_experts.py)
    cpu_reuse_freed_memory: bool = True  # glibc keeps freed activation buffers for reuse (worker.py)


@dataclass
class ObservabilityConfig:
    step_roofline: bool = True  # account every step's bytes/FLOPs against the device's bound
    roofline_hardware: Optional[str] = None  # planner preset for the bound; None: GPU preset or measured


EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
UNIMPLEMENTED_SPECULATIVE_METHODS: tuple[str, ...] = ()
MAX_SPECULATIVE_TOKENS = 16
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                    "draft_tensor_parallel_size", "adaptive")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` dict): who proposes and how many tokens."""

    method: str  # ngram | draft_model | mtp
    num_speculative_tokens: int  # k: the most tokens proposed per request per step
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int = 5  # ngram: longest suffix n-gram matched (tried first)
    model: Optional[str] = None  # draft_model: the draft checkpoint
    draft_tensor_parallel_size: Optional[int] = None  # the draft runs on the target's ranks, split the same way
    adaptive: bool = True  # pick k per step from the cost model and the running acceptance rate

    @classmethod
    def from_dict(cls, d: Any) -> "SpeculativeConfig":
        """Validate the user's dict; a ValueError names the offending field."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {list(SPECULATIVE_KEYS)}")
        method = d.get("method")
        if method is None and d.get("model") is not None:
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if method in UNIMPLEMENTED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {method!r} is not implemented yet; use one of "
                             f"{[m for m in SPECULATIVE_METHODS if m not in UNIMPLEMENTED_SPECULATIVE_METHODS]}")
        k = d.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        elif lo is None:
            lo = min(cls.prompt_lookup_min, hi) if _is_int(hi) else hi
        elif hi is None:
            hi = max(cls.prompt_lookup_max, lo) if _is_int(lo) else lo
        if not _is_int(lo) or lo < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be an integer >= 1, got {lo!r}")
        if not _is_int(hi) or hi < lo:
            raise ValueError(f"speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min "
                             f"({lo}), got {hi!r}")
        model = d.get("model")
        if method == "draft_model" and not model:
            raise ValueError("speculative_config.model is required for method 'draft_model'")
        if method != "draft_model" and model is not None:
            raise ValueError(f"speculative_config.model applies to method 'draft_model' only, not {method!r}")
        dtp = d.get("draft_tensor_parallel_size")
        if dtp is not None and (not _is_int(dtp) or dtp < 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be an integer >= 1, got {dtp!r}")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        return cls(method, k, lo, hi, model, dtp, adaptive)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class LoRAConfig:
    """Serving LoRA adapters (roofline/lora; vLLM's flags): how many run in one step, the largest rank
    and how many stay loaded."""

    max_loras: int = 1  # adapters in one step (each a slot in every LoRA layer)
    max_lora_rank: int = 16  # the slots' rank; an adapter of higher rank is refused
    max_cpu_loras: int = 1  # adapters kept loaded on the CPU (an LRU); at least max_loras


@dataclass
class KVEventsConfig:
    """KV-cache events for a router's prefix-aware scoring (`--kv-events-config`, vLLM's JSON shape and
    defaults): core/kv_events.py's events, published over ZMQ by engine/kv_event_publisher.py -- a PUB socket at
    `endpoint` (multipart: topic, 8-byte big-endian sequence number, msgpack KVEventBatch) and, when
    `replay_endpoint` is set, a ROUTER socket answering a sequence number with the batches from it on (the
    last `buffer_steps`), then an empty frame."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # "zmq" | "null"; default: "zmq" when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value) -> "KVEventsConfig":
        """From vLLM's JSON text or a dict; an unknown field is an error naming it."""
        return cls(**json_fields(value, "kv_events_config", {f.name for f in dataclasses.fields(cls)}))


KV_CONNECTORS = ("SharedStorageConnector", "P2pConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """Which KV connector an engine runs and in what role (`--kv-transfer-config`, vLLM's JSON shape;
    the connectors are in kv_transfer/):

        --kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer",
                               "kv_ip": "127.0.0.1", "kv_port": 14579,
                               "kv_connector_extra_config": {"send_timeout_s": 120}}'

    Roles: kv_producer computes prompts and hands their KV on (a prefill engine), kv_consumer receives KV
    (a decode engine), kv_both does both (a colocated engine with a persistent KV tier).
    """

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # P2pConnector: where a producer serves its blocks (0: a free port)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    # a load that fails (source gone, transfer timed out): recompute the prompt here, or fail the request
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        obj = json_fields(text, "kv_transfer_config", set(cls.__dataclass_fields__))
        missing = {"kv_connector", "kv_role"} - set(obj)
        if missing:
            raise ValueError(f"kv_transfer_config needs {sorted(missing)}")
        return cls(**obj)




@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    speculative_config: Optional[SpeculativeConfig] = None
    kv_transfer_config: Optional[KVTransferConfig] = None  # a KV connector (kv_transfer/), if any
    lora_config: Optional[LoRAConfig] = None  # LoRA adapters (enable_lora), if served
    kv_events_config: Optional[KVEventsConfig] = None  # KV-cache events for a router, if published
    # the server runs EngineCore in a process of its own (engine/core_process.py), apart from HTTP and
    # tokenization; offline LLM(...) always runs it in-process.  On by default: W2 at saturation on
    # the default model (CPU) gave 1.8x the output tokens/s of the engine thread sharing the server's GIL
    engine_core_process: bool = True


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch always present in practice
        return "cpu"


@dataclass
class EngineArgs:
    """Flat engine arguments, vLLM-compatible names."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    seed: int = 0
    device: Optional[str] = None
    load_format: str = "auto"
    quantized_weights: str = "native"
    gguf_weights: Optional[str] = None  # the old name of quantized_weights
    gguf_activations: str = "fp32"
    fp8_gemm: str = "auto"
    max_model_len: Optional[int] = None
    served_model_name: Optional[str] = None
    trust_remote_code: bool = False
    # cache
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True
    swap_space: float = 4.0
    kv_cache_dtype: str = "auto"
    # scheduler
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    max_waiting_requests: Optional[int] = None
    target_itl_ms: Optional[float] = None
    # parallel
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: Optional[str] = None
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "all_to_all"
    enable_eplb: bool = False
    eplb_config: Optional[str] = None
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    distributed_backend: Optional[str] = None
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout: float = 60.0
    # device
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cpu_kernels: bool = True
    cpu_isa: str = "auto"
    cpu_layer_stack: bool = True
    cpu_greedy_head: bool = True
    cpu_moe_kernels: bool = True
    cpu_reuse_freed_memory: bool = True
    # observability
    step_roofline: bool = True
    roofline_hardware: Optional[str] = None
    # speculative decoding: vLLM's dict (method, num_speculative_tokens, prompt_lookup_min/max, model, ...)
    speculative_config: Optional[dict] = None
    # KV transfer (prefill/decode disaggregation): vLLM's --kv-transfer-config JSON (or a dict)
    kv_transfer_config: Optional[str] = None
    # KV-cache events for a router's prefix-aware scoring: vLLM's --kv-events-config JSON (or a dict)
    kv_events_config: Optional[str] = None
    # LoRA adapters (roofline/lora)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # default: max_loras
    # server
    engine_core_process: bool = True

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {sorted(unknown)}; known: {sorted(cls.field_names())}"
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        errors = []
        if self.block_size <= 0:
            errors.append(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            errors.append(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            errors.append(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            errors.append(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            errors.append(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) <= 0:
                errors.append(f"{name} must be positive, got {getattr(self, name)}")
        errors.extend(self._executor_errors())
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            errors.append(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {self.all2all_backend!r}")
        if self.enable_eplb and not self.enable_expert_parallel:
            errors.append("enable_eplb needs enable_expert_parallel")
        if self.enable_dbo and not self.enable_expert_parallel:
            errors.append("enable_dbo needs enable_expert_parallel (it overlaps the expert-parallel exchanges)")
        if self.enable_dbo and self.all2all_backend != "all_to_all":
            errors.append(f"enable_dbo needs all2all_backend 'all_to_all' (its dispatch and combine are what "
                          f"overlap), got {self.all2all_backend!r}")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 2:
                errors.append(f"{name} must be at least 2 (two micro-batches), got {getattr(self, name)}")
        if self.data_parallel_size > 1 and self.pipeline_parallel_size > 1:
            errors.append("data_parallel_size > 1 needs pipeline_parallel_size 1 (data-parallel attention runs "
                          "each DP rank's batch on one stage)")
        try:
            eplb = EPLBConfig.from_json(self.eplb_config)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
        if self.pp_layer_partition is not None and self.pipeline_parallel_size >= 1:
            try:
                parse_partition(self.pp_layer_partition, self.pipeline_parallel_size)
            except ValueError as e:
                errors.append(str(e))
        for name in ("quantized_weights", "gguf_weights"):
            value = getattr(self, name)
            if value is not None and value not in QUANTIZED_WEIGHTS:
                errors.append(f"{name} must be one of {', '.join(QUANTIZED_WEIGHTS)}, got {value!r}")
        if self.gguf_weights is not None and self.quantized_weights not in (self.gguf_weights, "native"):
            errors.append(f"gguf_weights ({self.gguf_weights!r}) is the old name of quantized_weights "
                          f"({self.quantized_weights!r}): give one")
        if self.fp8_gemm not in FP8_GEMMS:
            errors.append(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)}, got {self.fp8_gemm!r}")
        if self.cpu_isa not in CPU_ISAS:
            errors.append(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            errors.append(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}, "
                          f"got {self.gguf_activations!r}")
        if self.swap_space < 0:
            errors.append(f"swap_space must be >= 0, got {self.swap_space}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            errors.append(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.target_itl_ms:  # None: the default target; 0: the budget off
            if self.target_itl_ms < 0:
                errors.append(f"target_itl_ms must be positive (0: off), got {self.target_itl_ms}")
            if not self.enable_chunked_prefill:
                errors.append("target_itl_ms needs chunked prefill (a prompt that must go whole cannot be cut to "
                              "fit a step)")
            if self.data_parallel_size > 1:
                errors.append("target_itl_ms needs data_parallel_size 1 (the DP ranks step in lock step: one "
                              "rank's batch does not predict the step's time)")
        if self.roofline_hardware not in (None, "measure"):
            # An import that runs back up, on purpose: the presets are the planner's own table (its cost model
            # and the live roofline read them), and the planner sits above config (its probes run the CPU
            # kernels, which read config).  Lazy, and pure data: checking the flag loads no torch.
            from roofline.planner.hardware import get_hardware

            try:
                get_hardware(self.roofline_hardware)
            except ValueError as e:
                errors.append(f"roofline_hardware must be 'measure' or a planner preset: {e}")
        speculative = None
        if self.speculative_config is not None:
            try:
                speculative = SpeculativeConfig.from_dict(self.speculative_config)
            except ValueError as e:
                errors.append(str(e))
            else:
                tp = self.tensor_parallel_size
                if speculative.draft_tensor_parallel_size is None:
                    speculative.draft_tensor_parallel_size = tp
                elif speculative.draft_tensor_parallel_size != tp:
                    errors.append(f"speculative_config.draft_tensor_parallel_size must equal tensor_parallel_size "
                                  f"({tp}): the draft runs on the target's ranks; got "
                                  f"{speculative.draft_tensor_parallel_size}")
                if self.pipeline_parallel_size > 1 or self.data_parallel_size > 1:
                    errors.append("speculative_config needs pipeline_parallel_size 1 and data_parallel_size 1 "
                                  "(the draft runs beside one tensor-parallel group)")
        kv_transfer = None
        if self.kv_transfer_config is not None:
            try:
                kv_transfer = (KVTransferConfig(**self.kv_transfer_config) if isinstance(self.kv_transfer_config, dict)
                               else KVTransferConfig.from_json(self.kv_transfer_config))
            except (TypeError, ValueError) as e:
                errors.append(str(e))
            if (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.data_parallel_size > 1
                    or self.nnodes > 1):
                errors.append("kv_transfer_config needs tensor_parallel_size, pipeline_parallel_size and "
                              "data_parallel_size 1 (a KV connector serves one pool)")
        lora = self._lora_config(errors)
        kv_events = None
        if self.kv_events_config is not None:
            try:
                kv_events = KVEventsConfig.parse(self.kv_events_config)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        if errors:
            raise ValueError("invalid engine arguments: " + "; ".join(errors))
        device = self.device or _default_device()
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            load_format=self.load_format,
            quantized_weights=self.gguf_weights if self.gguf_weights is not None else self.quantized_weights,
            gguf_activations=self.gguf_activations,
            fp8_gemm=self.fp8_gemm,
            max_model_len=self.max_model_len,
            served_model_name=self.served_model_name,
            trust_remote_code=self.trust_remote_code,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            hybrid_kv_cache=self.hybrid_kv_cache,
            swap_space=self.swap_space,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens or 0,  # resolved once max_model_len is known
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len or 0,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_waiting_requests=self.max_waiting_requests,
            target_itl_ms=self.target_itl_ms,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            pp_layer_partition=self.pp_layer_partition,
            data_parallel_size=self.data_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            all2all_backend=self.all2all_backend,
            enable_eplb=self.enable_eplb,
            eplb=eplb,
            enable_dbo=self.enable_dbo,
            dbo_decode_token_threshold=self.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=self.dbo_prefill_token_threshold,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            distributed_backend=self.distributed_backend,
            distributed_executor_backend=self.distributed_executor_backend,
            ray_placement_strategy=self.ray_placement_strategy,
            ray_placement_timeout=self.ray_placement_timeout,
        )
        device_config = DeviceConfig(
            device=device, attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
            cpu_kernels=self.cpu_kernels, cpu_isa=self.cpu_isa, cpu_layer_stack=self.cpu_layer_stack,
            cpu_greedy_head=self.cpu_greedy_head, cpu_moe_kernels=self.cpu_moe_kernels,
            cpu_reuse_freed_memory=self.cpu_reuse_freed_memory,
        )
        observability = ObservabilityConfig(step_roofline=self.step_roofline, roofline_hardware=self.roofline_hardware)
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device_config, observability,
                            speculative, kv_transfer, lora, kv_events,
                            engine_core_process=self.engine_core_process)


    def _executor_errors(self) -> list[str]:
        errors = []
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            errors.append(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                          f"got {self.distributed_executor_backend!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            errors.append(f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                          f"got {self.ray_placement_strategy!r}")
        if not self.ray_placement_timeout > 0:
            errors.append(f"ray_placement_timeout must be positive, got {self.ray_placement_timeout}")
        if self.distributed_executor_backend == "ray":
            if self.nnodes != 1 or self.node_rank != 0:
                errors.append("--nnodes/--node-rank start the mp backend's nodes by hand; with "
                              "--distributed-executor-backend ray, Ray places every rank on the cluster's nodes")
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                errors.append("--distributed-executor-backend ray needs Ray, which is not installed: "
                              "pip install 'roofline[ray]'")
        return errors

    def _lora_config(self, errors: list[str]) -> Optional[LoRAConfig]:
        """The LoRA settings (None unless enable_lora), their errors appended to errors."""
        if not self.enable_lora:
            return None
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        for name, value in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank),
                            ("max_cpu_loras", cpu)):
            if not _is_int(value) or value < 1:
                errors.append(f"{name} must be a positive integer, got {value!r}")
        if _is_int(cpu) and _is_int(self.max_loras) and cpu < self.max_loras:
            errors.append(f"max_cpu_loras ({cpu}) must be at least max_loras ({self.max_loras})")
        for name, value, why in (
                ("pipeline_parallel_size", self.pipeline_parallel_size, "1"),
                ("data_parallel_size", self.data_parallel_size, "1")):
            if value != 1:
                errors.append(f"enable_lora needs {name} {why} (not supported yet), got {value}")
        if self.speculative_config is not None:
            errors.append("enable_lora does not run with speculative_config yet")
        if self.kv_transfer_config is not None:
            errors.append("enable_lora does not run with kv_transfer_config yet")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=cpu)


def finalize_lengths(config: EngineConfig, model_max_len: int) -> None:
    """Fill max_model_len and the token budget once the model's own limit is known."""
    mc, sc = config.model_config, config.scheduler_config
    if mc.max_model_len is None:
        mc.max_model_len = model_max_len
    elif mc.max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len={mc.max_model_len} exceeds the model's limit of {model_max_len} positions"
        )
    sc.max_model_len = mc.max_model_len
    if not sc.max_num_batched_tokens:
        # Chunked prefill on by default: a budget that keeps decodes flowing; without chunking the
        # budget must hold a whole prompt.
        sc.max_num_batched_tokens = 2048 if sc.enable_chunked_prefill else max(2048, sc.max_model_len)
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < sc.max_model_len:
        raise ValueError(
            f"with chunked prefill disabled, max_num_batched_tokens ({sc.max_num_batched_tokens}) "
            f"must be >= max_model_len ({sc.max_model_len})"
        )


def parse_partition(text: Optional[str], pp: int) -> Optional[list[int]]:
    """--pp-layer-partition 'a,b,...' -> [a, b, ...] (one positive count per stage, the layers of each pipeline
    stage: distributed/layout.py's stage_layer_ranges); ValueError naming the flag otherwise."""
    if text is None or text == "":
        return None
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"pp_layer_partition must be comma-separated layer counts, got {text!r}") from None
    if len(counts) != pp:
        raise ValueError(f"pp_layer_partition {text!r} has {len(counts)} entries for pipeline_parallel_size={pp}")
    if any(c < 1 for c in counts):
        raise ValueError(f"pp_layer_partition {text!r}: every stage needs at least one layer")
    return counts


def env_flag(name: str, default: str = "") -> str:
    """The only place roofline reads environment variables."""
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """roofline's on-disk cache (compiled kernels, GGUF metadata): $XDG_CACHE_HOME/roofline,
    default ~/.cache/roofline.  Entries are derived data, keyed so that a stale one is never read."""
    base = env_flag("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "roofline"


def write_cache_file(path: Path, write) -> bool:
    """One cache entry, atomically: write(tmp) fills a temporary file beside path, which is then renamed
    onto it, so a reader never sees half an entry.  False when the cache cannot be written (the caller
    carries on without it)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        os.replace(tmp, path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False


class Switch:
    """A process-wide on/off switch for an optional fast path: on unless set off.  The engine sets each
    from its EngineConfig field (worker.apply_cpu_settings); tests and A/B benchmarks force them."""

    def __init__(self, name: str) -> None:
        self.name = name  # the EngineConfig field that sets it
        self.override: Optional[bool] = None  # set(): True / False, or None for the default (on)

    def on(self) -> bool:
        return self.override if self.override is not None else True

    def set(self, value: Optional[bool]) -> None:
        self.override = value

    @contextlib.contextmanager
    def forced(self, value: bool):
        """Temporarily force the switch (tests, A/B benchmarks)."""
        saved = self.override
        self.override = value
        try:
            yield
        finally:
            self.override = saved
