"""roofline: an LLM inference-serving engine (paged KV cache, continuous batching, chunked prefill)."""

from roofline.lora_request import LoRARequest
from roofline.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from roofline.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):  # LLM pulls in torch and transformers: import it lazily
    if name == "LLM":
        from roofline.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from roofline.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind", "EngineArgs",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest"]
