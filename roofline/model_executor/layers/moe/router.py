"""Expert routing for mixture-of-experts layers: router logits -> (weights, expert ids) per token.

One function, `select_experts`, covers every router the served architectures use:
    softmax top-k, weights as they are          Qwen2-MoE / Qwen3-MoE (norm_topk_prob false), DeepSeek-V2 greedy
    softmax top-k, weights renormalized          Mixtral, Qwen-MoE with norm_topk_prob
    grouped top-k ("max" group score)            DeepSeek-V2 group_limited_greedy: keep the topk_group groups
                                                 whose best expert scores highest, then top-k inside them
    sigmoid + correction bias, grouped top-k     DeepSeek-V3 noaux_tc, and GLM-4.5 (glm4_moe, whose HF router
      ("top2_sum" group score)                   is V3's and reads no topk_method / scoring_func): the bias
                                                 (e_score_correction_bias) is added for the choice only; a
                                                 group scores the sum of its two best biased scores; weights
                                                 are the unbiased sigmoid scores
    top-k of the logits, then softmax over       gpt-oss (scoring "topk_softmax"): the experts chosen on the raw
      the chosen ones                            logits (its router's linear has a bias), the weights a softmax
                                                 over the k chosen logits alone
and routed_scaling_factor multiplies the final weights.  The selection uses torch.topk on the same
float32 values as HF transformers' routers, so ties resolve the same way.

`routing_from_hf_config` reads these choices from an HF config and rejects what we cannot serve with
a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid" | "topk_softmax" (gpt-oss: top-k logits, then softmax)
    renormalize: bool = False  # norm_topk_prob: chosen weights divided by their sum
    num_groups: int = 1  # n_group (grouped top-k when > 1)
    topk_groups: int = 1  # topk_group
    group_score: str = "max"  # "max" (DeepSeek-V2 group_limited_greedy) | "top2_sum" (DeepSeek-V3 noaux_tc)
    routed_scaling_factor: float = 1.0

    def validate(self, num_experts: int) -> None:
        """Raise ValueError (naming the HF field) when this routing cannot run over num_experts experts."""
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring_func {self.scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} is not supported (supported: {', '.join(GROUP_SCORES)})")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({num_experts})")
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the number of experts ({num_experts})")
        if self.num_groups > 1:
            per_group = num_experts // self.num_groups
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_group ({self.topk_groups}) must be between 1 and n_group ({self.num_groups})")
            if self.topk_groups * per_group < self.top_k:
                raise ValueError(f"topk_group ({self.topk_groups}) groups of {per_group} experts cannot hold "
                                 f"num_experts_per_tok ({self.top_k}) experts")
            if self.group_score == "top2_sum" and per_group < 2:
                raise ValueError(f"n_group ({self.num_groups}) leaves groups of one expert; the top-2 group score "
                                 "needs two")
        if self.scoring == "topk_softmax" and self.num_groups > 1:
            raise ValueError("grouped top-k (n_group) is not supported with top-k-then-softmax routing")


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k] float32, ids [N, k] int64). correction_bias [E]
    (DeepSeek-V3 e_score_correction_bias) is added to the scores for *selection only*; the weights
    come from the unbiased scores."""
    logits = router_logits.float()
    n, e = logits.shape
    if cfg.scoring == "topk_softmax":  # gpt-oss: choose on the logits, softmax over the chosen
        top, ids = torch.topk(logits, k=cfg.top_k, dim=-1)
        weights = top.softmax(dim=-1)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return weights, ids
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        grouped = choice.view(n, cfg.num_groups, e // cfg.num_groups)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_ids = torch.topk(group_scores, k=cfg.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        keep = keep.unsqueeze(-1).expand(n, cfg.num_groups, e // cfg.num_groups).reshape(n, e)
        # DeepSeek-V2 zeroes the dropped groups' (positive) softmax scores; V3 drops its biased scores to -inf
        fill = 0.0 if cfg.group_score == "max" else float("-inf")
        choice = choice.masked_fill(~keep, fill)
    if correction_bias is None and cfg.group_score == "max":
        weights, ids = torch.topk(choice, k=cfg.top_k, dim=-1)
    else:  # the choice was biased or masked to -inf: the weights are the unbiased scores of the chosen
        ids = torch.topk(choice, k=cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def num_routed_experts(hf_config) -> int:
    """The number of routed experts an HF MoE config declares (its field name differs per family)."""
    for field in ("num_local_experts", "n_routed_experts", "num_experts"):
        value = getattr(hf_config, field, None)
        if value:
            return int(value)
    raise ValueError("config declares no experts (num_local_experts / num_experts / n_routed_experts)")


def routing_from_hf_config(hf_config) -> RoutingConfig:
    """The RoutingConfig of an HF MoE config (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5,
    gpt-oss), validated."""
    model_type = getattr(hf_config, "model_type", "")
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    scale = float(getattr(hf_config, "routed_scaling_factor", None) or 1.0)
    if model_type == "mixtral":
        cfg = RoutingConfig(top_k=top_k, renormalize=True)
    elif model_type == "gpt_oss":  # GptOssTopKRouter: topk(logits), softmax over those k
        cfg = RoutingConfig(top_k=top_k, scoring="topk_softmax")
    elif model_type in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe"):
        v3 = model_type != "deepseek_v2"
        method = getattr(hf_config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        scoring = getattr(hf_config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
        if model_type == "glm4_moe":  # HF's GLM router is V3's whatever the config says: refuse another
            for field, value, fixed in (("topk_method", method, "noaux_tc"), ("scoring_func", scoring, "sigmoid")):
                if value != fixed:
                    raise ValueError(f"{field} {value!r} is not supported for glm4_moe (its router is always "
                                     f"{fixed}, as HF transformers' Glm4MoeTopkRouter computes it)")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring_func {scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
        groups = int(getattr(hf_config, "n_group", None) or 1)
        topk_groups = int(getattr(hf_config, "topk_group", None) or 1)
        renorm = bool(getattr(hf_config, "norm_topk_prob", False)) and v3  # HF's V2 router never renormalizes
        if method == "greedy":
            cfg = RoutingConfig(top_k=top_k, scoring=scoring, routed_scaling_factor=scale, renormalize=renorm)
        elif method == "group_limited_greedy":
            cfg = RoutingConfig(top_k=top_k, scoring=scoring, num_groups=groups, topk_groups=topk_groups,
                                group_score="max", routed_scaling_factor=scale, renormalize=renorm)
        elif method == "noaux_tc":
            cfg = RoutingConfig(top_k=top_k, scoring=scoring, num_groups=groups, topk_groups=topk_groups,
                                group_score="top2_sum", routed_scaling_factor=scale, renormalize=renorm)
        else:
            raise ValueError(f"topk_method {method!r} is not supported "
                             "(supported: greedy, group_limited_greedy, noaux_tc)")
    else:  # Qwen2-MoE, Qwen3-MoE and alike: softmax top-k, norm_topk_prob
        cfg = RoutingConfig(top_k=top_k, renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                            routed_scaling_factor=scale)
    cfg.validate(num_routed_experts(hf_config))
    return cfg
