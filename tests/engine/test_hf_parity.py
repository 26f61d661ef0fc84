"""Same function as the reference: greedy tokens identical to HF transformers in fp32, and top-5
logprobs within 1e-3 of HF's log-softmax.  On the CPU always; on CUDA too where the machine has a GPU
(our engine on CUDA -- Triton attention, fused ops, CUDA graphs for decodes -- against HF on the same
GPU, both fp32).

On the default model, HF's greedy tokens are read from one forward pass over prompt + our tokens (HF's
argmax at each position given the tokens before it: equal to ours exactly when ours are HF's greedy
continuation), cross-checked once against HF's generate()."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.reference.hf_models import hf_greedy, hf_logprobs, hf_on, parity_devices, random_prompts

DEVICES = parity_devices()

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


@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_greedy_matches_hf(device, smollm2_on, hf_default_model):
    default_llm = smollm2_on(device)
    hf_default_model = hf_on(hf_default_model, device)
    tok = default_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               for c in CHATS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    assert len({len(i) for i in ids}) >= 6, "prompts of different lengths"
    outs = default_llm.generate([{"prompt_token_ids": i} for i in ids],
                                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5),
                                use_tqdm=False)
    # HF's greedy tokens: through generate() for the first chat; for every chat, HF's choice at each
    # position given the tokens before it (one forward pass, which also gives the logprobs below)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf_default_model, ids[0], 40)
    for i, out in zip(ids, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == 40
        # logprobs: every generated position, top-5 within 1e-3 of HF's log-softmax
        ref_lp = hf_logprobs(hf_default_model, i + ours[:-1])[len(i) - 1 :]
        ref = ref_lp.argmax(-1).tolist()
        assert ours == ref, (tok.decode(ours), tok.decode(ref))
        for pos, lp in enumerate(out.outputs[0].logprobs):
            assert len(lp) >= 5
            for tid, entry in lp.items():
                assert abs(entry.logprob - ref_lp[pos, tid].item()) < 1e-3
            top5 = ref_lp[pos].topk(5).indices.tolist()
            assert set(top5) <= set(lp)
    if device == "cuda":
        assert_runs_the_gpu_fast_path(default_llm, {})


# On CUDA the same check runs three ways: the default (Triton attention, decode steps replayed in CUDA
# graphs), Triton eagerly, and the torch reference backend.
ENGINE_VARIANTS = {"cpu": [{}], "cuda": [{}, {"enforce_eager": True}, {"attention_backend": "torch"}]}


def assert_runs_the_gpu_fast_path(llm, variant):
    """What a CUDA engine of `variant` must have run: its attention backend, and graphs replayed
    exactly when they are on."""
    worker = llm.llm_engine.executor.worker
    backend = worker.model.model.layers[0].self_attn.backend.name
    graphs = worker.runner.graph_runner
    if variant.get("attention_backend") == "torch":
        assert backend == "torch" and graphs is None
    elif variant.get("enforce_eager"):
        assert backend == "triton" and graphs is None
    else:
        assert backend == "triton" and graphs is not None and graphs.graphs and graphs.num_replays > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_hf(arch, device, tiny_models):
    path, hf_model = tiny_models[arch]
    hf_model = hf_on(hf_model, device)
    prompts = random_prompts(6, hf_model.config.vocab_size, 3, 40, seed=3)
    refs = [hf_greedy(hf_model, p, 24) for p in prompts]
    for variant in ENGINE_VARIANTS[device]:
        llm = LLM(path, dtype="float32", device=device, num_kv_blocks=128, show_progress=False, **variant)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
                            use_tqdm=False)
        for p, ref, out in zip(prompts, refs, outs):
            assert out.outputs[0].token_ids == ref, variant
            ref_lp = hf_logprobs(hf_model, p + out.outputs[0].token_ids[:-1])[len(p) - 1 :]
            for pos, lp in enumerate(out.outputs[0].logprobs):
                for tid, entry in lp.items():
                    assert abs(entry.logprob - ref_lp[pos, tid].item()) < 1e-3, variant
        if device == "cuda":
            assert_runs_the_gpu_fast_path(llm, variant)
        del llm


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_match_hf(device, tiny_models):
    path, hf_model = tiny_models["llama"]
    hf_model = hf_on(hf_model, device)
    llm = LLM(path, dtype="float32", device=device, num_kv_blocks=64, max_num_batched_tokens=16,
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
    projections computed on the file's quantized blocks (when this machine can build the kernels)."""
    from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops

    model = default_llm.llm_engine.executor.worker.model
    attn = model.model.layers[0].self_attn
    if cpu_ops.available():
        assert attn.backend.name == "cpu"
    if cpu_gemm.available():  # the layers on their GGUF blocks (--gguf-weights native), the LM head packed
        assert attn.qkv_proj.quant is not None and model.lm_head.cpu_packed is not None
