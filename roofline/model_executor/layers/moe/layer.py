"""FusedMoE: one mixture-of-experts FFN layer -- router output -> top-k -> expert compute -> weighted
combine -- for every MoE architecture (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3).

The experts are stacked: w13_weight [E, 2I, H] (each expert's gate rows, then its up rows) and
w2_weight [E, H, I].  Under tensor parallelism every rank holds every expert with the intermediate
dimension I split (I/tp gate rows, I/tp up rows, I/tp down columns), so a rank's output is a partial
sum; `reduce_results=True` all-reduces it here, `False` leaves it to the model, which adds its shared
experts' partial output first and does ONE all-reduce per MoE layer.

Expert compute by where the tensors live:
    CPU, fp32, native kernels loaded  cpu_experts.CpuExperts (packed per-expert GEMMs, set by prepare_cpu)
    CUDA                              triton_moe.triton_experts (grouped GEMM over expert-sorted rows)
    anything else                     torch_experts.torch_experts (the reference)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from roofline.model_executor.layers.moe.cpu_experts import CpuExperts
from roofline.model_executor.layers.moe.router import RoutingConfig, select_experts
from roofline.model_executor.layers.moe.torch_experts import torch_experts

SHARDS = ("w1", "w3", "w2")  # gate, up, down


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 *, reduce_results: bool = True, width_field: str = "moe_intermediate_size"):
        """width_field: the config field intermediate_size came from (named when tp does not divide it)."""
        super().__init__()
        routing.validate(num_experts)
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(f"{width_field} ({intermediate_size}) is not divisible by tensor_parallel_size "
                             f"({self.tp_size})")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.inter_local = intermediate_size // self.tp_size
        self.routing = routing
        self.reduce_results = reduce_results
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter_local, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_local), requires_grad=False)
        self.cpu_experts: Optional[CpuExperts] = None  # set by prepare_cpu after loading
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
        loaded = loaded.to(param.dtype)
        if shard_id == "w2":
            param.data[expert_id].copy_(loaded.narrow(1, start, n))
        else:
            offset = 0 if shard_id == "w1" else n
            param.data[expert_id].narrow(0, offset, n).copy_(loaded.narrow(0, start, n))
        self._loaded.add((expert_id, shard_id))

    def load_stacked(self, kind: str, loaded: torch.Tensor) -> None:
        """A fused 3-D checkpoint tensor (transformers' in-memory layout): "gate_up_proj" [E, 2I, H]
        (gate rows then up rows) or "down_proj" [E, H, I]."""
        i, h = self.intermediate_size, self.hidden_size
        want = {"gate_up_proj": (self.num_experts, 2 * i, h), "down_proj": (self.num_experts, h, i)}
        if kind not in want:
            raise ValueError(f"unknown stacked expert tensor {kind!r} (expected gate_up_proj or down_proj)")
        if tuple(loaded.shape) != want[kind]:
            raise ValueError(f"experts.{kind}: checkpoint shape {tuple(loaded.shape)}, expected {list(want[kind])}")
        for e in range(self.num_experts):
            if kind == "gate_up_proj":
                self.weight_loader(self.w13_weight, loaded[e, :i], "w1", e)
                self.weight_loader(self.w13_weight, loaded[e, i:], "w3", e)
            else:
                self.weight_loader(self.w2_weight, loaded[e], "w2", e)

    def missing_experts(self) -> list[tuple[int, str]]:
        """(expert, shard) pairs no checkpoint tensor has filled (after per-expert or stacked loading)."""
        return [(e, s) for e in range(self.num_experts) for s in SHARDS if (e, s) not in self._loaded]

    def mark_loaded(self) -> None:
        """Every expert counts as filled (dummy weights)."""
        self._loaded = {(e, s) for e in range(self.num_experts) for s in SHARDS}

    def prepare_cpu(self) -> None:
        """After loading on the CPU: per-expert packed copies for the native kernels (cpu_gemm.prepare_model)."""
        self.cpu_experts = CpuExperts.build(self.w13_weight, self.w2_weight)

    # ---- compute ---------------------------------------------------------------------------------
    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum per token, un-reduced across tensor-parallel ranks."""
        if self.cpu_experts is not None and self.cpu_experts.takes(x):
            return self.cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids)
        if x.is_cuda:
            from roofline.model_executor.layers.moe.triton_moe import triton_experts

            return triton_experts(x, self.w13_weight, self.w2_weight, weights, ids)
        return torch_experts(x, self.w13_weight, self.w2_weight, weights, ids)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, H], router_logits [N, E] -> [N, H]."""
        weights, ids = select_experts(router_logits, self.routing, correction_bias)
        y = self.experts(x, weights, ids)
        return tp_all_reduce(y) if self.reduce_results else y
