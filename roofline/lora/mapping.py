"""Where an adapter's tensors go in our model: the LoRA targets (our linear layers and their output
slices) and the mapping of PEFT's HF module names onto them.

Our models fuse projections HF keeps apart: `q_proj`, `k_proj` and `v_proj` are the slices "q", "k", "v" of
QKVParallelLinear `qkv_proj`; `gate_proj` and `up_proj` the slices 0 and 1 of MergedColumnParallelLinear
`gate_up_proj` (the model's `stacked_params`, the same table its checkpoint loader reads).  A module HF
keeps fused too (Phi-3's `qkv_proj`, `gate_up_proj`) has one lora_A for every slice and a lora_B whose rows
are the slices' rows in order.  Each slice keeps its own A and B: the delta of slice s is
x A_s^T B_s^T * scaling, written into the slice's output columns.

Tensor parallelism follows the base layer: a column-parallel layer's A is whole on every rank and B's rows
are cut like the weight's rows (the layer's own weight_loader cuts them); a row-parallel layer's A is cut
along the input like the weight's columns and B is whole, and each rank's partial delta joins the layer's
partial product before the all-reduce (sum_r x_r A_r^T B^T = x A^T B^T).

Everything an adapter holds must land somewhere: a module we have no layer for, a target module name we do
not know, a shape that does not match, a rank above max_lora_rank is an error naming the adapter
(`AdapterValidator` checks adapters in the engine, against the model built on the meta device, before any
request runs under them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from roofline.lora.peft import LoRAAdapterError, PeftAdapter, read_adapter, target_names
from roofline.lora.request import LoRARequest
from roofline.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


@dataclass(frozen=True)
class Slice:
    shard: object  # the layer's weight_loader shard id ("q", "k", "v", 0, 1; None: the whole output)
    full_out: int  # the slice's rows in the checkpoint (all ranks)
    offset: int  # its first row in this rank's output
    size: int  # its rows on this rank


@dataclass
class Target:
    name: str  # our module name: model.layers.0.self_attn.qkv_proj
    layer: LinearBase
    row_parallel: bool  # input split across ranks (A cut, B whole) rather than output (A whole, B cut)
    in_full: int
    in_local: int
    out_local: int
    slices: list[Slice]


def _slices(layer: LinearBase) -> list[Slice]:
    out_local = layer.weight.shape[0]
    tp = getattr(layer, "tp_size", 1)
    if isinstance(layer, QKVParallelLinear):
        d = layer.head_dim
        q, kv = layer.num_heads * d, layer.num_kv_heads * d
        kv_full = kv * (tp // layer.kv_replicas)
        return [Slice("q", q * tp, 0, q), Slice("k", kv_full, q, kv), Slice("v", kv_full, q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [Slice(i, n, sum(layer.output_sizes[:i]) // tp, n // tp) for i, n in enumerate(layer.output_sizes)]
    if isinstance(layer, ColumnParallelLinear):
        return [Slice(None, out_local * tp, 0, out_local)]
    return [Slice(None, out_local, 0, out_local)]  # row-parallel or replicated: the whole output


def lora_targets(model: torch.nn.Module) -> dict[str, Target]:
    """Our linear layers an adapter may target, by module name; a ValueError for a model without LoRA."""
    if not getattr(model, "supports_lora", False):
        raise ValueError(f"{type(model).__name__} does not support LoRA adapters (supported: the Llama-family "
                         "models: Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite, Phi-3)")
    targets = {}
    for name, m in model.named_modules():
        if not isinstance(m, LinearBase) or m.dense_only:  # dense_only: a weight transformed at load
            continue
        in_local, out_local = m.weight.shape[1], m.weight.shape[0]
        row = isinstance(m, RowParallelLinear)
        in_full = in_local * m.tp_size if row else in_local
        targets[name] = Target(name, m, row, in_full, in_local, out_local, _slices(m))
    return targets


def _our_module(hf_module: str, stacked_params) -> tuple[str, object]:
    """HF module name -> (our module name, slice shard or None)."""
    head, _, leaf = hf_module.rpartition(".")
    for frag, ours, shard in stacked_params:
        if frag == "." + leaf:
            return head + ours, shard
    return hf_module, None


def _known_leaves(targets: dict[str, Target], stacked_params) -> set[str]:
    """The module names (last component, as in target_modules) that land on a target."""
    leaves = {name.rpartition(".")[2] for name in targets}
    for frag, ours, _ in stacked_params:
        if ours.lstrip(".") in leaves:
            leaves.add(frag.lstrip("."))
    return leaves


# what an adapter brings to one target: (slice index, A [r, in_full], B [slice full_out, r] scaled)
MappedTarget = list[tuple[int, torch.Tensor, torch.Tensor]]


def map_adapter(adapter: PeftAdapter, targets: dict[str, Target], stacked_params,
                max_rank: int) -> dict[str, MappedTarget]:
    """The adapter's tensors by our module name, B scaled (alpha / r, or alpha / sqrt(r) with rsLoRA);
    a LoRAAdapterError for anything that does not land exactly."""
    name = adapter.name
    if adapter.rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {adapter.rank}, above max_lora_rank ({max_rank}); "
                               f"start the engine with --max-lora-rank {adapter.rank} or more")
    listed = target_names(adapter)
    if listed is not None:
        known = _known_leaves(targets, stacked_params)
        unknown = sorted({t for t in listed if t.rpartition(".")[2] not in known})
        if unknown:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: target module(s) {unknown} are not supported "
                                   f"(supported: {sorted(known)})")
    scaling = adapter.scaling
    mapped: dict[str, MappedTarget] = {}
    for hf_module, (a, b) in sorted(adapter.modules.items()):
        ours, shard = _our_module(hf_module, stacked_params)
        target = targets.get(ours)
        if target is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: module {hf_module!r} does not map onto a linear layer "
                                   "of this model (wrong model, or a target module we do not support)")
        if a.shape[1] != target.in_full:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {hf_module}.lora_A has {a.shape[1]} input features, "
                                   f"the layer has {target.in_full}")
        if shard is None and len(target.slices) > 1:  # fused in HF too: B's rows are the slices' rows in order
            sizes = [s.full_out for s in target.slices]
            if b.shape[0] != sum(sizes):
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {hf_module}.lora_B has {b.shape[0]} rows, the "
                                       f"layer has {sum(sizes)}")
            parts = list(enumerate(b.split(sizes, dim=0)))
        else:
            index = next(i for i, s in enumerate(target.slices) if s.shard == shard)
            if b.shape[0] != target.slices[index].full_out:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {hf_module}.lora_B has {b.shape[0]} rows, the "
                                       f"layer's {hf_module.rpartition('.')[2]} has {target.slices[index].full_out}")
            parts = [(index, b)]
        entry = mapped.setdefault(ours, [])
        for index, part in parts:
            if any(i == index for i, _, _ in entry):
                raise LoRAAdapterError(f"LoRA adapter {name!r}: two modules map onto slice {index} of {ours!r}")
            entry.append((index, a, part * scaling))
    return mapped


def build_meta_model(hf_config) -> torch.nn.Module:
    """The model as one rank holding every layer builds it, on the meta device (shapes only)."""
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.distributed.layout import ParallelLayout
    from roofline.distributed.parallel_state import parallel_layout_as
    from roofline.model_executor.models.registry import resolve_architecture

    _, cls = resolve_architecture(hf_config)
    with parallel_layout_as(ParallelLayout(), 0), torch.device("meta"):
        return cls(hf_config, TorchAttentionBackend())


class AdapterValidator:
    """The engine's check of adapters before requests run under them: the files read, every tensor mapped
    onto the model (built on the meta device) and the rank within max_lora_rank.  Checked adapters are
    remembered by lora_int_id, which must keep naming one adapter."""

    def __init__(self, hf_config, max_lora_rank: int) -> None:
        model = build_meta_model(hf_config)
        self.targets = lora_targets(model)
        self.stacked_params = list(getattr(model, "stacked_params", []))
        self.max_lora_rank = max_lora_rank
        self.checked: dict[int, LoRARequest] = {}

    def check(self, request: LoRARequest) -> None:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        seen: Optional[LoRARequest] = self.checked.get(request.lora_int_id)
        if seen is not None:
            if (seen.lora_name, seen.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give {request.lora_name!r} an id of its own")
            return
        map_adapter(read_adapter(request.lora_name, request.lora_path), self.targets, self.stacked_params,
                    self.max_lora_rank)
        self.checked[request.lora_int_id] = request

    def forget(self, lora_int_id: int) -> None:
        self.checked.pop(lora_int_id, None)
