"""The names a request's `"model"` may take: the base model (its served name and aliases) and the LoRA
adapters being served, as vLLM's server names them.

  * `--lora-modules name=path` (or the JSON form `{"name": ..., "path": ..., "base_model_name": ...}`)
    registers adapters at start-up; each is checked against the model then (a bad one is a start-up error
    naming it).
  * `lora_for(model)` is what a generation route runs under: None for the base model, the adapter's
    LoRARequest for an adapter's name, a 404 naming any other name -- never the base model in its place.
  * `cards()` is /v1/models: the base model, then each adapter with `parent` (its base_model_name, else the
    served model) and `root` (its path).
  * `load` / `unload` back the runtime routes (POST /v1/load_lora_adapter, /v1/unload_lora_adapter,
    registered with --allow-runtime-lora-updating only): a bad adapter or a taken name is a 400, an unknown
    one a 404.  Every adapter gets an id never used before (lora_int_id), so the engine's prefix cache and
    loaded copies never confuse an unloaded adapter with a new one of the same name.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional

from roofline.entrypoints.openai.protocol import ModelCard
from roofline.entrypoints.openai.serving_engine import APIError, bad_request
from roofline.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules value: `name=path` or a JSON object with name, path (and base_model_name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--lora-modules {text!r}: expected a JSON object")
        unknown = sorted(set(d) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown field(s) {unknown}; known: name, path, "
                             "base_model_name")
        name, path, base = d.get("name"), d.get("path"), d.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {text!r}: name and path must be non-empty strings")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        return LoRAModulePath(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    return LoRAModulePath(name.strip(), path.strip())


class ServingModels:
    def __init__(self, base_names: list[str], base_root: str, max_model_len: int, vocab_size: Optional[int],
                 validator: Any = None, lora_modules: tuple[LoRAModulePath, ...] = ()) -> None:
        """validator: lora/mapping.AdapterValidator when the engine serves LoRA adapters (None: it does not)."""
        self.base_names = list(base_names)
        self.base_name = base_names[0]
        self.base_root = base_root
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.validator = validator
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        if lora_modules and validator is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in lora_modules:
            self._add(module.name, module.path, module.base_model_name)

    def _add(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Check and register an adapter; ValueError naming it when it cannot be served."""
        if self.validator is None:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self.base_names:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, self._next_id, path, base_model_name)
        self.validator.check(request)
        self._next_id += 1
        self.adapters[name] = request
        return request

    # ---- requests ---------------------------------------------------------------------------------
    def check(self, model: Optional[str]) -> None:
        """404 unless model is None, a name of the base model or an adapter being served."""
        self.lora_for(model)

    def lora_for(self, model: Optional[str]) -> Optional[LoRARequest]:
        if model is None or model in self.base_names:
            return None
        request = self.adapters.get(model)
        if request is None:
            available = ", ".join([self.base_name, *self.adapters])
            raise APIError(404, f"The model `{model}` does not exist. Available: {available}",
                           "invalid_request_error", "model", "model_not_found")
        return request

    def name_for(self, model: Optional[str]) -> str:
        """The `model` an answer names: the adapter's name the request gave (checked when it arrived), or the
        base model's served name."""
        return self.base_name if model is None or model in self.base_names else model

    # ---- /v1/models -------------------------------------------------------------------------------
    def card(self, model: Optional[str]) -> ModelCard:
        request = self.lora_for(model)
        if request is None:
            return ModelCard(id=self.base_name, root=self.base_root, max_model_len=self.max_model_len,
                             vocab_size=self.vocab_size)
        return ModelCard(id=request.lora_name, root=request.lora_path,
                         parent=request.base_model_name or self.base_name, max_model_len=self.max_model_len,
                         vocab_size=self.vocab_size)

    def cards(self) -> list[ModelCard]:
        return [self.card(None)] + [self.card(name) for name in list(self.adapters)]

    # ---- runtime loading --------------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoRARequest:
        with self._lock:
            try:
                return self._add(name, path)
            except ValueError as e:
                raise bad_request(str(e), param="lora_path" if "LoRA adapter" in str(e) else "lora_name") from None

    def unload(self, name: str) -> LoRARequest:
        with self._lock:
            request = self.adapters.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name",
                           "lora_not_found")
        return request
