"""The prefix cache keys blocks by adapter: one prompt under the base model and two adapters gives three
continuations (each PEFT's), and cached blocks are found only under the adapter that computed them."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from roofline.core.kv_cache_manager import hash_block
from tests.reference.hf_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def family(lora_family):
    return lora_family("llama")


def test_blocks_are_reused_only_under_one_adapter(family):
    prompt = family.prompts[0]  # 3 full blocks of 16
    assert len(prompt) > 48
    llm = LLM(family.path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    try:
        def run(k):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=family.loras[k])[0]
            return out.outputs[0].token_ids, out.num_cached_tokens

        first = [run(k) for k in (0, 1, 2)]  # base, a1, a2: nothing computed under the others is reused
        assert [cached for _, cached in first] == [0, 0, 0]
        continuations = [toks for toks, _ in first]
        assert len({tuple(t) for t in continuations}) == 3
        assert continuations == [hf_greedy(ref, prompt, GREEDY.max_tokens) for ref in family.refs]
        for k in (2, 1, 0):  # again: each finds its own blocks, and continues as before
            toks, cached = run(k)
            assert cached == 48 and toks == continuations[k]
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.llm_engine.shutdown()


def test_hash_keys_the_adapter():
    tokens = list(range(16))
    base = hash_block(None, tokens, None)
    a, b = hash_block(None, tokens, None, "1\x00a\x00/a"), hash_block(None, tokens, None, "2\x00b\x00/b")
    assert len({base, a, b}) == 3
    assert hash_block(None, tokens, None, "1\x00a\x00/a") == a
    # no cache salt spells an adapter: the key is length-prefixed and comes before the salt
    assert hash_block(None, tokens, "x", "1\x00a\x00/a") not in {hash_block(None, tokens, "1\x00a\x00/a"),
                                                                hash_block(None, tokens, "x"), a}
