"""Tiny checkpoints with two PEFT adapters of different ranks, and PEFT's greedy tokens for them (built once
per session, for every LoRA test module).  Without a CUDA device the Triton kernels run through Triton's
interpreter: TRITON_INTERPRET must be set before triton is first imported (tests/triton_interpreter.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.triton_interpreter import interpret_without_gpu

interpret_without_gpu("roofline.lora.triton_ops", "_shrink_kernel")

from roofline import LoRARequest
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.reference.hf_models import build_tiny_model, hf_greedy
from tests.reference.lora_adapters import LLAMA_TARGETS, peft_reference, write_peft_adapter

MAX_TOKENS = 12
# per prompt: which model runs it (0: base, 1: adapter a1, 2: adapter a2), mixed in one batch
MIX = [0, 1, 2, 1, 2, 0]
# the modules a1 and a2 target: HF's separate projections, or Phi-3's fused qkv_proj / gate_up_proj
TARGETS = {"phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"])}
DEFAULT_TARGETS = (LLAMA_TARGETS, ["q_proj", "v_proj", "down_proj"])


@dataclass
class LoRAFamily:
    path: str
    prompts: list[list[int]]
    loras: list  # [None, a1, a2]: the LoRARequest of each model in MIX
    refs: list  # the HF models computing each as PEFT does
    expected: list[list[int]]  # PEFT's greedy tokens of prompt i under MIX[i]

    def lora_requests(self, mix=MIX):
        return [self.loras[k] for k in mix]


@pytest.fixture(scope="session")
def lora_family(tmp_path_factory):
    """arch -> LoRAFamily: a1 has rank 8 on every projection (alpha 16), a2 rank 4 with rsLoRA on q, v and
    down (alpha 8): different ranks, different targets, one with a slice of our fused qkv left out (Phi-3:
    HF's fused qkv_proj and down_proj)."""
    cache = {}

    def get(arch: str) -> LoRAFamily:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            hf = build_tiny_model(arch, str(root / "model"), seed=5)
            t1, t2 = TARGETS.get(arch, DEFAULT_TARGETS)
            w1 = write_peft_adapter(str(root / "a1"), hf, 8, 16, t1, seed=1)
            w2 = write_peft_adapter(str(root / "a2"), hf, 4, 8, t2, seed=2, use_rslora=True)
            refs = [hf, peft_reference(hf, w1, 8, 16), peft_reference(hf, w2, 4, 8, use_rslora=True)]
            prompts = shared_prefix_prompts(hf.config.vocab_size, n=len(MIX), seed=4)
            loras = [None, LoRARequest("a1", 1, str(root / "a1")), LoRARequest("a2", 2, str(root / "a2"))]
            expected = [hf_greedy(refs[k], p, MAX_TOKENS) for k, p in zip(MIX, prompts)]
            cache[arch] = LoRAFamily(str(root / "model"), prompts, loras, refs, expected)
        return cache[arch]

    return get
