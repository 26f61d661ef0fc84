"""CUDA graphs for decode-only steps.

A decode step of a small model is dominated by launch overhead: ~10 kernels per layer, each a few
microseconds of GPU work.  CudaGraphRunner records the whole forward (embedding, every layer, final
norm, LM head) once per batch size and replays it with a single launch.

How a step runs in a graph
--------------------------
* Capture sizes: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself).
  A decode batch of R requests runs in the graph of the smallest captured size B >= R.
* Static inputs (allocated once, at the largest size; graph g_B reads rows [:B]):
      input_ids [B], positions [B], slot_mapping [B], seq_lens [B],
      block_tables [B x max_blocks] (max_blocks = cdiv(max_model_len, block_size)),
      query_start_loc [B+1] = 0, 1, ..., B (constant: every row is its own request with one query).
  Each step copies the real rows in (rows [:R]; block-table columns [:nb], nb = the widest table of
  the batch -- columns past a row's context are never read) and resets the padding rows [R:B] to:
      input_id 0, position 0, slot_mapping -1 (the Triton write_kv kernel skips negative slots: no
      cache write), seq_len 1, block_tables[r, 0] = scratch_block (default 0).
  A padding row therefore attends to one key, slot 0 of scratch_block: a read of whatever is there
  (finite data: the pool is zero-initialised and only ever holds K/V).  Rows never mix (attention,
  norms and MLP are per row), so the padding rows' outputs are garbage that nobody reads, and the real
  rows are exactly what the eager forward computes.
* Static outputs: hidden [B x d] and logits [B x V] are copied at the end of the graph into buffers
  shared by all sizes, so the graphs' own memory (one shared pool, captured largest first) holds
  only transient activations.  run() returns views [:R] of them, valid until the next run().
* Attention metadata inside the graph holds no per-step host data.  The Triton backend reads, as
  Python ints, num_tokens / num_reqs (= B, fixed per graph), max_query_len (= 1) and max_seq_len;
  max_seq_len is fixed to max_model_len at capture, so the split-KV heuristic makes one choice per
  size that is valid for any context up to max_model_len (the segment length is computed on the
  device from the real seq_lens; segments past the context are empty and cost little).
  query_start_loc_cpu / seq_lens_cpu are placeholders, NOT the step's values: the torch backend,
  which reads them, is not graph-safe and disables graphs (graphs_unsupported_reason).
* The KV cache tensors are baked into the graphs: they must never be reallocated after capture
  (ModelRunner only writes them in place).

Not covered (eager path as before): batches with any prefill chunk, batches larger than the largest
captured size, a block table wider than max_blocks, tensor parallelism (collectives inside graphs are
not validated here), the torch attention backend, CPU, enforce_eager.

The padding plan, static buffers and the static forward are tested on CPU by running the static forward
eagerly (tests/worker/test_cuda_graph_logic.py); capture and replay are tested on a GPU by the HF-parity
tests (tests/engine/test_hf_parity.py: greedy tokens and logprobs identical to HF with decode steps
replayed, num_replays > 0), which run on CUDA wherever the machine has one (checked on an H100).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from roofline.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


# ---- pure logic (CPU-testable) -----------------------------------------------------------------


def capture_sizes(max_num_seqs: int, limit: Optional[int] = None) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to min(max_num_seqs, limit), which is always included."""
    top = max_num_seqs if limit is None else min(max_num_seqs, limit)
    if top < 1:
        return []
    sizes = [s for s in SMALL_SIZES if s <= top]
    sizes += list(range(2 * SIZE_STEP, top + 1, SIZE_STEP))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(num_reqs: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest captured size >= num_reqs, or None when the batch is too big for any graph."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(items) -> bool:
    """Every scheduled request feeds exactly one new token (a decode, or a 1-token prefill tail)."""
    return bool(items) and all(len(s.token_ids) == 1 for s in items)


@dataclass
class DecodePlan:
    """Host arrays of one padded decode step: rows [:num_reqs] real, [num_reqs:batch_size] padding."""

    num_reqs: int
    batch_size: int
    input_ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64
    slot_mapping: np.ndarray  # [B] int64, -1 for padding
    seq_lens: np.ndarray  # [B] int32, 1 for padding
    block_tables: np.ndarray  # [B, width] int32, padding rows [scratch_block, 0, ...]


def plan_decode_batch(
    items, block_size: int, batch_size: int, max_blocks: int, scratch_block: int = 0
) -> Optional[DecodePlan]:
    """The padded inputs of a decode-only batch (same values as ModelRunner._prepare for the real
    rows).  None when a block table is wider than max_blocks (run it eagerly)."""
    r = len(items)
    assert 1 <= r <= batch_size, (r, batch_size)
    width = max(1, max(len(s.block_ids) for s in items))
    if width > max_blocks:
        return None
    input_ids = np.zeros(batch_size, dtype=np.int64)
    positions = np.zeros(batch_size, dtype=np.int64)
    slots = np.full(batch_size, -1, dtype=np.int64)
    seq_lens = np.ones(batch_size, dtype=np.int32)
    tables = np.zeros((batch_size, width), dtype=np.int32)
    tables[r:, 0] = scratch_block
    for i, s in enumerate(items):
        assert len(s.token_ids) == 1, "plan_decode_batch takes decode-only batches"
        pos = s.num_computed_tokens
        input_ids[i] = s.token_ids[0]
        positions[i] = pos
        slots[i] = s.block_ids[pos // block_size] * block_size + pos % block_size
        seq_lens[i] = pos + 1
        tables[i, : len(s.block_ids)] = s.block_ids
    return DecodePlan(r, batch_size, input_ids, positions, slots, seq_lens, tables)


class StaticInputs:
    """The graph's input buffers on `device`, sized for the largest batch; every row starts as a
    padding row, so warm-up and capture runs write nothing into the KV cache."""

    def __init__(self, max_batch: int, max_blocks: int, device, scratch_block: int = 0) -> None:
        self.max_batch, self.max_blocks, self.scratch_block = max_batch, max_blocks, scratch_block
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.block_tables[:, 0] = scratch_block
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def load(self, plan: DecodePlan) -> None:
        """Copy one step's rows [:B] in (host -> device, no sync needed)."""
        b, w = plan.batch_size, plan.block_tables.shape[1]
        self.input_ids[:b].copy_(torch.from_numpy(plan.input_ids), non_blocking=True)
        self.positions[:b].copy_(torch.from_numpy(plan.positions), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.from_numpy(plan.slot_mapping), non_blocking=True)
        self.seq_lens[:b].copy_(torch.from_numpy(plan.seq_lens), non_blocking=True)
        self.block_tables[:b, :w].copy_(torch.from_numpy(plan.block_tables), non_blocking=True)

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over rows [:batch_size]: device tensors are views of the static buffers, the
        Python ints are fixed per size; the host lists are placeholders (see the module docstring)."""
        b = batch_size
        return AttentionMetadata(
            num_tokens=b,
            num_reqs=b,
            num_decodes=b,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[max_seq_len] * b,
        )


def graphs_unsupported_reason(model, device, enforce_eager: bool, tp_size: int = 1) -> Optional[str]:
    """Why decode steps cannot run in CUDA graphs here, or None when they can."""
    if enforce_eager:
        return "enforce_eager is set"
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if tp_size != 1:
        return "tensor parallelism (collectives in graphs not validated)"
    from roofline.distributed.parallel_state import get_ep_group, get_pp_group

    if get_pp_group().world_size != 1:
        return "pipeline parallelism (a stage's step ends in a send, not logits)"
    if get_ep_group().world_size != 1:
        return "expert parallelism (the all-to-all's split sizes are read on the host every step)"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return "model has no decoder layers"
    if any(spec.kind != "attention" for spec in model.kv_cache_specs()):
        return "the model's KV cache is not K/V attention (MLA decode graphs not captured)"
    backend = getattr(model, "attention_backend", None)
    if getattr(backend, "name", None) != "triton":
        return f"attention backend {getattr(backend, 'name', '?')!r} reads host metadata (needs 'triton')"
    return None


# ---- the runner ---------------------------------------------------------------------------------


@dataclass
class GraphStepOutput:
    hidden: torch.Tensor  # [R, d], view of a static buffer (valid until the next run)
    logits: torch.Tensor  # [R, V], idem
    query_start_loc_cpu: list[int]  # 0 .. R


class CudaGraphRunner:
    """Decode-only forward passes through captured CUDA graphs (see the module docstring).

    Without capture() (e.g. CPU tests), run() executes the same static forward eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device,
        sizes: Optional[Sequence[int]] = None,
        scratch_block: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.sizes = list(sizes) if sizes is not None else capture_sizes(max_num_seqs)
        assert self.sizes and self.sizes == sorted(set(self.sizes)), self.sizes
        self.max_blocks = -(-max_model_len // block_size)
        self.static = StaticInputs(self.sizes[-1], self.max_blocks, self.device, scratch_block)
        self.hidden_out: Optional[torch.Tensor] = None  # [max B, d]
        self.logits_out: Optional[torch.Tensor] = None  # [max B, V]
        self.graphs: dict[int, "torch.cuda.CUDAGraph"] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0  # decode steps run by replaying a captured graph

    # the body of every graph
    def forward_static(self, batch_size: int) -> None:
        b = batch_size
        meta = self.static.metadata(b, self.max_model_len)
        hidden = self.model(self.static.input_ids[:b], self.static.positions[:b], self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        if self.hidden_out is None:  # first (eager) run: allocate the shared outputs
            m = self.sizes[-1]
            self.hidden_out = torch.empty((m, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
            self.logits_out = torch.empty((m, logits.shape[1]), dtype=logits.dtype, device=logits.device)
        self.hidden_out[:b].copy_(hidden)
        self.logits_out[:b].copy_(logits)

    @torch.inference_mode()
    def capture(self) -> float:
        """Warm up (Triton JIT, cuBLAS) and capture every size, largest first, into one memory pool.
        Returns the seconds spent; also in self.capture_seconds and logged."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in reversed(self.sizes):  # every size once: compiles each grid/split variant
                self.forward_static(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.forward_static(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs for decode batch sizes %d..%d in %.2f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.capture_seconds)
        return self.capture_seconds

    def run(self, items) -> Optional[GraphStepOutput]:
        """The forward of a decode-only batch (ModelRunner order), or None when it does not fit a
        graph (prefill present, too many requests, table too wide): then run it eagerly."""
        if not is_decode_only(items):
            return None
        b = padded_size(len(items), self.sizes)
        if b is None:
            return None
        plan = plan_decode_batch(items, self.block_size, b, self.max_blocks, self.static.scratch_block)
        if plan is None:
            return None
        self.static.load(plan)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:
            self.forward_static(b)
        r = len(items)
        return GraphStepOutput(self.hidden_out[:r], self.logits_out[:r], list(range(r + 1)))


def create_graph_runner(model, kv_caches, config, device) -> Optional[CudaGraphRunner]:
    """A captured CudaGraphRunner when graphs apply (CUDA, not enforce_eager, Triton attention,
    tp=1), else None with the reason logged.  Call once, after the KV cache is allocated."""
    from roofline.distributed.parallel_state import get_tp_size

    reason = graphs_unsupported_reason(model, device, config.device_config.enforce_eager, get_tp_size())
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None
    sc = config.scheduler_config
    runner = CudaGraphRunner(model, kv_caches, config.cache_config.block_size, sc.max_num_seqs,
                             sc.max_model_len, device)
    runner.capture()
    return runner
