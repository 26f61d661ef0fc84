"""Architecture name (config.architectures[0]) -> model class."""

from __future__ import annotations

from roofline.model_executor.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from roofline.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_architecture(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        # GGUF-derived configs name no architecture; map by model_type.
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM"}
        mt = getattr(hf_config, "model_type", None)
        if mt in by_type:
            archs = [by_type[mt]]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
