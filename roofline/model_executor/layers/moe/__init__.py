"""Mixture-of-experts layers: routing (router.py), the FusedMoE layer (layer.py) and its expert compute
per backend (torch_experts.py reference, cpu_experts.py native CPU, triton_moe.py CUDA); with expert
parallelism, the token exchange (expert_parallel.py) and EPLB's serving-time rebalancing (eplb_state.py)."""

from roofline.model_executor.layers.moe.layer import FusedMoE
from roofline.model_executor.layers.moe.router import RoutingConfig, select_experts

__all__ = ["FusedMoE", "RoutingConfig", "select_experts"]
