"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """arch -> (checkpoint dir, prompts, HF greedy outputs) for the tiny MoE checkpoints (test_moe_models,
    test_expert_parallel_models, test_data_parallel_attention): written and run through HF once."""
    from tests.engine.test_feature_invariance import GREEDY, shared_prefix_prompts
    from tests.reference.hf_models import TINY_MOE, build_tiny_model, hf_greedy

    out = {}
    for arch in TINY_MOE:
        path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        model = build_tiny_model(arch, path, seed=2)
        prompts = shared_prefix_prompts(model.config.vocab_size, n=5, seed=1)
        out[arch] = (path, prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    return out
