"""Worker: one device's model, KV pool and ModelRunner.  Loads weights (its shard under TP),
sizes and allocates the paged KV cache, executes SchedulerOutputs.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import sys
import time
from typing import Optional

import torch

from roofline.attention import kv_spec
from roofline.attention.selector import get_attention_backend
from roofline.config import GiB, EngineConfig, Switch
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepParallelStats
from roofline.distributed.parallel_state import collective_stats, get_layout
from roofline.cpu import ops as cpu_ops, gguf_quant
from roofline.model_executor.layers import cpu_prepare
from roofline.model_executor.loader.source import ModelSource
from roofline.model_executor.layers.moe.expert_parallel import dual_batch_step
from roofline.model_executor.layers.quantization import Mxfp4Config, checkpoint_quantization, weight_bytes_by_format
from roofline.model_executor.layers.quantization import fp8 as fp8_blocks, mxfp4
from roofline.model_executor.loader.weights import gguf_weights, init_dummy_weights, safetensors_weights
from roofline.model_executor.models import llama_cpu_stack
from roofline.model_executor.models.registry import resolve_architecture
from roofline.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 * GiB

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """One KV block's bytes over all layers, from the model's per-layer KV cache specs."""
    return kv_spec.bytes_per_block(model.kv_cache_specs(), block_size, dtype)


_HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on an anonymous memory mapping of its own, whose pages the kernel is asked to
    back with 2 MiB huge pages (Linux MADV_HUGEPAGE, before the first touch).

    - Zero at no cost: the kernel hands out zero pages on first touch, so a pool of GiBs takes neither
      start-up time (zeroing 2 GiB took 3.4 s on the default model's offline start) nor resident memory
      until its blocks are used.  Never-written slots read as zeros, never as NaN bit patterns.
    - Huge pages: decode attention reads the KV pool block by block at scattered places; with 4 KiB pages
      nearly every block costs TLB misses (measured: 1.5 -> 1.2 ms per layer for 64 sequences x 300
      tokens, 2 threads).  The mapping starts on a 2 MiB boundary so that every huge page is whole.
    Small tensors, and platforms without MADV_HUGEPAGE, get torch.zeros."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes < 2 * _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE)  # anonymous, private: zero-filled by the kernel
    start = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // _HUGE_PAGE * _HUGE_PAGE)  # advisory only
    except OSError:
        pass
    # the tensor keeps the mapping alive; it is unmapped when the last view of it goes
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=start).view(shape)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for it on 64-bit
REUSE_FREED_MEMORY = Switch("cpu_reuse_freed_memory")


def reuse_freed_cpu_memory() -> bool:
    """Have glibc keep freed buffers up to 32 MiB in the heap for the next allocation instead of
    unmapping them (M_MMAP_THRESHOLD) and never trim the heap top (M_TRIM_THRESHOLD).  A CPU forward
    allocates and frees the same activation sizes every layer; a prefill chunk's are MiBs, and glibc
    would hand each back to the OS and fault it in again, zeroed, on the next layer (2048-token chunks
    of the default model: ~5% of the step, SiLU-and-mul's output alone 145 -> 86 ms).  The process then
    keeps its peak heap.  Linux/glibc only; off with --no-cpu-reuse-freed-memory.  Returns
    whether it took effect."""
    if not REUSE_FREED_MEMORY.on() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def apply_cpu_settings(dc) -> None:
    """The CPU fast paths' switches and the kernels' build from a DeviceConfig: the one place they are set
    (process-wide: every engine of a process shares its kernels)."""
    from roofline.cpu import greedy_head
    from roofline.model_executor.layers.moe import cpu_experts

    cpu_ops.select_isa(dc.cpu_isa)
    for switch, value in ((cpu_ops.SWITCH, dc.cpu_kernels), (llama_cpu_stack.SWITCH, dc.cpu_layer_stack),
                          (greedy_head.SWITCH, dc.cpu_greedy_head), (cpu_experts.SWITCH, dc.cpu_moe_kernels),
                          (REUSE_FREED_MEMORY, dc.cpu_reuse_freed_memory)):
        switch.set(None if value else False)


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, rank: int = 0, show_progress: bool = True) -> None:
        self.config = config
        self.rank = rank
        dc = config.device_config
        self.device = torch.device(dc.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(config.model_config.dtype, dc.device)
        self.hf_config = config.model_config.hf_config
        if self.device.type == "cpu":
            apply_cpu_settings(dc)
            reuse_freed_cpu_memory()
        t0 = time.monotonic()
        self.model = self._load_model(source, show_progress and rank == 0)
        self.draft_model = self._load_draft_model(source, show_progress and rank == 0)
        self.lora = self._lora_slots()
        self.load_time = time.monotonic() - t0
        self.num_blocks = 0
        self.runner: Optional[ModelRunner] = None
        self.eplb = None
        pc = config.parallel_config
        if pc.enable_eplb:
            from roofline.distributed.parallel_state import get_ep_group
            from roofline.model_executor.layers.moe.eplb_state import EplbState

            self.eplb = EplbState(self.model, pc.eplb, get_ep_group(), num_nodes=pc.nnodes)
        self._collectives_seen: dict[str, list[int]] = {}
        self.kv_connector = None  # the worker half of a KV connector (kv_transfer/), set with the pool

    def _lora_slots(self):
        """LoRA adapters (enable_lora): the slot manager, its slots in every adapted layer of the target."""
        lc = self.config.lora_config
        if lc is None:
            return None
        from roofline.lora.manager import LoRAModelSlots

        slots = LoRAModelSlots(self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, self.dtype, self.device)
        logger.info("LoRA: %d adapted layers, %d slots of rank %d, %d adapters kept loaded", len(slots.layers),
                    lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras)
        return slots

    def _load_draft_model(self, source: ModelSource, show_progress: bool) -> Optional[torch.nn.Module]:
        """Speculative decoding with a draft model: load it like the target (any format we load); with MTP
        the target checkpoint's MTP module."""
        spec = self.config.speculative_config
        if spec is not None and spec.method == "mtp":
            return self._load_mtp(source, show_progress)
        if spec is None or spec.method != "draft_model":
            return None
        from roofline.model_executor.loader.source import load_hf_config, resolve_source

        source = resolve_source(spec.model, "auto")
        return self._load_model(source, show_progress, load_hf_config(source))

    def _load_mtp(self, source: ModelSource, show_progress: bool) -> torch.nn.Module:
        """The MTP module of a DeepSeek-V3 checkpoint (deepseek_mtp.py), sharing the target's embedding and
        LM head; dummy weights for a dummy target."""
        from roofline.model_executor.models.deepseek_mtp import DeepseekMTP

        backend = get_attention_backend(self.config.device_config.attention_backend, self.config.device_config.device)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                mtp = DeepseekMTP(self.hf_config, backend, self.model)
        finally:
            torch.set_default_dtype(prev)
        if source.fmt == "dummy":
            init_dummy_weights(mtp, self.config.model_config.seed + 1)
        elif source.fmt == "gguf":
            raise ValueError("speculative_config.method 'mtp' needs a safetensors checkpoint (GGUF files carry no "
                             "MTP layers)")
        else:
            mtp.load_weights(self._checkpoint_weights(safetensors_weights(source.path, show_progress), self.hf_config))
        mtp.eval()
        fp8_blocks.compact_scales(mtp)
        fp8_blocks.set_gemm(mtp, self.config.model_config.fp8_gemm)
        if self.device.type == "cpu":
            cpu_prepare.prepare_model(mtp)
        return mtp

    def _load_model(self, source: ModelSource, show_progress: bool, model_hf_config=None) -> torch.nn.Module:
        """The target model, or with model_hf_config another one (a draft model) on the same device."""
        hf_config = self.hf_config if model_hf_config is None else model_hf_config
        arch, cls = resolve_architecture(hf_config)
        backend = get_attention_backend(self.config.device_config.attention_backend, self.config.device_config.device)
        torch.manual_seed(self.config.model_config.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # parameters in the target dtype; rope tables stay fp32
        try:
            with torch.device(self.device):
                model = cls(hf_config, backend)
        finally:
            torch.set_default_dtype(prev)
        if source.fmt == "dummy":
            init_dummy_weights(model, self.config.model_config.seed)
        else:
            if source.fmt == "gguf":
                weights = gguf_weights(os.path.join(source.path, source.gguf_file), hf_config, show_progress,
                                       keep_quantized=self._keeps_gguf_blocks(cls))
            else:
                weights = self._checkpoint_weights(safetensors_weights(source.path, show_progress), hf_config)
            loaded = model.load_weights(weights)
            expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
            missing = expected - loaded
            if missing:
                raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
        model.eval()
        fp8_blocks.compact_scales(model)
        if fp8_blocks.set_gemm(model, self.config.model_config.fp8_gemm):
            logger.info("FP8 block weights kept (CUDA route: %s)", self.config.model_config.fp8_gemm)
        if self.device.type == "cpu":
            n = gguf_quant.quantize_activations(model, self.config.model_config.gguf_activations)
            if n:
                logger.info("GGUF activations: 8-bit for %d weights", n)
            cpu_prepare.prepare_model(model)
            llama_cpu_stack.attach(model)
        weight_bytes = weight_bytes_by_format(model)
        if model_hf_config is None:  # the target's (a draft model's are not the served model's)
            self.weight_bytes = weight_bytes
        logger.info("loaded %s (%s, %s) on %s; weights %.1f MB (%s)", arch, source.fmt, self.dtype, self.device,
                    sum(weight_bytes.values()) / 1e6,
                    ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(weight_bytes.items())))
        return model

    def _checkpoint_weights(self, weights, hf_config):
        """A safetensors checkpoint's tensors, quantized ones joined with their scales (layers/quantization):
        kept in their blocks with --quantized-weights native (each layer that cannot take them dequantizes
        its own), dequantized here otherwise (MXFP4 experts: dequantized here either way, no native route yet).
        A quantization_config we cannot honour fails here, naming the field."""
        cfg = checkpoint_quantization(hf_config)
        if cfg is None:
            return weights
        keep = self.config.model_config.quantized_weights == "native"
        if isinstance(cfg, Mxfp4Config):
            logger.info("MXFP4 checkpoint: expert blocks dequantized to %s at load%s", self.dtype,
                        " (no native MXFP4 route yet)" if keep else "")
            return mxfp4.mxfp4_checkpoint_weights(weights, cfg, self.dtype)
        logger.info("FP8 block checkpoint ([%d, %d] blocks): %s", cfg.block_n, cfg.block_k,
                    "kept in blocks where a layer takes them" if keep else "dequantized at load")
        return fp8_blocks.fp8_checkpoint_weights(weights, cfg, keep)

    def _keeps_gguf_blocks(self, model_cls) -> bool:
        """Whether a GGUF file's quantized layers stay in their blocks (--quantized-weights native): on the
        CPU in fp32 with the native kernels, one rank, a model class that takes them; else fp32 copies."""
        if self.config.model_config.quantized_weights != "native":
            return False
        why = None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            why = f"{self.device.type} / {self.dtype} (native blocks are computed on the CPU in fp32)"
        elif self.config.parallel_config.tensor_parallel_size > 1:
            why = "tensor parallel"
        elif not getattr(model_cls, "keeps_quantized_weights", False):
            why = f"{model_cls.__name__} loads dense tensors only"
        elif not cpu_ops.available():
            why = "native CPU kernels unavailable"
        if why is not None:
            logger.info("GGUF weights dequantized to %s: %s", self.dtype, why)
        return why is None

    # ---- KV pool ------------------------------------------------------------------------------
    def _kv_models(self) -> list[torch.nn.Module]:
        """The models with a KV pool indexed by the scheduler's block ids: the target, and a draft model."""
        return [self.model] + ([self.draft_model] if self.draft_model is not None else [])

    def kv_layout(self) -> kv_spec.KVCacheLayout:
        """Where the target model's layers keep their caches (attention/kv_spec.plan_layout): grouped when it has
        sliding-window layers and nothing here needs one table for every layer, else the identity."""
        if getattr(self, "_kv_layout", None) is None:
            specs = self.model.kv_cache_specs()
            layout, why = kv_spec.plan_layout(specs)
            cfg = self.config
            blockers = [
                (not cfg.cache_config.hybrid_kv_cache, "--no-hybrid-kv-cache"),
                (not getattr(self.model, "supports_kv_groups", False), f"{type(self.model).__name__} reads one table"),
                (self.draft_model is not None or (cfg.speculative_config is not None
                                                  and cfg.speculative_config.method != "ngram"),
                 "a draft model's or MTP layer's cache shares the block tables"),
                (cfg.parallel_config.pipeline_parallel_size > 1, "pipeline stages share the block tables"),
                (cfg.kv_transfer_config is not None, "KV transfer moves one table per request"),
                (self.device.type == "cuda" and not cfg.device_config.enforce_eager, "CUDA graphs bind one table"),
            ]
            why = why or next((reason for blocked, reason in blockers if blocked), "")
            if why:
                if any(s.sliding_window for s in specs):
                    logger.info("sliding-window layers keep every block (%s)", why)
                layout = kv_spec.identity_layout(specs)
            self._kv_layout = layout
        return self._kv_layout

    def kv_group_windows(self) -> list[int]:
        """The layout's block-table groups (their windows) for the scheduler; [] for one table per request."""
        layout = self.kv_layout()
        return list(layout.group_windows) if layout.grouped else []

    def num_state_slots(self) -> int:
        """Recurrent-state slots of the pool (attention/kv_spec.num_state_slots): max_num_seqs where a layer
        keeps a recurrent state, else 0."""
        return kv_spec.num_state_slots(self.model.kv_cache_specs(), self.config.scheduler_config.max_num_seqs)

    def state_bytes(self) -> int:
        """The recurrent states' bytes (every slot), taken from the KV budget before blocks are counted."""
        return kv_spec.state_bytes(self.model.kv_cache_specs(), self.num_state_slots())

    def block_bytes(self) -> int:
        bs = self.config.cache_config.block_size
        draft = kv_bytes_per_block(self.draft_model, bs, self.dtype) if self.draft_model is not None else 0
        return kv_spec.bytes_per_block(self.kv_layout().slot_specs, bs, self.dtype) + draft

    def determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_kv_blocks is not None:  # blocks of every layer: a grouped layout's blocks hold fewer layers each
            layout = self.kv_layout()
            return cc.num_kv_blocks * len(layout.slot_of_layer) // len(layout.slot_specs)
        if self.device.type == "cuda":
            return self._profile_cuda_blocks()
        budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_CPU_KV_BYTES
        states = self.state_bytes()
        if states:
            if states >= budget:
                raise ValueError(f"the recurrent states of max_num_seqs={self.config.scheduler_config.max_num_seqs} "
                                 f"requests ({states / GiB:.3f} GiB) do not fit the KV cache memory "
                                 f"({budget / GiB:.3f} GiB): lower max_num_seqs or raise kv_cache_memory")
            logger.info("recurrent state: %d slots, %.3f GiB, before the KV blocks", self.num_state_slots(),
                        states / GiB)
        return max((budget - states) // self.block_bytes(), 1)

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Run a maximum-size dummy batch, then give the KV pool what the utilization target leaves."""
        from roofline.attention.backend import AttentionMetadata

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler_config.max_num_batched_tokens
        bs = self.config.cache_config.block_size
        nblocks = -(-n // bs)
        caches = kv_spec.allocate(self.model.kv_cache_specs(), nblocks, bs,
                                  lambda shape: torch.zeros(shape, dtype=self.dtype, device=self.device),
                                  num_state_slots=1)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.hf_config.max_position_embeddings
        meta = AttentionMetadata(
            num_tokens=n, num_reqs=1, num_decodes=0,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(n, device=self.device), max_query_len=n, max_seq_len=n,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n],
            state_slots_cpu=[0],
        )
        hidden = self.model(ids, pos, caches, meta)
        self.model.compute_logits(hidden[-min(n, self.config.scheduler_config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache_config.gpu_memory_utilization - peak - (total - free - torch.cuda.memory_allocated(self.device))
        budget -= self.state_bytes()
        blocks = int(max(budget, 0) // self.block_bytes())
        logger.info("memory profile: peak activations+weights %.2f GiB of %.2f GiB", peak / GiB, total / GiB)
        if blocks <= 0:
            raise RuntimeError("no memory left for the KV cache; lower max_num_batched_tokens or raise gpu_memory_utilization")
        return blocks

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        layout = self.kv_layout()
        specs = layout.slot_specs  # one tensor per slot; a layer's cache is its slot's (shared by its group peers)
        bs = self.config.cache_config.block_size
        # zeros, not empty: masked-out (never written) slots must not hold NaN bit patterns
        num_states = self.num_state_slots()
        if self.device.type == "cpu":
            def zeros(shape):
                return zeros_on_huge_pages(shape, self.dtype)
        else:
            def zeros(shape):
                return torch.zeros(shape, dtype=self.dtype, device=self.device)
        slots = kv_spec.allocate(specs, num_blocks, bs, zeros, num_states)
        caches = layout.layer_caches(slots)
        block_slots = [t for t, s in zip(slots, specs) if not s.recurrent]  # what block swaps and copies move
        draft_caches = []
        if self.draft_model is not None:  # the draft's own pool, same block geometry
            draft_caches = kv_spec.allocate(self.draft_model.kv_cache_specs(), num_blocks, bs, zeros)
        swap = None
        if num_swap_blocks:
            pin = self.device.type == "cuda"
            swap = [c for specs_m in [specs] + [m.kv_cache_specs() for m in self._kv_models()[1:]]
                    for c in kv_spec.allocate(specs_m, num_swap_blocks, bs,
                                              lambda shape: torch.zeros(shape, dtype=self.dtype, device="cpu",
                                                                        pin_memory=pin))]
        self.num_blocks = num_blocks
        self.runner = ModelRunner(self.model, caches, bs, self.device, swap, block_caches=block_slots, kv_layout=layout)
        self.runner.lora = self.lora
        from roofline.worker.cuda_graph import create_graph_runner

        # CUDA, not enforce_eager, triton attention, tp=1: decode steps replay captured graphs (not with LoRA
        # adapters: a graph would replay without their deltas)
        if self.lora is None:
            self.runner.graph_runner = create_graph_runner(self.model, caches, self.config, self.device)
        if self.config.speculative_config is not None:
            from roofline.spec_decode.factory import create_proposer

            max_positions = self.config.scheduler_config.max_model_len
            if self.draft_model is not None:
                draft_limit = getattr(self.draft_model, "config", None)
                draft_limit = getattr(draft_limit, "max_position_embeddings", None)
                max_positions = min(max_positions, draft_limit or max_positions)
            self.runner.proposer = create_proposer(self.config.speculative_config, self.draft_model, draft_caches,
                                                   max_positions)
        from roofline.kv_transfer import create_worker_connector

        self.kv_connector = create_worker_connector(self.config, caches)
        total = num_blocks * self.block_bytes()
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB%s", num_blocks, bs, num_blocks * bs,
                    total / GiB, f"; {num_states} recurrent-state slots, {self.state_bytes() / GiB:.3f} GiB"
                    if num_states else "")

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "init_kv_cache first"
        others_run = False
        dual_batch_step(self._dual_batch(out))
        if out.data_parallel:  # data-parallel attention: this DP rank's part; idle, it still joins the MoE exchanges
            others_run = any(p.scheduled for p in out.data_parallel)
            out = out.data_parallel_part(get_layout().coords(self.rank).dp)
        connector, plan = self.kv_connector, out.kv_connector_metadata
        if connector is not None and plan is not None:
            connector.start_load_kv(plan)
        result = self.runner.execute(out, join_exchanges_when_idle=others_run)
        if connector is not None:
            if plan is not None:
                connector.save_kv(plan)
            result.kv_connector_output = connector.get_finished()
        if self.eplb is not None:
            self.eplb.step()
        if get_layout().world_size > 1 and result is not None:
            result.parallel = self._parallel_stats()
        return result

    def _dual_batch(self, out: SchedulerOutput) -> bool:
        """--enable-dbo: whether this step's expert exchanges run as two overlapped micro-batches -- decided
        from the whole step (every DP rank's part), so every rank of the EP group decides the same."""
        pc = self.config.parallel_config
        if not pc.enable_dbo:
            return False
        parts = out.data_parallel or [out]
        tokens = sum(p.total_num_scheduled_tokens for p in parts)
        prefill = any(len(s.token_ids) - s.num_draft_tokens > 1 for p in parts for s in p.scheduled)
        return tokens >= (pc.dbo_prefill_token_threshold if prefill else pc.dbo_decode_token_threshold)

    def _parallel_stats(self) -> StepParallelStats:
        """This step's collectives (the counters' growth since the last step) and the EPLB state."""
        now = collective_stats()
        step = {}
        for name, (calls, nbytes) in now.items():
            seen = self._collectives_seen.get(name, [0, 0])
            if calls >= seen[0] and (calls, nbytes) != tuple(seen):
                step[name] = [calls - seen[0], nbytes - seen[1]]
            elif calls < seen[0]:  # the counters were reset in between
                step[name] = [calls, nbytes]
        self._collectives_seen = now
        eplb = self.eplb
        return StepParallelStats(collectives=step, expert_balancedness=list(eplb.balancedness) if eplb else [],
                                 eplb_rebalances=eplb.rebalances if eplb else 0,
                                 expert_balancedness_before=list(eplb.balancedness_before) if eplb else [])

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
