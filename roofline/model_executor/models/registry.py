"""Architecture name (config.architectures[0]) -> model class."""

from __future__ import annotations

from roofline.model_executor.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
)
from roofline.model_executor.models.glm4_moe import Glm4MoeForCausalLM
from roofline.model_executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from roofline.model_executor.models.gpt_oss import GptOssForCausalLM
from roofline.model_executor.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SmolLM3ForCausalLM,
)
from roofline.model_executor.models.mixtral import MixtralForCausalLM
from roofline.model_executor.models.olmo2 import Olmo2ForCausalLM
from roofline.model_executor.models.phi3 import Phi3ForCausalLM
from roofline.model_executor.models.qwen3_next import Qwen3NextForCausalLM
from roofline.model_executor.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def resolve_architecture(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        # GGUF-derived configs name no architecture; map by model_type.
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                   "qwen3_moe": "Qwen3MoeForCausalLM"}
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
