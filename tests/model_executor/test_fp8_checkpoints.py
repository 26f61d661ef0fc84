"""Block-FP8 checkpoints (DeepSeek-V3/R1's format) against HF transformers on the same weights dequantized:
tiny random DeepSeek-V3, V3.2 and Llama checkpoints written by `save_pretrained`, their projections quantized to e4m3
with `weight_scale_inv` blocks by tests/reference/fp8_checkpoint.py.  Greedy tokens identical in fp32 on the
CPU with the weights kept in their blocks (one byte each) under the default engine, a 16-token budget, a pool
small enough to preempt, tensor and expert parallelism and MTP speculation; every block back in the pool."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers.quantization import quantized_tensors
from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.test_deepseek import CHECKPOINTS, VARIANTS, build_deepseek  # the same engine variants
from tests.reference.fp8_checkpoint import is_projection, write_fp8_checkpoint
from tests.reference.hf_models import build_tiny_model, hf_greedy
from tests.spec_decode.test_mtp import ReferenceMTP, mtp_spec

pytestmark = pytest.mark.skipif(not cpu_ops.available() and not torch.cuda.is_available(),
                                reason="native CPU kernels unavailable (no C compiler)")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# DeepSeek's [128, 128] blocks (a tiny model's matrices are one partial block each) and small blocks that cut
# the tiny matrices into many, with rows and columns of partial blocks at the edges
BLOCKS = {"128x128": (128, 128), "16x32": (16, 32)}
TP_BLOCKS = {"8x16": (8, 16)}  # 16-column blocks: every tensor-parallel column shard of the tiny model holds whole ones


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """(arch, blocks) -> (FP8 checkpoint, prompts, HF greedy outputs on the dequantized weights), built on first use."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(arch: str, blocks: str, mtp: bool = False):
        key = (arch, blocks, mtp)
        if key not in made:
            root = tmp_path_factory.mktemp(f"fp8-{arch}-{blocks}{'-mtp' if mtp else ''}")
            src = str(root / "src")
            if arch == "deepseek_v3":
                model_type, overrides = CHECKPOINTS["v3"]
                main = build_deepseek(model_type, src, seed=2, num_nextn_predict_layers=int(mtp), **overrides)
                if mtp:  # the MTP layer's tensors (HF's model has none), quantized with the rest
                    from safetensors.torch import save_file

                    tensors = ReferenceMTP(main, seed=7).tensors(main.config.num_hidden_layers)
                    save_file(tensors, os.path.join(src, "mtp.safetensors"))
            elif arch == "deepseek_v32":
                from tests.model_executor.test_deepseek_v32 import build_v32

                build_v32(src)
            else:
                build_tiny_model(arch, src, seed=3)
            write_fp8_checkpoint(src, str(root / "fp8"), str(root / "ref"), block={**BLOCKS, **TP_BLOCKS}[blocks],
                                 quantize=v32_fp8_tensors)
            hf = AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype=torch.float32).eval()
            prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
            made[key] = (str(root / "fp8"), prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts])
        return made[key]

    return get


def v32_fp8_tensors(name: str) -> bool:
    """DeepSeek's FP8 releases: every projection, and V3.2's indexer wq_b / wk (its weights_proj stays fp32)."""
    return is_projection(name) and not name.endswith("indexer.weights_proj.weight") or name.endswith(
        ("indexer.wq_b.weight", "indexer.wk.weight"))


def generate(path, prompts, **engine_args):
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back in the pool
    return [o.outputs[0].token_ids for o in outs], stats, llm


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_deepseek_v3_on_its_fp8_blocks_matches_hf(fp8_models, blocks, variant):
    path, prompts, reference = fp8_models("deepseek_v3", blocks)
    tokens, stats, llm = generate(path, prompts, **VARIANTS[variant])
    assert tokens == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
        worker = llm.llm_engine.executor.worker
        layer = worker.model.model.layers[1]  # a MoE layer: MLA projections and every expert in blocks
        attn, moe = layer.self_attn, layer.mlp
        assert isinstance(attn.q_a_proj.quant, Fp8BlockTensor) and attn.q_a_proj.weight.is_meta
        assert attn.kv_b_proj.quant is None and not attn.kv_b_proj.weight.is_meta  # absorbed: dequantized at load
        assert isinstance(moe.experts.w13_quant, Fp8BlockTensor) and isinstance(moe.experts.w2_quant, Fp8BlockTensor)
        assert isinstance(moe.shared_experts.gate_up_proj.quant, Fp8BlockTensor)
        assert moe.gate.weight.dtype == torch.float32  # the router stays in high precision
        kept = quantized_tensors(worker.model)
        assert worker.weight_bytes["fp8_e4m3"] == sum(t.nbytes for t in kept)  # one byte a weight, plus scales
        assert all(t.data.dtype == torch.uint8 for t in kept)
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


V32_VARIANTS = dict(VARIANTS, tp2=dict(num_kv_blocks=64, tensor_parallel_size=2),
                    ep2_dbo=dict(num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True, enable_dbo=True,
                                 dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2))


@pytest.mark.parametrize("variant", list(V32_VARIANTS))
def test_deepseek_v32_on_its_fp8_blocks_matches_hf(fp8_models, variant):
    """V3.2: the indexer's wq_b and wk in blocks too; sparse attention over FP8 projections (8 x 16 blocks, so
    tensor-parallel shards hold whole column blocks)."""
    path, prompts, reference = fp8_models("deepseek_v32", "8x16")
    tokens, stats, llm = generate(path, prompts, **V32_VARIANTS[variant])
    assert tokens == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
        indexer = llm.llm_engine.executor.worker.model.model.layers[0].self_attn.indexer
        assert isinstance(indexer.wq_b.quant, Fp8BlockTensor) and indexer.weights_proj.quant is None
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


def test_dequantize_at_load_gives_the_same_tokens(fp8_models):
    """--quantized-weights dequantize: dense fp32 copies, the same function."""
    path, prompts, reference = fp8_models("deepseek_v3", "16x32")
    tokens, _, llm = generate(path, prompts, num_kv_blocks=64, quantized_weights="dequantize")
    assert tokens == reference
    assert not quantized_tensors(llm.llm_engine.executor.worker.model)
    assert "fp8_e4m3" not in llm.llm_engine.executor.worker.weight_bytes


@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_llama_on_fp8_blocks_matches_hf(fp8_models, blocks):
    """A dense model (Qwen3-FP8-style checkpoints use the same format): fused qkv and gate/up assembled from
    their FP8 shards; the fp32 layer stack steps aside for the blocks."""
    path, prompts, reference = fp8_models("llama", blocks)
    tokens, _, llm = generate(path, prompts, num_kv_blocks=64)
    assert tokens == reference
    inner = llm.llm_engine.executor.worker.model.model
    assert isinstance(inner.layers[0].self_attn.qkv_proj.quant, Fp8BlockTensor)
    assert inner.cpu_stack is None


def test_qwen3_moe_on_fp8_blocks_matches_hf(fp8_models):
    """Qwen3-MoE-FP8-style checkpoints: the experts (loaded through moe/checkpoint.py) in blocks too."""
    path, prompts, reference = fp8_models("qwen3_moe", "16x32")
    tokens, _, llm = generate(path, prompts, num_kv_blocks=64)
    assert tokens == reference
    moe = llm.llm_engine.executor.worker.model.model.layers[0].mlp.experts
    assert isinstance(moe.w13_quant, Fp8BlockTensor) and isinstance(moe.w2_quant, Fp8BlockTensor)


def test_tensor_parallel_2_slices_blocks_with_their_scales(fp8_models):
    """tp=2 with 8-row x 16-column blocks: column-parallel shards take their rows' scales, row-parallel shards
    (o_proj, down projections, the experts' down columns) whole column blocks."""
    path, prompts, reference = fp8_models("deepseek_v3", "8x16")
    tokens, _, _ = generate(path, prompts, num_kv_blocks=64, tensor_parallel_size=2)
    assert tokens == reference


def test_a_shard_that_cuts_a_column_block_is_a_start_up_error(fp8_models):
    """tp=2 over [128, 128] blocks: each rank's 32 of o_proj's 64 input columns would cut a block."""
    path, _, _ = fp8_models("deepseek_v3", "128x128")
    with pytest.raises(Exception, match=r"proj.weight.*of the \d+ input columns.*128-column FP8 blocks"):
        LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=16, tensor_parallel_size=2)


@pytest.mark.parametrize("dbo", [False, True], ids=["", "dbo"])
def test_expert_parallel_2_matches_hf(fp8_models, dbo):
    """Each rank's experts in blocks; with --enable-dbo the exchanges as two overlapped micro-batches."""
    path, prompts, reference = fp8_models("deepseek_v3", "128x128")
    extra = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2) if dbo else {}
    tokens, _, _ = generate(path, prompts, num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True,
                            **extra)
    assert tokens == reference


def test_mtp_speculation_on_fp8_blocks_matches_hf(fp8_models):
    path, prompts, reference = fp8_models("deepseek_v3", "16x32", mtp=True)
    tokens, stats, llm = generate(path, prompts, num_kv_blocks=64, speculative_config=mtp_spec(2))
    assert tokens == reference
    assert stats.spec_decode.num_draft_tokens > 0
    mtp = llm.llm_engine.executor.worker.draft_model
    assert isinstance(mtp.eh_proj.quant, Fp8BlockTensor) and isinstance(mtp.mlp.experts.w13_quant, Fp8BlockTensor)


def test_bad_checkpoint_fails_at_start_up_naming_the_tensor(fp8_models, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = fp8_models("deepseek_v3", "128x128")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            (bad / f).write_bytes(open(os.path.join(path, f), "rb").read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(Exception, match=f"{name}' is missing"):
        LLM(str(bad), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=16)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="quantization_config.quant_method 'gptq'"):
        LLM(str(bad), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_checks.sh fp8)")
@pytest.mark.parametrize("gemm", ["weight_only", "w8a8"])
def test_cuda_layers_run_their_fp8_blocks_through_triton(fp8_models, gemm):
    """On CUDA the projections keep their blocks and run the Triton GEMMs: weight-only is the function of the
    dequantized weights (HF's greedy tokens in fp32); w8a8 rounds activations to e4m3 per 128-column group
    (DeepSeek's recipe), so only its first token is checked against HF, the rest for completion."""
    path, prompts, reference = fp8_models("llama", "128x128")
    llm = LLM(path, dtype="float32", device="cuda", show_progress=False, num_kv_blocks=64, fp8_gemm=gemm,
              enforce_eager=True)  # eager: graph capture is not what this checks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    qkv = llm.llm_engine.executor.worker.model.model.layers[0].self_attn.qkv_proj.quant
    assert isinstance(qkv, Fp8BlockTensor) and qkv.data.is_cuda and qkv.gemm == gemm
    if gemm == "weight_only":
        assert tokens == reference
    else:
        assert [t[0] for t in tokens] == [r[0] for r in reference] and all(len(t) == len(r) for t, r in zip(tokens, reference))


def test_eplb_moves_fp8_experts_between_ranks(fp8_models):
    """EPLB with the experts in FP8 blocks: a rebalance moves their bytes and scales (one exchange per dtype)
    mid-generation, and greedy tokens stay HF's."""
    path, prompts, reference = fp8_models("deepseek_v3", "128x128")
    tokens, stats, _ = generate(path, prompts, num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True,
                                enable_eplb=True,
                                eplb_config='{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}')
    assert tokens == reference
    assert stats.eplb_rebalances == stats.parallel_steps // 3 >= 2
