"""The CPU layer stack (models/llama_cpu_stack.py): every decoder layer of a step in one native call.

It calls the kernels the torch modules call, in the same order, so its hidden states must be the
same bits as the module path's, in every step of a run that mixes decodes, chunked prefills and
chunks over cached prefixes; and it must stand aside wherever it does not apply.
"""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.models import llama_cpu_stack
from tests.reference.hf_models import build_tiny_model, random_prompts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")


def _model(llm):
    return llm.llm_engine.executor.worker.model


def _record_forwards(llm):
    """Wraps the model's forward: returns the list every step's hidden states are appended to."""
    model = _model(llm)
    seen, inner = [], model.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(out.clone())
        return out

    model.forward = forward
    return seen


def _run(llm, prompts, stack_on: bool):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with llama_cpu_stack.SWITCH.forced(stack_on):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_same_bits(hidden_stack, hidden_modules, with_stack, modules):
    """Every step's hidden states, every token and every logprob of the two runs are equal."""
    assert len(hidden_modules) == len(hidden_stack) > 10
    for a, b in zip(hidden_stack, hidden_modules):
        assert torch.equal(a, b)
    for a, b in zip(with_stack, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: e.logprob for t, e in lp.items()} for lp in a.outputs[0].logprobs] == \
               [{t: e.logprob for t, e in lp.items()} for lp in b.outputs[0].logprobs]


def _pair(path, **kwargs):
    """Two engines on one checkpoint (each run starts from an empty prefix cache), the ITL budget off: the
    default budget sizes prefill chunks from each engine's measured step times, so two engines could cut the
    prompts differently (on a 2-core Zen 3 they did: 14 and 17 tokens in the same step), and other chunks are
    other sums -- a bit-for-bit comparison needs one schedule."""
    kwargs.setdefault("target_itl_ms", 0)
    return [LLM(path, dtype="float32", device="cpu", show_progress=False, **kwargs) for _ in range(2)]


@pytest.mark.parametrize("arch,block_size", [("llama", 16), ("qwen2", 1), ("qwen3", 16), ("llama", 32)])
def test_hidden_states_are_the_module_paths_bits(arch, block_size, tiny_models, monkeypatch):
    path, hf_model = tiny_models[arch]
    # a 24-token budget: long prompts are chunked and share steps with decodes; a shared prefix makes
    # later prompts start from cached blocks (chunks over a cached prefix)
    llm, ref = _pair(path, num_kv_blocks=600, block_size=block_size, max_num_batched_tokens=24)
    stack = _model(llm).model.cpu_stack
    assert isinstance(stack, llama_cpu_stack.CpuLayerStack)
    vocab = hf_model.config.vocab_size
    prefix = random_prompts(1, vocab, 40, 40, seed=7)[0]
    prompts = random_prompts(3, vocab, 3, 30, seed=5) + [prefix + p for p in random_prompts(3, vocab, 5, 20, seed=6)]

    calls = []
    real = cpu_ops.llama_stack
    monkeypatch.setattr(cpu_ops, "llama_stack", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    hidden_stack, seen = _record_forwards(llm), _record_forwards(ref)
    with_stack = _run(llm, prompts, True)
    assert calls and max(calls) > 1, "the stack ran"
    n_calls = len(calls)
    modules = _run(ref, prompts, False)
    assert len(calls) == n_calls, "switched off, the modules ran"
    _assert_same_bits(hidden_stack, seen, with_stack, modules)


def test_lora_steps_run_in_the_stack_with_the_module_paths_bits(tiny_models, tmp_path, monkeypatch):
    """Steps with LoRA adapter rows (two adapters of different ranks and targets, and base-model rows, in one
    batch; chunked prefills whose last layer keeps one row; a lone decoding row at the end) go through the stack
    and give the module path's hidden states, logprobs and tokens bit for bit."""
    from roofline import LoRARequest
    from tests.reference.lora_adapters import LLAMA_TARGETS, write_peft_adapter

    path, hf_model = tiny_models["llama"]
    write_peft_adapter(str(tmp_path / "a1"), hf_model, 8, 16, LLAMA_TARGETS, seed=1)
    write_peft_adapter(str(tmp_path / "a2"), hf_model, 4, 8, ["q_proj", "v_proj", "down_proj"], seed=2,
                       use_rslora=True)  # no gate/up weights: that projection still runs unfused in these steps
    loras = [None, LoRARequest("a1", 1, str(tmp_path / "a1")), LoRARequest("a2", 2, str(tmp_path / "a2"))]
    llm, ref = _pair(path, num_kv_blocks=600, max_num_batched_tokens=24, enable_lora=True, max_loras=2,
                     max_lora_rank=8)
    vocab = hf_model.config.vocab_size
    prompts = random_prompts(6, vocab, 3, 30, seed=5)
    mix = [loras[k] for k in (0, 1, 2, 1, 2, 1)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 6 * i, ignore_eos=True, logprobs=3) for i in range(6)]

    adapter_calls = []
    real = cpu_ops.llama_stack
    monkeypatch.setattr(cpu_ops, "llama_stack", lambda *a, **k: (
        adapter_calls.append(a[0].shape[0]) if a[-1] is not None else None, real(*a, **k))[1])
    hidden_stack, seen = _record_forwards(llm), _record_forwards(ref)

    def run(engine, stack_on):
        with llama_cpu_stack.SWITCH.forced(stack_on):
            return engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   lora_request=mix)

    with_stack = run(llm, True)
    assert adapter_calls and max(adapter_calls) > 1 and 1 in adapter_calls, "adapter steps ran in the stack"
    n_calls = len(adapter_calls)
    modules = run(ref, False)
    assert len(adapter_calls) == n_calls, "switched off, the modules ran"
    _assert_same_bits(hidden_stack, seen, with_stack, modules)
    plain = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=600)
    base = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert with_stack[0].outputs[0].token_ids == base[0].outputs[0].token_ids  # the base rows are the base model
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(with_stack[1:], base[1:]))


@pytest.fixture
def threads():
    """Sets torch's thread count for one test (the single-row route depends on it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("arch,num_threads", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 1)])
def test_a_single_stream_runs_in_the_stack_with_the_module_paths_bits(arch, num_threads, tiny_models, threads,
                                                                      monkeypatch):
    """One request decoding: each 1-row step goes through the stack's GEMV route, and its hidden
    states are the modules' bits (their GEMV route over the same dense weights)."""
    threads(num_threads)
    path, hf_model = tiny_models[arch]
    llm, ref = _pair(path, num_kv_blocks=64)
    assert _model(llm).model.cpu_stack.single_rows
    prompt = random_prompts(1, hf_model.config.vocab_size, 20, 20, seed=3)
    calls = []
    real = cpu_ops.llama_stack
    monkeypatch.setattr(cpu_ops, "llama_stack", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    hidden_stack, seen = _record_forwards(llm), _record_forwards(ref)
    with_stack = _run(llm, prompt, True)
    assert calls.count(1) == 11, "every decode step (one row) ran in the stack"
    modules = _run(ref, prompt, False)
    assert len(calls) == 12 and len(seen) == len(hidden_stack) == 12
    for a, b in zip(hidden_stack, seen):
        assert torch.equal(a, b)
    assert with_stack[0].outputs[0].token_ids == modules[0].outputs[0].token_ids
    assert [{t: e.logprob for t, e in lp.items()} for lp in with_stack[0].outputs[0].logprobs] == \
           [{t: e.logprob for t, e in lp.items()} for lp in modules[0].outputs[0].logprobs]


def test_which_batches_it_takes(tiny_models, threads):
    path, _ = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    stack = _model(llm).model.cpu_stack
    d = stack.hidden
    for n in (1, 2):
        threads(n)
        assert stack.takes(torch.zeros(2, d))
        assert stack.takes(torch.zeros(1, d))  # one row: the native GEMV route, as in the modules
    stack.single_rows = False  # dense weights without the GEMV layout: single rows stay with the modules
    assert not stack.takes(torch.zeros(1, d))
    assert not stack.takes(torch.zeros(4, d, dtype=torch.float64))
    with llama_cpu_stack.SWITCH.forced(False):
        assert not stack.takes(torch.zeros(4, d))
    with cpu_ops.forced(False):
        assert not stack.takes(torch.zeros(4, d))


def test_it_stands_aside_where_it_does_not_apply(tiny_models, tmp_path):
    path, _ = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, attention_backend="torch", show_progress=False)
    model = _model(llm)
    assert model.model.cpu_stack is None
    assert "attention backend" in llama_cpu_stack.CpuLayerStack.supports(model)

    biased = str(tmp_path / "mlp-bias")
    build_tiny_model("llama", biased, seed=2, mlp_bias=True)
    llm = LLM(biased, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    model = _model(llm)
    assert model.model.cpu_stack is None
    assert "gate/up" in llama_cpu_stack.CpuLayerStack.supports(model)


def test_attention_and_projection_biases_are_applied(tmp_path):
    """Llama with attention_bias: q/k/v and o projections carry biases, which the stack adds in its
    GEMM epilogues (the modules add o's after the GEMM): same bits."""
    path = str(tmp_path / "attn-bias")
    hf_model = build_tiny_model("llama", path, seed=3, attention_bias=True)
    llm, ref = _pair(path, num_kv_blocks=128)
    assert _model(llm).model.cpu_stack is not None
    assert _model(llm).model.layers[0].self_attn.o_proj.bias is not None
    prompts = random_prompts(4, hf_model.config.vocab_size, 3, 30, seed=9)
    hidden_stack, seen = _record_forwards(llm), _record_forwards(ref)
    _run(llm, prompts, True)
    _run(ref, prompts, False)
    assert len(seen) == len(hidden_stack) and all(torch.equal(a, b) for a, b in zip(hidden_stack, seen))


def test_kv_caches_of_the_wrong_shape_are_refused(tiny_models):
    path, _ = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    stack = _model(llm).model.cpu_stack
    layers = stack.table.shape[0]
    with pytest.raises(ValueError, match="KV caches"):
        stack._bind_caches([torch.zeros(2, 4, 16, stack.num_kv_heads, stack.head_dim)] * (layers + 1))
    with pytest.raises(ValueError, match="KV cache 0"):
        stack._bind_caches([torch.zeros(2, 4, 16, stack.num_kv_heads, stack.head_dim + 1)] * layers)
