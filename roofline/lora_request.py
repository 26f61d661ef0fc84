"""LoRARequest: which LoRA adapter a request runs under (vLLM's offline name and fields).

Importable as roofline.LoRARequest and roofline.lora.request.LoRARequest (vLLM's path); it lives here,
beside sampling_params.py, so that the scheduler's and engine's messages import it without the
roofline.lora package (which sits above the model layers).

A msgspec Struct, so it rides in the engine's messages (EngineCore process, NewRequestData to the
workers) as msgpack.  `lora_int_id` is the adapter's identity in the engine: two requests with the same
id share the adapter's weights, its slot and its prefix-cache blocks; one id names one adapter (a name and
a path) for the engine's lifetime.
"""

from __future__ import annotations

from typing import Optional

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    lora_name: str  # what clients call it (the server's `"model": "<name>"`)
    lora_int_id: int  # >= 1, unique per adapter
    lora_path: str  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    base_model_name: Optional[str] = None  # the model it was trained on (listed as /v1/models' parent)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> str:
        """The adapter's identity in prefix-cache block hashes (core/kv_cache_manager.py)."""
        return f"{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}"
