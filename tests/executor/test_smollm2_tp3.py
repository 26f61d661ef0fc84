"""The default SmolLM2-135M (9 query heads, 3 KV heads, GGUF) split over 3 ranks on CPU with gloo:
greedy tokens identical to tp=1 (a flip only at a proven tie); grammar-constrained rows match their regex."""

from __future__ import annotations

import re

import pytest

from roofline import LLM, SamplingParams
from roofline.sampling_params import StructuredOutputsParams
from tests.executor.tp_helpers import assert_same_greedy, chat_prompts



@pytest.mark.slow
def test_smollm2_tp3_greedy_matches_tp1(default_llm):
    prompts = chat_prompts(default_llm.get_tokenizer())
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = default_llm.generate(prompts, sp, use_tqdm=False)
    llm = LLM(tensor_parallel_size=3, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    try:
        attn_heads = llm.llm_engine.model_config.hf_config.num_attention_heads
        assert attn_heads == 9 and llm.llm_engine.model_config.hf_config.num_key_value_heads == 3
        assert_same_greedy(ref, llm.generate(prompts, sp, use_tqdm=False))
        # structured outputs: the step's bitmask reaches every rank inside the SchedulerOutput
        regex = "[A-Z][a-z]{1,8} [0-9]{2}"
        constrained = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex))
        outs = llm.generate(prompts, [constrained, sp, constrained], use_tqdm=False)
        texts = [outs[i].outputs[0].text for i in (0, 2)]
        assert all(re.fullmatch(regex, t) for t in texts), texts
    finally:
        llm.llm_engine.shutdown()
