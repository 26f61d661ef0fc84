"""Expert tensors of HF MoE checkpoints -> FusedMoE parameters.

Two layouts are read:
    per expert   <prefix>.experts.<e>.{gate_proj|up_proj|down_proj}.weight  (Qwen-MoE, DeepSeek) or
                 <prefix>.experts.<e>.{w1|w3|w2}.weight (Mixtral): what transformers 5's save_pretrained
                 writes (it converts its fused in-memory experts back to these names)
    stacked 3-D  <prefix>.experts.gate_up_proj [E, 2I, H] and <prefix>.experts.down_proj [E, H, I]
                 (transformers 5's in-memory parameters, as some converted checkpoints store them), or
                 <prefix>.experts.{gate_proj|up_proj}.weight [E, I, H] one projection each (GGUF's
                 ffn_{gate,up,down}_exps, named so by loader/weights.py)
`load_expert_tensor` loads one such tensor into the FusedMoE at <prefix>.experts; `check_experts_complete`
names every expert projection that no tensor filled.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from roofline.model_executor.layers.moe.layer import FusedMoE

_SHARD_OF = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_SHARD_NAME = {"w1": "gate_proj/w1", "w3": "up_proj/w3", "w2": "down_proj/w2"}
_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.weight$")
_STACKED = re.compile(r"^(?P<module>.+\.experts)\.(?P<kind>gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")


def load_expert_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> Optional[str]:
    """Load `name` into its FusedMoE if it is an expert tensor; returns the filled parameter's name, or
    None when `name` is not an expert tensor."""
    m = _PER_EXPERT.match(name) or _STACKED.match(name)
    if m is None:
        return None
    try:
        moe = model.get_submodule(m["module"])
    except AttributeError:
        moe = None
    if not isinstance(moe, FusedMoE):
        raise ValueError(f"checkpoint tensor {name!r} has no mixture-of-experts layer at {m['module']!r} "
                         f"in {type(model).__name__}")
    if "expert" in m.groupdict():
        shard = _SHARD_OF[m["proj"]]
        param = moe.w2_weight if shard == "w2" else moe.w13_weight
        moe.weight_loader(param, tensor, shard, int(m["expert"]))
        return f"{m['module']}.{'w2_weight' if shard == 'w2' else 'w13_weight'}"
    moe.load_stacked(m["kind"], tensor)
    return f"{m['module']}.{'w2_weight' if m['kind'] == 'down_proj' else 'w13_weight'}"


def check_experts_complete(model: nn.Module) -> None:
    """Raise ValueError naming the expert projections that no checkpoint tensor filled."""
    missing = [f"{name}.{e}.{_SHARD_NAME[shard]}" for name, module in model.named_modules()
               if isinstance(module, FusedMoE) for e, shard in module.missing_experts()]
    if missing:
        raise ValueError(f"checkpoint is missing expert tensors ({len(missing)}): {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
