"""LoRA references: PEFT adapter directories written from random weights, and an HF model that computes
them as PEFT does.

The reference is built here (test_lora_parity checks it against peft's PeftModel): every targeted nn.Linear
of a copy of the HF model is wrapped to compute PEFT's LoRA forward, base(x) + lora_B(lora_A(x)) * scaling
(dropout off, scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), and the files are written
in PEFT's format: adapter_config.json and adapter_model.safetensors with keys
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

# the adapter directories are written by the product's own writer (also W10's)
from roofline.lora.peft import LLAMA_TARGETS, write_random_adapter as write_peft_adapter  # noqa: E402,F401


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
