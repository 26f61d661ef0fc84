"""Same function as the reference: greedy tokens identical to HF transformers in fp32 on CPU,
and top-5 logprobs within 1e-3 of HF's log-softmax."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.reference.hf_models import hf_greedy, hf_logprobs, random_prompts

CHATS = [
    "What is the capital of France?",
    "Hi",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German.",
    "You are planning a trip to Japan for ten days in spring. Suggest an itinerary that covers Tokyo, "
    "Kyoto and Osaka, with one day trip, and mention what to eat in each city.",
    "What is 12 times 12?",
]


def test_smollm2_greedy_matches_hf(default_llm, hf_default_model):
    tok = default_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               for c in CHATS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    assert len({len(i) for i in ids}) >= 6, "prompts of different lengths"
    outs = default_llm.generate([{"prompt_token_ids": i} for i in ids],
                                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5),
                                use_tqdm=False)
    for i, out in zip(ids, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == 40
        ref = hf_greedy(hf_default_model, i, 40)
        assert ours == ref, (tok.decode(ours), tok.decode(ref))
        # logprobs: every generated position, top-5 within 1e-3 of HF's log-softmax
        ref_lp = hf_logprobs(hf_default_model, i + ours[:-1])[len(i) - 1 :]
        for pos, lp in enumerate(out.outputs[0].logprobs):
            assert len(lp) >= 5
            for tid, entry in lp.items():
                assert abs(entry.logprob - ref_lp[pos, tid].item()) < 1e-3
            top5 = ref_lp[pos].topk(5).indices.tolist()
            assert set(top5) <= set(lp)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_hf(arch, tiny_models):
    path, hf_model = tiny_models[arch]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=128, show_progress=False)
    prompts = random_prompts(6, hf_model.config.vocab_size, 3, 40, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, p, 24)
        ref_lp = hf_logprobs(hf_model, p + out.outputs[0].token_ids[:-1])[len(p) - 1 :]
        for pos, lp in enumerate(out.outputs[0].logprobs):
            for tid, entry in lp.items():
                assert abs(entry.logprob - ref_lp[pos, tid].item()) < 1e-3


def test_prompt_logprobs_match_hf(tiny_models):
    path, hf_model = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=16,
              show_progress=False)
    prompt = random_prompts(1, hf_model.config.vocab_size, 40, 40, seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    ref = hf_logprobs(hf_model, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3
        assert set(ref[pos - 1].topk(3).indices.tolist()) <= set(entry)


def test_parity_above_runs_the_cpu_fast_path(default_llm):
    """The HF-parity tests check what users run: on CPU, the native-kernel attention backend and the
    pre-packed projection weights (when this machine can build / pack them)."""
    from roofline.model_executor.layers import cpu_gemm, cpu_ops

    model = default_llm.llm_engine.executor.worker.model
    attn = model.model.layers[0].self_attn
    if cpu_ops.available():
        assert attn.backend.name == "cpu"
    if cpu_gemm.available():
        assert attn.qkv_proj.cpu_packed is not None and model.lm_head.cpu_packed is not None
