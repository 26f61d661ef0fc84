"""The worker's LoRA slot manager: adapters loaded onto this rank, the fixed slots the layers compute
from, and the step's batch.

  * Loaded adapters: an LRU of at most max_cpu_loras adapters, each read from its PEFT directory, mapped
    onto our layers (mapping.py) and cut to this rank's shard, kept in the model's dtype on the CPU.  One
    evicted and needed again is read again (its path travels with every request that uses it).
  * Slots: max_loras per layer (layers.py).  `begin_step` puts the step's adapters into slots -- those
    already there stay, the others take a free slot or the one used longest ago -- and hands the layers
    the step's batch.  The scheduler never puts more than max_loras adapters in one step.
  * The CPU layer stack (llama_cpu_stack.py) reads the same slots and the step's batch (`lora_state`) and
    adds the deltas in its native pass.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional

import torch

from roofline.lora.layers import BASE, LoRALayer, LoRAStepState, StepBatch
from roofline.lora.mapping import Target, lora_targets, map_adapter
from roofline.lora.peft import read_adapter
from roofline.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# our module name -> (a [S, r, in_local], b [out_local, r], slices present) on this rank
RankWeights = dict[str, tuple[torch.Tensor, torch.Tensor, list[bool]]]


class LoadedAdapter:
    def __init__(self, request: LoRARequest, rank: int, weights: RankWeights) -> None:
        self.request = request
        self.rank = rank
        self.weights = weights


def _shard(target: Target, entries, rank: int, dtype: torch.dtype):
    """One target's (slice, A, B) entries cut to this rank with the layer's own weight_loader."""
    layer = target.layer
    nslices = len(target.slices)
    a = torch.zeros((nslices, rank, target.in_local), dtype=torch.float32)
    b = torch.zeros((target.out_local, rank), dtype=torch.float32)
    on = [False] * nslices
    for index, a_full, b_full in entries:
        on[index] = True
        if target.row_parallel:  # input split: A's columns cut like the weight's, B whole
            layer.weight_loader(a[index], a_full)
            b.copy_(b_full)
        else:  # output split: A whole, B's rows cut like the slice's weight rows
            a[index].copy_(a_full)
            layer.weight_loader(b, b_full, target.slices[index].shard)
    return a.to(dtype), b.to(dtype), on


class LoRAModelSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device) -> None:
        self.targets = lora_targets(model)
        self.stacked_params = list(getattr(model, "stacked_params", []))
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self.state = LoRAStepState(max_loras)
        self.layers: dict[str, LoRALayer] = {}
        for name, target in self.targets.items():
            layer = LoRALayer(target, self.state, max_loras, max_lora_rank, dtype, device)
            target.layer.lora = layer
            self.layers[name] = layer
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU, most recent last
        self.slot_ids: list[Optional[int]] = [None] * max_loras  # adapter id in each slot
        self.slot_used: list[int] = [0] * max_loras  # step of last use
        self.steps = 0
        stack = getattr(getattr(model, "model", None), "cpu_stack", None)
        if stack is not None:
            stack.lora_state = self.state  # it adds the step's adapter deltas from the same slots

    # ---- loaded adapters ------------------------------------------------------------------------
    def load(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter, from the LRU or read now; raises LoRAAdapterError (ValueError) naming it."""
        got = self.loaded.get(request.lora_int_id)
        if got is not None:
            self.loaded.move_to_end(request.lora_int_id)
            return got
        adapter = read_adapter(request.lora_name, request.lora_path)
        mapped = map_adapter(adapter, self.targets, self.stacked_params, self.max_lora_rank)
        weights = {name: _shard(self.targets[name], entries, adapter.rank, self.dtype)
                   for name, entries in mapped.items()}
        got = LoadedAdapter(request, adapter.rank, weights)
        self.loaded[request.lora_int_id] = got
        self.loaded.move_to_end(request.lora_int_id)
        while len(self.loaded) > self.max_cpu_loras:
            evicted, _ = self.loaded.popitem(last=False)
            logger.debug("LoRA adapter %d leaves the CPU cache", evicted)
        return got

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded): its CPU copy and its slot."""
        self.loaded.pop(lora_int_id, None)
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = None

    # ---- the step -------------------------------------------------------------------------------
    def _slot_for(self, request: LoRARequest, step_ids: set[int]) -> int:
        aid = request.lora_int_id
        for slot, held in enumerate(self.slot_ids):
            if held == aid:
                return slot
        adapter = self.load(request)
        free = [s for s, held in enumerate(self.slot_ids) if held is None]
        if free:
            slot = free[0]
        else:
            idle = [s for s, held in enumerate(self.slot_ids) if held not in step_ids]
            if not idle:
                raise RuntimeError(f"a step holds more than max_loras ({self.max_loras}) adapters")
            slot = min(idle, key=lambda s: self.slot_used[s])
        for name, layer in self.layers.items():
            layer.load_slot(slot, adapter.weights.get(name))
        self.state.ranks[slot] = adapter.rank
        self.slot_ids[slot] = aid
        return slot

    def begin_step(self, runs: list[tuple[Optional[LoRARequest], int]], kept_rows: Optional[list[int]]) -> None:
        """runs: the step's rows in order as (adapter or None, rows) per request; kept_rows: the rows the
        model returns when it returns fewer than all."""
        self.steps += 1
        step_ids = {req.lora_int_id for req, _ in runs if req is not None}
        if len(step_ids) > self.max_loras:
            raise RuntimeError(f"a step holds {len(step_ids)} adapters, more than max_loras ({self.max_loras})")
        slots: dict[int, int] = {}
        for req, _ in runs:
            if req is not None and req.lora_int_id not in slots:
                slots[req.lora_int_id] = self._slot_for(req, step_ids)
        for slot in slots.values():
            self.slot_used[slot] = self.steps
        batch = StepBatch([(slots[req.lora_int_id] if req is not None else BASE, n) for req, n in runs], kept_rows)
        self.state.batch = batch if batch.has_adapter_rows else None

    def end_step(self) -> None:
        self.state.batch = None
