"""The last layer runs only the rows whose hidden states are read (llama.py `output_rows`).

A prefill chunk is sampled at its last row only, so its other rows leave the last layer once its
attention has run.  What comes out must be the same bits as the full forward's rows, on the module
path and on the CPU layer stack, with prompt logprobs (which read every row of a chunk) mixed in.
"""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.models import llama_cpu_stack
from tests.reference.hf_models import random_prompts


def _check_every_pruned_forward(llm):
    """Wraps the model's forward: each call given output_rows also runs in full (its cache writes are
    the same values again) and must equal the full result at those rows.  Returns (rows, kept) per check."""
    model = llm.llm_engine.executor.worker.model
    inner, checked = model.forward, []

    def forward(input_ids, positions, kv_caches, meta, output_rows=None, intermediate=None):
        assert intermediate is None  # one process: no pipeline stage hands anything in
        out = inner(input_ids, positions, kv_caches, meta, output_rows)
        if output_rows is not None:
            full = inner(input_ids, positions, kv_caches, meta)
            assert out.shape == (output_rows.shape[0], full.shape[1])
            assert torch.equal(out, full[output_rows])
            checked.append((input_ids.shape[0], output_rows.shape[0]))
        return out

    model.forward = forward
    return checked


@pytest.mark.parametrize("arch,stack_on", [("llama", True), ("llama", False), ("qwen3", True), ("qwen2", False)])
def test_kept_rows_are_the_full_forwards_bits(arch, stack_on, tiny_models, monkeypatch):
    if stack_on and not cpu_ops.available():
        pytest.skip("native CPU kernels not built here")
    path, hf_model = tiny_models[arch]
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=600,
              max_num_batched_tokens=40)
    checked = _check_every_pruned_forward(llm)
    keeps = []
    if stack_on:
        real = cpu_ops.llama_stack
        # its 15th argument: the rows the stack keeps (None: all)
        monkeypatch.setattr(cpu_ops, "llama_stack", lambda *a: (keeps.append(a[14]), real(*a))[1])
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(5, vocab, 8, 30, seed=11)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with_prompt_lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    params = [with_prompt_lp if i % 2 else plain for i in range(len(prompts))]
    with llama_cpu_stack.SWITCH.forced(stack_on):
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert any(k < n for n, k in checked), "rows were dropped"
    assert any(k == 1 for _, k in checked), "a lone wanted row was checked too"
    if stack_on:
        assert any(k is not None for k in keeps), "the stack dropped rows itself"
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if b.prompt_logprobs is not None:
            for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert pa.keys() == pb.keys()
                for t in pa:
                    assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-5)
