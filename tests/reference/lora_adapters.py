"""LoRA references: PEFT adapter directories written from random weights, and an HF model that computes
them as PEFT does.

`peft` is not installed in the test environment, so the reference is built here: every targeted nn.Linear
of a copy of the HF model is wrapped to compute PEFT's LoRA forward, base(x) + lora_B(lora_A(x)) * scaling
(dropout off, scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), and the files are written
in PEFT's format: adapter_config.json and adapter_model.safetensors with keys
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Optional

import torch
from torch import nn

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(path: str, hf_model, rank: int, alpha: float, target_modules: list[str], seed: int,
                       use_rslora: bool = False, std: float = 0.2, layers: Optional[list[int]] = None,
                       **config_overrides) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A and B (std `std`) for every nn.Linear of hf_model whose name ends in a target module (in
    `layers` only, when given); writes the PEFT directory and returns {module name: (A, B)}."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights, tensors = {}, {}
    for name, m in hf_model.named_modules():
        if not isinstance(m, nn.Linear) or name.rpartition(".")[2] not in target_modules:
            continue
        if layers is not None and not any(f".layers.{i}." in name for i in layers):
            continue
        a = torch.randn(rank, m.in_features, generator=gen) * std
        b = torch.randn(m.out_features, rank, generator=gen) * std
        weights[name] = (a, b)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": use_rslora, "modules_to_save": None, "use_dora": False, "rank_pattern": {},
              "alpha_pattern": {}, "layers_to_transform": layers, "base_model_name_or_path": "tiny"}
    config.update(config_overrides)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return weights


class PeftLinear(nn.Module):
    """PEFT's LoRA Linear forward: base(x) + lora_B(lora_A(x)) * scaling."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False)
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)
        self.scaling = scaling

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def peft_reference(hf_model, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float,
                   use_rslora: bool = False):
    """A copy of hf_model computing the adapter as PEFT does."""
    model = copy.deepcopy(hf_model)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    for name, (a, b) in weights.items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, PeftLinear(getattr(owner, leaf), a, b, scaling))
    model.eval()
    return model
