"""create_proposer: the Proposer for a SpeculativeConfig method; the one place that knows every proposer
(an EAGLE-style head plugs in here).  proposer.py holds only the interface."""

from __future__ import annotations

from roofline.spec_decode.proposer import Proposer

MODEL_BASED_METHODS = ("draft_model", "mtp")  # proposers with a KV cache of their own (lookahead slots)


def create_proposer(spec_config, draft_model=None, draft_kv_caches=None, max_positions: int = 0) -> Proposer:
    """The proposer for a SpeculativeConfig (roofline/config.py); a model-based one gets its model and KV
    cache from the Worker, which loads them."""
    if spec_config.method == "ngram":
        from roofline.spec_decode.ngram import NgramProposer

        return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)
    if spec_config.method == "draft_model":
        from roofline.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(draft_model, draft_kv_caches, spec_config.num_speculative_tokens, max_positions)
    if spec_config.method == "mtp":
        from roofline.spec_decode.mtp import MTPProposer

        return MTPProposer(draft_model, draft_kv_caches, spec_config.num_speculative_tokens, max_positions)
    raise ValueError(f"speculative_config.method {spec_config.method!r} is not available in this build")
