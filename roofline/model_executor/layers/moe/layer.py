"""FusedMoE: one mixture-of-experts FFN layer -- router output -> top-k -> expert compute -> weighted
combine -- for every MoE architecture (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3).

The experts are stacked: w13_weight [E, 2I, H] (each expert's gate rows, then its up rows) and
w2_weight [E, H, I].  Under tensor parallelism every rank holds every expert with the intermediate
dimension I split (I/tp gate rows, I/tp up rows, I/tp down columns), so a rank's output is a partial
sum; `reduce_results=True` all-reduces it here, `False` leaves it to the model, which adds its shared
experts' partial output first and does ONE all-reduce per MoE layer.

Under expert parallelism (distributed/layout.py's EP group, size > 1) a rank instead holds
`per_rank` whole experts (w13_weight [per_rank, 2I, H]); expert_parallel.py places them and moves each
token to its experts' ranks and back.  The tensor-parallel ranks of one batch each send their own
share of its tokens, so the layer's output is again a partial sum over the TP group (rows of the
other TP ranks' shares are zero) and the same one all-reduce completes it.  `expert_load` counts the
tokens routed to each logical expert (from this rank's share) for EPLB (eplb_state.py).

FP8 block checkpoints (quantization/fp8.py): on the CPU in fp32 with the native kernels both stacks stay in
their blocks (`w13_quant` [E, 2I, H] and `w2_quant` [E, H, I], the dense parameters then meta tensors), or
neither (a dense expert tensor turns the layer dense), sliced under tensor parallelism like the dense ones
(the down projection's share of I must hold whole 128-column blocks); elsewhere (CUDA: the grouped Triton
kernel has no FP8 variant yet) they are dequantized at load.

Expert compute by where the tensors live:
    FP8 blocks kept                   quantized_experts.quantized_experts (each active expert's native linears)
    CPU, fp32, native kernels loaded  cpu_experts.CpuExperts (packed per-expert GEMMs, set by prepare_cpu)
    CUDA                              triton_moe.triton_experts (grouped GEMM over expert-sorted rows)
    anything else                     torch_experts.torch_experts (the reference)

Options (gpt-oss): `activation` (torch_experts.ExpertActivation: SiLU-and-mul, or the clamped SwiGLU) and
`bias` (w13_bias [slots, 2 I/tp] sliced like w13's rows, w2_bias [slots, H] whole, added by TP rank 0 only
so that the all-reduce counts it once; under expert parallelism every rank holds whole experts and adds it).
On the CPU such a layer takes the same one native call (cpu_experts.py: the bias in each GEMM, an activation
pass between them), on CUDA the Triton grouped GEMM with the bias and activation applied in torch between its
launches; FP8 expert blocks are dequantized at load for it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.cpu import ops as cpu_ops
from roofline.distributed.parallel_state import get_ep_group, get_layout, get_tp_group, tp_all_reduce
from roofline.eplb.algorithm import initial_placement
from roofline.model_executor.layers.moe.cpu_experts import CpuExperts
from roofline.model_executor.layers.moe.expert_parallel import (
    EXCHANGES,
    ExpertMap,
    dual_batch,
    exchange_all_to_all,
    exchange_all_to_all_dual,
)
from roofline.model_executor.layers.moe.router import RoutingConfig, select_experts
from roofline.model_executor.layers.moe.quantized_experts import quantized_experts
from roofline.model_executor.layers.moe.torch_experts import SILU, ExpertActivation, torch_experts
from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor

SHARDS = ("w1", "w3", "w2")  # gate, up, down


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 *, reduce_results: bool = True, width_field: str = "moe_intermediate_size",
                 activation: ExpertActivation = SILU, bias: bool = False):
        """width_field: the config field intermediate_size came from (named when tp does not divide it);
        activation / bias: the experts' gate (SiLU-and-mul unless given) and whether they carry biases."""
        super().__init__()
        routing.validate(num_experts)
        tp, ep, layout = get_tp_group(), get_ep_group(), get_layout()
        self.tp_group, self.ep_group = tp, ep
        self.expert_map: Optional[ExpertMap] = None
        if ep.world_size > 1:  # whole experts on each rank; the intermediate dimension is not split
            self.expert_map = ExpertMap(initial_placement(num_experts, ep.world_size, layout.num_redundant_experts),
                                        ep.rank_in_group)
            self.exchange = EXCHANGES[layout.all2all_backend]
            self.tp_size, self.tp_rank = 1, 0
        else:
            self.tp_size, self.tp_rank = tp.world_size, tp.rank_in_group
        if intermediate_size % self.tp_size:
            raise ValueError(f"{width_field} ({intermediate_size}) is not divisible by tensor_parallel_size "
                             f"({self.tp_size})")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.inter_local = intermediate_size // self.tp_size
        self.routing = routing
        self.reduce_results = reduce_results
        slots = num_experts if self.expert_map is None else self.expert_map.per_rank
        self.w13_weight = nn.Parameter(torch.empty(slots, 2 * self.inter_local, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(slots, hidden_size, self.inter_local), requires_grad=False)
        self.activation = activation
        self.w13_bias = nn.Parameter(torch.empty(slots, 2 * self.inter_local), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(slots, hidden_size), requires_grad=False) if bias else None
        self.expert_load: Optional[torch.Tensor] = None  # [num_experts] token counts, set by eplb_state
        self.cpu_experts: Optional[CpuExperts] = None  # set by prepare_cpu after loading
        self.w13_quant: Optional[Fp8BlockTensor] = None  # the stacks kept in FP8 blocks (see the module doc)
        self.w2_quant: Optional[Fp8BlockTensor] = None
        self._dense_loaded = False  # a dense expert tensor arrived: both stacks are dense (no blocks kept)
        self._loaded: set[tuple[int, str]] = set()

    # ---- loading ---------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """One expert's checkpoint tensor: "w1" (gate) / "w3" (up) [I, H], or "w2" (down) [H, I]; this
        rank keeps its slice of I."""
        n, start = self.inter_local, self.tp_rank * self.inter_local
        if shard_id not in SHARDS:
            raise ValueError(f"unknown expert shard {shard_id!r} (expected one of {SHARDS})")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the layer has {self.num_experts})")
        want = (self.hidden_size, self.intermediate_size) if shard_id == "w2" else (self.intermediate_size,
                                                                                    self.hidden_size)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded.shape)}, expected {want}")
        if isinstance(loaded, Fp8BlockTensor):
            if self._keep_fp8(loaded):
                self._load_fp8(loaded, shard_id, expert_id)
                self._loaded.add((expert_id, shard_id))
                return
            loaded = loaded.dequantize()
        self._to_dense()  # a dense tensor after blocks: both stacks go dense
        param = self.w2_weight if shard_id == "w2" else self.w13_weight
        loaded = loaded.to(param.dtype)
        for slot in self.local_slots(expert_id):
            if shard_id == "w2":
                param.data[slot].copy_(loaded.narrow(1, start, n))
            else:
                offset = 0 if shard_id == "w1" else n
                param.data[slot].narrow(0, offset, n).copy_(loaded.narrow(0, start, n))
        self._loaded.add((expert_id, shard_id))

    def bias_loader(self, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """One expert's bias: "w1" (gate) / "w3" (up) [I] (this rank keeps its slice of I), or "w2" (down) [H]."""
        if self.w13_bias is None:
            raise ValueError("this mixture-of-experts layer has no expert biases")
        if shard_id not in SHARDS:
            raise ValueError(f"unknown expert shard {shard_id!r} (expected one of {SHARDS})")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the layer has {self.num_experts})")
        want = (self.hidden_size,) if shard_id == "w2" else (self.intermediate_size,)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert_id} {shard_id} bias: checkpoint shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        n, start = self.inter_local, self.tp_rank * self.inter_local
        for slot in self.local_slots(expert_id):
            if shard_id == "w2":
                self.w2_bias.data[slot].copy_(loaded.to(self.w2_bias.dtype))
            else:
                offset = 0 if shard_id == "w1" else n
                self.w13_bias.data[slot].narrow(0, offset, n).copy_(loaded.narrow(0, start, n).to(self.w13_bias.dtype))

    @property
    def plain(self) -> bool:
        """SiLU-and-mul experts without biases: what the native CPU and FP8 expert routes compute."""
        return self.activation.is_silu and self.w13_bias is None

    # ---- FP8 block stacks ----------------------------------------------------------------------------------
    def takes_fp8(self) -> bool:
        """Whether FP8 expert stacks stay in their blocks here: CPU, fp32, native kernels, plain experts."""
        w = self.w13_weight
        return (w.device.type in ("cpu", "meta") and w.dtype == torch.float32 and cpu_ops.available()
                and self.plain)

    def _keep_fp8(self, loaded: Fp8BlockTensor) -> bool:
        """Whether this FP8 tensor joins blocks kept here.  Both stacks are kept in blocks or neither: the
        first FP8 tensor allocates both (their dense parameters become meta tensors)."""
        if self._dense_loaded or not self.takes_fp8():
            return False
        if self.w13_quant is None:
            for stack in ("w13", "w2"):
                dense = getattr(self, f"{stack}_weight")
                setattr(self, f"{stack}_quant", Fp8BlockTensor.empty(tuple(dense.shape), loaded.block_k, loaded.block_n))
                setattr(self, f"{stack}_weight", nn.Parameter(torch.empty(dense.shape, dtype=dense.dtype, device="meta"),
                                                              requires_grad=False))
        if self.w13_quant.block_k != loaded.block_k:
            self._to_dense()
            return False
        return True

    def _to_dense(self) -> None:
        """Both stacks dense from now on (blocks kept so far dequantized; rows not loaded yet are 0)."""
        for stack in ("w13", "w2"):
            kept = getattr(self, f"{stack}_quant")
            if kept is not None:
                dense = getattr(self, f"{stack}_weight")
                setattr(self, f"{stack}_weight", nn.Parameter(kept.dequantize().to(dense.dtype), requires_grad=False))
                setattr(self, f"{stack}_quant", None)
        self._dense_loaded = True

    def _load_fp8(self, loaded: Fp8BlockTensor, shard_id: str, expert_id: int) -> None:
        """One expert's FP8 tensor into this rank's slots: bytes and per-row scales, sliced like the dense rows;
        the down projection's columns (I split under tensor parallelism) on whole blocks."""
        n, start, bk = self.inter_local, self.tp_rank * self.inter_local, loaded.block_k
        scales = loaded.row_scales()
        for slot in self.local_slots(expert_id):
            if shard_id == "w2":
                if n != self.intermediate_size and n % bk:
                    raise ValueError(f"tensor parallelism gives each rank {n} of the {self.intermediate_size} "
                                     f"expert columns (moe_intermediate_size), which cuts the {bk}-column FP8 blocks "
                                     f"(a rank's share must be a multiple of {bk}); use a tensor_parallel_size that "
                                     "keeps whole blocks, expert parallelism, or --quantized-weights dequantize")
                self.w2_quant.data[slot].copy_(loaded.data.narrow(1, start, n))
                self.w2_quant.scale[slot].copy_(scales.narrow(1, start // bk, -(-n // bk)))
            else:
                offset = 0 if shard_id == "w1" else n
                self.w13_quant.data[slot].narrow(0, offset, n).copy_(loaded.data.narrow(0, start, n))
                self.w13_quant.scale[slot].narrow(0, offset, n).copy_(scales.narrow(0, start, n))

    @property
    def device(self) -> torch.device:
        """Where the experts compute (their FP8 stacks', or the dense stacks' device)."""
        return self.w2_quant.device if self.w2_quant is not None else self.w2_weight.device

    def expert_stacks(self) -> list[torch.Tensor]:
        """This rank's expert tensors, slot-major (dim 0 = local slot): the dense stacks, or the FP8 stacks'
        bytes and scales -- what EPLB moves between ranks (set_expert_stacks puts them back)."""
        if self.w13_quant is not None:
            return [self.w13_quant.data, self.w13_quant.scale, self.w2_quant.data, self.w2_quant.scale]
        biases = [] if self.w13_bias is None else [self.w13_bias.data, self.w2_bias.data]
        return [self.w13_weight.data, self.w2_weight.data] + biases

    def set_expert_stacks(self, tensors: list[torch.Tensor]) -> None:
        if self.w13_quant is not None:
            self.w13_quant.data, self.w13_quant.scale, self.w2_quant.data, self.w2_quant.scale = tensors
        else:
            self.w13_weight.data, self.w2_weight.data = tensors[:2]
            if self.w13_bias is not None:
                self.w13_bias.data, self.w2_bias.data = tensors[2:]
            if self.cpu_experts is not None:
                self.prepare_cpu()  # the native kernels' packed copies follow the new weights

    def local_slots(self, expert_id: int) -> list[int]:
        """The slots of this rank's w13/w2 stacks that hold logical expert `expert_id` (none: another rank's)."""
        if self.expert_map is None:
            return [expert_id]
        return [s for s, e in enumerate(self.expert_map.local_logical) if e == expert_id]

    def load_stacked(self, kind: str, loaded: torch.Tensor) -> None:
        """A stacked 3-D checkpoint tensor holding every expert: "gate_up_proj" [E, 2I, H] (gate rows then
        up rows: transformers' in-memory layout), "gate_proj" / "up_proj" [E, I, H] or "down_proj" [E, H, I]."""
        i, h, e_ = self.intermediate_size, self.hidden_size, self.num_experts
        want = {"gate_up_proj": (e_, 2 * i, h), "gate_proj": (e_, i, h), "up_proj": (e_, i, h), "down_proj": (e_, h, i)}
        if kind not in want:
            raise ValueError(f"unknown stacked expert tensor {kind!r} (expected one of {sorted(want)})")
        if tuple(loaded.shape) != want[kind]:
            raise ValueError(f"experts.{kind}: checkpoint shape {tuple(loaded.shape)}, expected {list(want[kind])}")
        for e in range(self.num_experts):
            if kind == "gate_up_proj":
                self.weight_loader(self.w13_weight, loaded[e, :i], "w1", e)
                self.weight_loader(self.w13_weight, loaded[e, i:], "w3", e)
            elif kind == "down_proj":
                self.weight_loader(self.w2_weight, loaded[e], "w2", e)
            else:
                self.weight_loader(self.w13_weight, loaded[e], "w1" if kind == "gate_proj" else "w3", e)

    def missing_experts(self) -> list[tuple[int, str]]:
        """(expert, shard) pairs no checkpoint tensor has filled (after per-expert or stacked loading)."""
        return [(e, s) for e in range(self.num_experts) for s in SHARDS if (e, s) not in self._loaded]

    def prepare_cpu(self) -> None:
        """After loading on the CPU: per-expert packed copies for the native kernels (cpu_prepare.prepare_model;
        FP8 stacks kept in their blocks take their own route)."""
        if self.w13_quant is None:
            self.cpu_experts = CpuExperts.build(self.w13_weight, self.w2_weight)

    # ---- compute ---------------------------------------------------------------------------------
    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum per token, un-reduced across tensor-parallel ranks."""
        if self.w13_quant is not None:
            return quantized_experts(x, self.w13_quant, self.w2_quant, weights, ids)
        if self.plain:
            extra = {}
        else:  # the down bias once across the TP group's partial sums (TP rank 0; every rank under EP)
            extra = dict(activation=self.activation, b13=self.w13_bias,
                         b2=self.w2_bias if self.tp_rank == 0 else None)
        if self.cpu_experts is not None and self.cpu_experts.takes(x):
            return self.cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids, **extra)
        if x.is_cuda:
            from roofline.model_executor.layers.moe.triton_moe import triton_experts

            return triton_experts(x, self.w13_weight, self.w2_weight, weights, ids, **extra)
        return torch_experts(x, self.w13_weight, self.w2_weight, weights, ids, **extra)

    def _local_experts(self, rows: torch.Tensor, slots: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """rows [M, H] through this rank's expert slots [M], scaled by weights [M] (None: 1) -> [M, H]."""
        if rows.shape[0] == 0:
            return torch.zeros_like(rows)
        if weights is None:
            weights = torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
        return self.experts(rows, weights[:, None], slots[:, None])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, H], router_logits [N, E] -> [N, H]."""
        weights, ids = select_experts(router_logits, self.routing, correction_bias)
        if self.expert_map is None:
            if self.expert_load is not None:
                self.expert_load += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            y = self.experts(x, weights, ids)
        else:
            y = self._expert_parallel(x, weights, ids)
        return tp_all_reduce(y) if self.reduce_results else y

    def join_exchange(self) -> None:
        """This rank's part of the layer's token exchange with no tokens (join_expert_exchanges)."""
        k, x = self.routing.top_k, torch.zeros(0, self.hidden_size, dtype=self.w2_weight.dtype, device=self.device)
        self._expert_parallel(x, torch.zeros(0, k, dtype=torch.float32, device=x.device),
                              torch.zeros(0, k, dtype=torch.int64, device=x.device))

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of the tokens through the EP exchange; other shares' rows stay zero."""
        tp = self.tp_group
        bounds = [len(c) for c in torch.arange(x.shape[0]).tensor_split(tp.world_size)]
        start = sum(bounds[:tp.rank_in_group])
        n = bounds[tp.rank_in_group]
        ids_mine = ids[start:start + n]
        if self.expert_load is not None:
            self.expert_load += torch.bincount(ids_mine.reshape(-1), minlength=self.num_experts)
        physical = self.expert_map.choose(ids_mine, offset=start)
        exchange = self.exchange
        if exchange is exchange_all_to_all and dual_batch():  # --enable-dbo, a step above its threshold
            exchange = exchange_all_to_all_dual
        y_mine = exchange(x[start:start + n], weights[start:start + n], physical, self.expert_map.per_rank,
                          self.ep_group, self._local_experts)
        if tp.world_size == 1:
            return y_mine
        y = torch.zeros_like(x)
        y[start:start + n] = y_mine
        return y


def join_expert_exchanges(model: nn.Module) -> None:
    """An idle data-parallel rank's step: every expert-parallel MoE layer, in layer order, takes part in
    its token exchange with no tokens of its own (it runs its experts on what the other ranks send),
    so that the busy ranks' collectives complete.  No tensor-parallel all-reduce: the idle rank's whole
    TP group is idle alike."""
    with torch.inference_mode():
        for m in model.modules():
            if isinstance(m, FusedMoE) and m.expert_map is not None:
                m.join_exchange()
