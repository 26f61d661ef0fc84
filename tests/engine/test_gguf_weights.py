"""Weights kept in GGUF blocks (--quantized-weights native): the engine computes on them natively and is
the same function as HF transformers over the dequantized values -- every format, batched and single
stream, with the layer stack -- and the default model runs on its Q4_1 blocks by default."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.cpu import ops as cpu_ops
from roofline.cpu.gguf_quant import FORMATS
from roofline.model_executor.models import llama_cpu_stack
from tests.reference.hf_models import build_tiny_model, hf_greedy, hf_logprobs, random_prompts
from tests.reference.quantized import quantized_layer_weights, serve_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")

# 256-wide layers: the K-quants' super-blocks are 256 values
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wide-llama"))
    return path, build_tiny_model("llama", path, seed=2, **WIDE)


def _generate(llm, prompts, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_matches_hf(outs, prompts, hf_model):
    for p, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        assert ours == hf_greedy(hf_model, p, len(ours))
        ref_lp = hf_logprobs(hf_model, p + ours[:-1])[len(p) - 1:]
        for pos, lp in enumerate(out.outputs[0].logprobs):
            for tid, entry in lp.items():
                assert abs(entry.logprob - ref_lp[pos, tid].item()) < 1e-3


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_every_format_matches_hf_on_the_dequantized_weights(qtype, wide_llama, monkeypatch):
    path, hf_model = wide_llama
    blocks = quantized_layer_weights(hf_model, qtype)  # hf_model now holds the blocks' values
    serve_blocks(monkeypatch, blocks)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=256, max_num_batched_tokens=32,
              show_progress=False)
    worker = llm.llm_engine.executor.worker
    layer = worker.model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.quant is not None and lin.quant.format == FORMATS[qtype][0]
        assert lin.weight.device.type == "meta" and lin.cpu_packed is None  # no fp32 copy kept
    assert isinstance(worker.model.model.cpu_stack, llama_cpu_stack.CpuLayerStack)
    assert worker.weight_bytes[FORMATS[qtype][0]] == sum(b.nbytes for b in blocks.values())

    vocab = hf_model.config.vocab_size
    prompts = random_prompts(5, vocab, 3, 50, seed=qtype)  # chunked prefills beside decodes
    _assert_matches_hf(_generate(llm, prompts), prompts, hf_model)
    _assert_matches_hf(_generate(llm, prompts[:1]), prompts[:1], hf_model)  # one stream: the GEMV route
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back in the pool


def _record_forwards(llm):
    model = llm.llm_engine.executor.worker.model
    seen, inner = [], model.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(out.clone())
        return out

    model.forward = forward
    return seen


@pytest.mark.parametrize("qtype", [3, 12, 14])
def test_the_layer_stack_gives_the_module_paths_bits_on_blocks(qtype, wide_llama, monkeypatch):
    path, hf_model = wide_llama
    serve_blocks(monkeypatch, quantized_layer_weights(hf_model, qtype))
    llm, ref = [LLM(path, dtype="float32", device="cpu", num_kv_blocks=256, max_num_batched_tokens=24,
                    show_progress=False) for _ in range(2)]
    prompts = random_prompts(4, hf_model.config.vocab_size, 3, 40, seed=1)
    hidden_stack, hidden_modules = _record_forwards(llm), _record_forwards(ref)
    calls = []
    real = cpu_ops.llama_stack
    monkeypatch.setattr(cpu_ops, "llama_stack", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    for batch in (prompts, prompts[:1]):  # batched steps, then a single stream (1-row steps)
        with llama_cpu_stack.SWITCH.forced(True):
            a = _generate(llm, batch, 8)
        n = len(calls)
        with llama_cpu_stack.SWITCH.forced(False):
            b = _generate(ref, batch, 8)
        assert len(calls) == n and n > 0
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert 1 in calls and max(calls) > 1
    assert len(hidden_stack) == len(hidden_modules) > 10
    for x, y in zip(hidden_stack, hidden_modules):
        assert torch.equal(x, y)


def test_default_model_runs_on_its_blocks(default_llm):
    """The default model (a Q4_1 file with a Q8_0 embedding) keeps its layers' Q4_1 blocks by default:
    the HF-parity and feature-invariance tests on it run the native quantized kernels."""
    worker = default_llm.llm_engine.executor.worker
    assert default_llm.llm_engine.config.model_config.quantized_weights == "native"
    lin = worker.model.model.layers[0].self_attn.qkv_proj
    assert lin.quant is not None and lin.quant.format == "Q4_1"
    # 30 layers x (q, k, v, o: 576 x (576 + 192 + 192 + 576); gate, up, down: 3 x 576 x 1536) at 20 bytes / 32
    assert worker.weight_bytes["Q4_1"] == 30 * 576 * (576 + 192 + 192 + 576 + 3 * 1536) * 20 // 32
    assert worker.weight_bytes["float32"] < 120e6  # embedding (tied LM head) and norms
    assert default_llm.llm_engine.get_stats().weight_bytes == worker.weight_bytes  # what /metrics exports
    # the live roofline's bound counts the bytes the layers hold, not fp32 copies of them
    assert default_llm.llm_engine.step_roofline.weight_bytes_read(1) == sum(worker.weight_bytes.values())


@pytest.mark.parametrize("flag", ["quantized_weights", "gguf_weights"])  # the switch, and its old name
def test_dequantize_mode_keeps_fp32(flag):
    llm = LLM(**{flag: "dequantize"}, show_progress=False, num_kv_blocks=16)
    worker = llm.llm_engine.executor.worker
    assert worker.model.model.layers[0].self_attn.qkv_proj.quant is None
    assert set(worker.weight_bytes) == {"float32"}


@pytest.mark.parametrize("flag", ["quantized_weights", "gguf_weights"])
def test_bad_quantized_weights_value_is_refused(flag):
    with pytest.raises(ValueError, match=flag):
        LLM(**{flag: "int4"}, show_progress=False)
    if flag == "gguf_weights":
        with pytest.raises(ValueError, match="old name of quantized_weights"):
            LLM(gguf_weights="native", quantized_weights="dequantize", show_progress=False)


@pytest.fixture(scope="module")
def q8_llm():
    return LLM(show_progress=False, num_kv_blocks=512, gguf_activations="q8")


Q8_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]


def test_q8_activations_stay_close_to_fp32(default_llm, q8_llm):
    """--gguf-activations q8 on the default model: its Q4_1 layers (and Q8_0 head) multiply 8-bit
    activations; the first tokens are fp32's and the chosen tokens' logprobs within 0.25 of fp32's."""
    lin = q8_llm.llm_engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert lin.quant.quantize_activations and lin.quant.kernel_type == 3 | 0x80
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for a, b in zip(default_llm.generate(Q8_PROMPTS, sp, use_tqdm=False), q8_llm.generate(Q8_PROMPTS, sp, use_tqdm=False)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        assert same >= 3
        for i in range(same):
            assert abs(a.outputs[0].logprobs[i][ta[i]].logprob - b.outputs[0].logprobs[i][tb[i]].logprob) < 0.25


def test_q8_activations_leave_greedy_unchanged_by_batching(q8_llm):
    """A row's matmul values never depend on the rows beside it, so in q8 mode a request decodes the
    same tokens alone and in a batch.  (Speculative verification and prefill chunks also run attention
    for several queries at once, whose fp32 sums differ slightly from one query's; the activations'
    rounding can amplify that into another token, so q8 mode does not promise those invariances: W7
    reports same_tokens.)"""
    import json

    tok = q8_llm.llm_engine.tokenizer
    doc = json.__doc__[:400]
    prompts = [tok.encode(doc + "\n\n" + doc[:80], add_special_tokens=False)] + \
        [tok.encode(p, add_special_tokens=False) for p in Q8_PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    alone = [q8_llm.generate([x], sp, use_tqdm=False)[0].outputs[0].token_ids for x in inputs]
    batched = [o.outputs[0].token_ids for o in q8_llm.generate(inputs, sp, use_tqdm=False)]
    assert batched == alone


def test_bad_gguf_activations_value_is_refused():
    with pytest.raises(ValueError, match="gguf_activations"):
        LLM(gguf_activations="int4", show_progress=False)
