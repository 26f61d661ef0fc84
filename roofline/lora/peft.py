"""Reading a PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors (and writing one
of random weights: the W10 benchmark's adapters and the tests').

What it owns: the file format and the config fields, each honoured or refused with an error naming the
adapter and the field.  It knows nothing of our model: `PeftAdapter.modules` maps each HF module name the
adapter targets (`model.layers.0.self_attn.q_proj`) to its (A [r, in], B [out, r]) pair, and mapping.py
places them onto our layers.

Config fields read: `r`, `lora_alpha`, `use_rslora` (scaling alpha / sqrt(r) instead of alpha / r),
`target_modules` (names checked by mapping.py; the tensors decide what is applied), `fan_in_fan_out`
(PEFT turns it off for nn.Linear targets, which every layer we map is, so it changes nothing), `bias`
("none" only), `peft_type` ("LORA").  Refused when set: `modules_to_save`, `use_dora`, `rank_pattern`,
`alpha_pattern`, `lora_bias`, `target_parameters`, `trainable_token_indices` -- an adapter we would
compute differently from PEFT is an error, never the base model's output.

Tensor names are PEFT's: `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r].
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"

# config fields that change what PEFT computes and that we do not compute: refused when set
_UNSUPPORTED_FIELDS = ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias", "target_parameters",
                       "trainable_token_indices", "modules_to_save")


class LoRAAdapterError(ValueError):
    """An adapter we cannot load or apply exactly; the message names the adapter."""


@dataclass
class PeftAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: object  # list of names, a regex string, or None (as in the config)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # HF module -> (A, B)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def _fail(name: str, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {name!r}: {message}")


def read_config(name: str, path: str) -> dict:
    """The adapter's config, its fields checked (see the module doc)."""
    if not os.path.isdir(path):
        raise _fail(name, f"{path!r} is not a directory (a PEFT adapter directory holds {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE})")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _fail(name, f"{CONFIG_FILE} is missing in {path!r}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(name, f"{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(name, f"{CONFIG_FILE} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(name, f"peft_type {peft_type!r} is not supported (LORA only)")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise _fail(name, f"bias {bias!r} is not supported (only 'none': adapters that train biases change "
                          "the base layers' biases, which we do not apply)")
    for key in _UNSUPPORTED_FIELDS:
        value = cfg.get(key)
        if value:
            raise _fail(name, f"{key} = {value!r} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(name, f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(name, f"lora_alpha must be a number, got {alpha!r}")
    for key in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(cfg.get(key, False), bool):
            raise _fail(name, f"{key} must be true or false, got {cfg.get(key)!r}")
    return cfg


def read_adapter(name: str, path: str) -> PeftAdapter:
    """The adapter's config and tensors (fp32, on the CPU), every key checked to be a LoRA A or B weight
    of PEFT's naming and every module to have both."""
    cfg = read_config(name, path)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        legacy = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise _fail(name, f"{WEIGHTS_FILE} is missing in {path!r}"
                          + (" (adapter_model.bin is a pickle, which is not loaded: save the adapter with "
                             "safe_serialization=True)" if legacy else ""))
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except (OSError, SafetensorError) as e:
        raise _fail(name, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    adapter = PeftAdapter(name=name, path=path, rank=cfg["r"], alpha=float(cfg["lora_alpha"]),
                          use_rslora=bool(cfg.get("use_rslora", False)), target_modules=cfg.get("target_modules"))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise _fail(name, f"tensor {key!r} does not start with PEFT's {KEY_PREFIX!r}")
        if key.endswith(_A):
            module, half = key[len(KEY_PREFIX):-len(_A)], "A"
        elif key.endswith(_B):
            module, half = key[len(KEY_PREFIX):-len(_B)], "B"
        else:
            raise _fail(name, f"tensor {key!r} is not a lora_A / lora_B weight (embedding LoRA, DoRA magnitudes, "
                              "biases and modules_to_save copies are not supported)")
        if t.dim() != 2:
            raise _fail(name, f"tensor {key!r} has shape {list(t.shape)}, expected a matrix")
        halves.setdefault(module, {})[half] = t.to(torch.float32)
    if not halves:
        raise _fail(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise _fail(name, f"module {module!r} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != b.shape[1]:
            raise _fail(name, f"module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree on "
                              "the rank")
        if a.shape[0] != adapter.rank:
            raise _fail(name, f"module {module!r} has rank {a.shape[0]}, but the config's r is {adapter.rank}")
        adapter.modules[module] = (a, b)
    return adapter


def target_names(adapter: PeftAdapter) -> Optional[list[str]]:
    """The config's target_modules as a list of module names (None: a regex or not given)."""
    tm = adapter.target_modules
    if isinstance(tm, (list, tuple)):
        return [str(x) for x in tm]
    return None


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_adapter(path: str, hf_model, rank: int, alpha: float, target_modules: list[str], seed: int,
                         use_rslora: bool = False, std: float = 0.2, layers: Optional[list[int]] = None,
                         **config_overrides) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random A and B (normal, std `std`, from `seed`) for every nn.Linear of hf_model (a transformers model;
    the meta device will do) whose name ends in a target module, in `layers` only when given; writes them as a
    PEFT directory at path and returns {HF module name: (A [r, in], B [out, r])}."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights, tensors = {}, {}
    for name, m in hf_model.named_modules():
        if not isinstance(m, torch.nn.Linear) or name.rpartition(".")[2] not in target_modules:
            continue
        if layers is not None and not any(f".layers.{i}." in name for i in layers):
            continue
        a = torch.randn(rank, m.in_features, generator=gen) * std
        b = torch.randn(m.out_features, rank, generator=gen) * std
        weights[name] = (a, b)
        tensors[f"{KEY_PREFIX}{name}{_A}"] = a
        tensors[f"{KEY_PREFIX}{name}{_B}"] = b
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": use_rslora, "modules_to_save": None, "use_dora": False, "rank_pattern": {},
              "alpha_pattern": {}, "layers_to_transform": layers, "base_model_name_or_path": "random"}
    config.update(config_overrides)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    return weights
