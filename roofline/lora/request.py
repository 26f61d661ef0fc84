"""LoRARequest under vLLM's import path (roofline.lora.request); defined in roofline/lora_request.py."""

from roofline.lora_request import LoRARequest

__all__ = ["LoRARequest"]
