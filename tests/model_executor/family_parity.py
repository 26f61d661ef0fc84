"""What every model family's HF-parity tests share: a tiny random checkpoint with prompts sharing a prefix and
HF's greedy tokens for them, the engine run that checks every KV block came back, the engine settings each
family is run under, and the logprobs comparison."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from roofline import LLM, SamplingParams
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.test_deepseek import VARIANTS
from tests.reference.hf_models import build_tiny_model, hf_greedy, hf_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_VARIANTS = dict(VARIANTS, tp2=dict(num_kv_blocks=64, tensor_parallel_size=2))


def tiny_family(tmp_path_factory, arch: str, seed: int = 5, **overrides):
    """(checkpoint path, 4 prompts sharing a prefix, HF's greedy tokens for each, the HF model)."""
    path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
    hf = build_tiny_model(arch, path, seed=seed, **overrides)
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
    return path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts], hf


def generate(path, prompts, sampling=GREEDY, inspect: Optional[Callable] = None, lora_request=None, **engine_args):
    """(outputs, stats) of the engine on the prompts' token ids, fp32 on the CPU, after checking that every
    KV block is back in the pool; inspect(llm) runs before the engine shuts down (a one-rank engine's worker
    and model are in-process).  lora_request: as LLM.generate takes it (LoRA adapters)."""
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False,
                            lora_request=lora_request)
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        if inspect is not None:
            inspect(llm)
        return outs, stats
    finally:
        llm.llm_engine.shutdown()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def inner_model(llm):
    """The decoder stack (model.model) of a one-rank engine."""
    return llm.llm_engine.executor.worker.model.model


def assert_logprobs_close_to_hf(path, prompts, hf, atol: float = 1e-4, **engine_args) -> None:
    """The logprob of each of 6 greedy tokens for 2 prompts within atol of HF's log-softmax there."""
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs, _ = generate(path, prompts[:2], sampling, **dict(dict(num_kv_blocks=64), **engine_args))
    for p, o in zip(prompts[:2], outs):
        toks = o.outputs[0].token_ids
        want = hf_logprobs(hf, p + toks)[len(p) - 1:-1]  # [T, V] log-softmax at each generated position
        got = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks)])
        torch.testing.assert_close(got, want[torch.arange(len(toks)), torch.tensor(toks)], atol=atol, rtol=atol)


def assert_greedy_matches_hf(path, prompts, reference, variant: str, engine_args: dict,
                             inspect: Optional[Callable] = None) -> None:
    """One engine setting of a family's parity test: HF's greedy tokens (and every block back, via generate);
    the default setting also hits the prefix cache and runs inspect(llm), a preemption setting preempts."""
    outs, stats = generate(path, prompts, inspect=inspect if variant == "default" else None, **engine_args)
    assert tokens(outs) == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0
