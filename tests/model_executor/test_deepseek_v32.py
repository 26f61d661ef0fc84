"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against HF transformers' DeepseekV32ForCausalLM on tiny random
checkpoints written by `save_pretrained`: index_topk 8 with prompts of 36-59 tokens, so most query tokens
attend to 8 positions chosen by the lightning indexer.  Greedy tokens identical in fp32 on the CPU under the
default engine (prefix hits), a 16-token budget (chunked prefill: the indexer reads earlier chunks' keys from
its cache), a pool small enough to preempt (recompute and swap), tensor parallelism 2 and expert parallelism
2, and with V3.2's MTP layer proposing; every block back in the pool.  Also: the sparse latent attention
equals dense attention restricted to the kept positions, a sequence within index_topk equals dense MLA, the
indexer's keys have their own cache spec, and a bad index_topk fails naming the field.  The kernels' own
tests are tests/attention/test_dsa.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.attention import kv_spec
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.test_deepseek import TINY_DS, VARIANTS, build_deepseek, ds_config
from tests.reference.hf_models import hf_greedy

V32 = dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
           index_n_heads=16, index_head_dim=32, index_topk=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def v32_config(**overrides):
    return ds_config("deepseek_v32", **dict(V32, **overrides))


def build_v32(path: str, seed: int = 2, **overrides):
    """A random HF DeepSeek-V3.2 saved to `path` (norms, the indexer's LayerNorm too, perturbed)."""
    return build_deepseek("deepseek_v32", path, seed=seed, **dict(V32, **overrides))


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """(checkpoint, prompts sharing a prefix, HF greedy outputs)."""
    path = str(tmp_path_factory.mktemp("tiny-v32"))
    hf = build_v32(path)
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
    assert min(len(p) for p in prompts) > 4 * V32["index_topk"]
    return path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts], hf


def copy_checkpoint(src: str, dst, **config) -> dict:
    """The checkpoint's files copied to dst with these config.json fields changed; returns the new config."""
    for f in os.listdir(src):
        (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
    cfg = dict(json.loads((dst / "config.json").read_text()), **config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return cfg


def generate(path, prompts, sampling=GREEDY, **engine_args):
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back in the pool
    return [o.outputs[0].token_ids for o in outs], stats, llm


def test_the_sparsity_decides_the_tokens(v32):
    """The reference depends on the indexer's choice: HF with every position kept answers differently."""
    from transformers import AutoModelForCausalLM

    path, prompts, reference, hf = v32
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, index_topk=4096).eval()
    assert [hf_greedy(dense, p, GREEDY.max_tokens) for p in prompts] != reference


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(v32, variant):
    path, prompts, reference, _ = v32
    tokens, stats, llm = generate(path, prompts, **VARIANTS[variant])
    assert tokens == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
        specs = llm.llm_engine.executor.worker.model.kv_cache_specs()
        assert [s.kind for s in specs[:2]] == ["mla", "indexer"] and len(specs) == 2 * TINY_DS["num_hidden_layers"]
        assert specs[1] == kv_spec.indexer_spec(V32["index_head_dim"])
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


def test_tensor_parallel_2_matches_hf(v32):
    """MLA heads split over two ranks; the indexer and both caches replicated."""
    path, prompts, reference, _ = v32
    tokens, _, _ = generate(path, prompts, num_kv_blocks=64, tensor_parallel_size=2)
    assert tokens == reference


def test_expert_parallel_2_matches_hf(v32):
    path, prompts, reference, _ = v32
    tokens, _, _ = generate(path, prompts, num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True)
    assert tokens == reference


def test_mtp_proposals_with_sparse_attention(v32, tmp_path):
    """V3.2's MTP layer (its attention has an indexer too) proposes through the `mtp` method; greedy tokens
    stay HF's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.spec_decode.test_mtp import ReferenceMTP, mtp_spec

    path, prompts, reference, hf = v32
    copy_checkpoint(path, tmp_path, num_nextn_predict_layers=1)
    ref = ReferenceMTP(hf, seed=7)
    torch.manual_seed(7)
    ref.block = AutoModelForCausalLM.from_config(v32_config(num_hidden_layers=1, first_k_dense_replace=0),
                                                 dtype=torch.float32).eval()
    save_file(ref.tensors(hf.config.num_hidden_layers), str(tmp_path / "mtp.safetensors"))
    tokens, stats, llm = generate(str(tmp_path), prompts, num_kv_blocks=64, speculative_config=mtp_spec(2))
    assert tokens == reference
    assert stats.spec_decode.num_draft_tokens > 0
    mtp = llm.llm_engine.executor.worker.draft_model
    assert mtp.self_attn.indexer is not None and [s.kind for s in mtp.kv_cache_specs()] == ["mla", "indexer"]


def test_a_sequence_within_index_topk_is_dense_mla(v32, tmp_path):
    """index_topk above every context: the indexer keeps everything and V3.2 is V3 on the same weights --
    the same tokens and the same logprobs, bit for bit (the dense paths run)."""
    path, prompts, _, _ = v32
    cfg = copy_checkpoint(path, tmp_path, index_topk=4096)
    v3 = tmp_path / "v3"
    v3.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items() if ".indexer." not in k}
    save_file(tensors, str(v3 / "model.safetensors"))
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        cfg.pop(key)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (v3 / "config.json").write_text(json.dumps(cfg))
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = {}
    for name, where in (("v32", str(tmp_path)), ("v3", str(v3))):
        llm = LLM(where, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64)
        outs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    for a, b in zip(outs["v32"], outs["v3"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs]


@pytest.mark.parametrize("value", [0, -3])
def test_bad_index_topk_fails_naming_the_field(tmp_path, value):
    v32_config().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["index_topk"] = value
    cfg["architectures"] = ["DeepseekV32ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="index_topk"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)


def test_kv_bytes_per_token_hold_the_index_keys_and_the_planner_agrees(v32):
    """(kv_lora_rank + qk_rope_head_dim + index_head_dim) x 4 bytes x layers; the pool's capacity is the
    planner's; the planner's decode reads every index key and only index_topk latent rows."""
    from roofline.planner.model_specs import ModelSpec
    from tests.attention.test_kv_spec import planned_tokens

    path, _, _, hf = v32
    cfg = hf.config
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * 4 * cfg.num_hidden_layers
    budget, bs = 2 * 2**20 + 777, 16
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=budget, block_size=bs, show_progress=False)
    assert llm.llm_engine.executor.block_bytes() == per_token * bs
    tokens = llm.llm_engine.get_stats().num_total_blocks * bs
    assert tokens == planned_tokens(json.loads(open(os.path.join(path, "config.json")).read()), budget, bs)
    spec = ModelSpec.from_hf_config(json.loads(open(os.path.join(path, "config.json")).read()))
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layers = cfg.num_hidden_layers
    assert spec.kv_bytes_read_per_token(6, 4) == 6 * latent * 4 * layers  # within index_topk: dense
    assert spec.kv_bytes_read_per_token(100, 4) == (100 * cfg.index_head_dim + cfg.index_topk * latent) * 4 * layers


def test_dual_batch_overlap_matches_hf(v32):
    """--enable-dbo on two expert-parallel DP ranks, thresholds at 2 tokens: the steps' exchanges run as two
    overlapped micro-batches (7 all_to_alls a MoE layer instead of 4); an idle DP rank joins them too."""
    path, prompts, reference, hf = v32
    dbo = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
    tokens, stats, llm = generate(path, prompts, num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True,
                                  **dbo)
    assert tokens == reference
    moe_layers = hf.config.num_hidden_layers - hf.config.first_k_dense_replace
    assert stats.collectives["ep.all_to_all"][0] > 4 * moe_layers * stats.parallel_steps  # dual steps happened
    out = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY, use_tqdm=False)[0]  # the other rank idles
    assert out.outputs[0].token_ids == reference[2]
    after = llm.llm_engine.get_stats()
    assert after.num_free_blocks == after.num_total_blocks


@pytest.mark.parametrize("args,match", [
    (dict(enable_dbo=True), "enable_dbo needs enable_expert_parallel"),
    (dict(enable_dbo=True, enable_expert_parallel=True, all2all_backend="allgather_reducescatter"),
     "enable_dbo needs all2all_backend 'all_to_all'"),
    (dict(enable_dbo=True, enable_expert_parallel=True, dbo_decode_token_threshold=1), "dbo_decode_token_threshold"),
])
def test_bad_dbo_settings_name_the_field(args, match):
    from roofline.config import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(model=None, **args).create_engine_config()
