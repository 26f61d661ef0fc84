"""GGUF files of gemma2, gemma3, phi3, olmo2, granite, glm4moe, smollm3 and gpt-oss (loader/gguf_archs.py): each
tiny HF checkpoint is written as llama.cpp's convert_hf_to_gguf.py writes it -- its metadata keys, tensor names
(gguf's own TensorNameMap), Gemma's norms stored as 1 + w, Granite's and SmolLM3's q/k rows permuted to
interleaved rope pairs (the converter's LlamaModel.permute), Phi-3's fused attn_qkv / ffn_up and its LongRoPE
factors as rope_factors_long / rope_factors_short tensors, GLM-4.5's experts stacked, its correction bias as
exp_probs_b.bias and its MTP block counted in block_count, gpt-oss's interleaved gate_up_proj split into gate
(even) and up (odd) stacks, down_proj transposed, sinks as attn_sinks.weight, YaRN keys, and its MXFP4 release
blocks repacked to ggml's MXFP4 (GptOssModel.repack_mxfp4) -- with a byte-level BPE vocabulary.

The loader gives every parameter the checkpoint's value, and the engine on the file greedy-decodes HF's tokens
(fp32, CPU); Granite's Q8_0 file keeps its blocks and matches HF on the dequantized weights; gpt-oss's MXFP4
file loads HF's own dequantization of the same blocks, bit for bit.  Metadata or tensors the mapping cannot
honour fail at start-up, named."""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.model_executor.loader.source import load_hf_config, load_tokenizer, resolve_source
from roofline.model_executor.loader.weights import gguf_weights
from roofline.model_executor.models.registry import resolve_architecture
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.family_parity import GREEDY, generate, tokens
from tests.reference.hf_models import build_tiny_model, hf_greedy

GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite",
             "glm4_moe": "glm4moe", "smollm3": "smollm3", "gpt_oss": "gpt-oss"}
# what a GGUF file can carry: Gemma 2's converter drops lm_head (tied), llama.cpp derives Gemma's attention
# scale from head_dim and fixes Gemma 3's layer pattern at five sliding layers then a global one
OVERRIDES = {"gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=16),
             "gemma3": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16),
             "gpt_oss": dict(swiglu_limit=7.0)}  # llama.cpp's fixed clamp (and alpha 1.702, HF's default)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The GGUF metadata cache (source.gguf_metadata_dir) in this test's directory: the config and tokenizer
    are read back from the files it saves."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ---- a GGUF file as convert_hf_to_gguf.py writes it ----------------------------------------------------

def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (rows of one head's rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_params(cfg) -> dict:
    params = dict(cfg.rope_parameters or {})
    return dict(params.get("full_attention", params))


def _metadata(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """The keys the converter's set_gguf_parameters writes for this architecture."""
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    rope = _rope_params(cfg)
    if arch in ("gemma2", "phi3"):  # their own lists, not the generic one
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(hidden)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        return
    if arch == "phi3":
        rotary = int(cfg.partial_rotary_factor * hidden) // heads
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_rope_dimension_count(rotary)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(cfg.original_max_position_embeddings)))
        return
    # TextModel.set_gguf_parameters (olmo2, granite, smollm3, glm4moe; gemma3 then adds its own)
    w.add_block_count(cfg.num_hidden_layers + (getattr(cfg, "num_nextn_predict_layers", 0) if arch == "glm4moe" else 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                getattr(w, f"add_rope_scaling_yarn_{key}")(rope[key])
    w.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in (cfg.rope_parameters or {}):
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in ("glm4moe", "gpt-oss"):
        w.add_expert_count(cfg.n_routed_experts if arch == "glm4moe" else cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "glm4moe":
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if getattr(cfg, "head_dim", None) is not None and arch not in ("granite", "gemma3"):  # gemma3: below
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("granite", "smollm3"):  # LlamaModel
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    if arch == "glm4moe":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_nextn_predict_layers(cfg.num_nextn_predict_layers)


def _vocabulary(w: gguf.GGUFWriter, cfg) -> None:
    """A byte-level BPE vocabulary of vocab_size tokens (256 bytes, a few merges, added tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    toks, merges = [byte[i] for i in range(256)], []
    for a, b in [("h", "e"), ("l", "l"), ("he", "ll"), ("o", "Ġ")]:
        merges.append(f"{a} {b}")
        toks.append(a + b)
    toks += [f"<|extra_{i}|>" for i in range(len(toks), cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * 260 + [3] * (len(toks) - 260))
    w.add_token_merges(merges)
    for kind in ("bos", "eos", "pad"):
        if getattr(cfg, f"{kind}_token_id", None) is not None:
            getattr(w, f"add_{kind}_token_id")(getattr(cfg, f"{kind}_token_id"))


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's MXFP4 blocks [..., N, K/32, 16] (values 2j / 2j + 1 in byte j's low / high nibble) and scales
    [..., N, K/32] as ggml's MXFP4 rows [..., N, K/32 * 17] (GptOssModel.repack_mxfp4: per block the exponent,
    then value j in byte j's low nibble and value j + 16 in its high one)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).contiguous()


def _gpt_oss_tensors(state: dict, names) -> dict:
    """GptOssModel.modify_tensors / generate_extra_tensors: sinks + '.weight'; gate_up_proj (dense [E, H, 2I]
    or the release's MXFP4 blocks [E, 2I, H/32, 16]) split into its even rows (gate) and odd ones (up), the
    biases likewise; down_proj transposed to [E, H, I] or repacked; MXFP4 stays MXFP4 (the repacked rows)."""
    out = {}
    for name, t in state.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$", name)
        if m is None:
            mapped = names.get_name(name + ".weight" if name.endswith(".sinks") else name,
                                    try_suffixes=(".weight", ".bias"))
            assert mapped is not None, name
            out[mapped] = t
            continue
        layer, proj, kind = m[1], m[2], m[3]
        if kind == "_scales":
            continue  # with its blocks
        if kind == "_blocks":
            base = name[: -len("_blocks")]
            t = ggml_mxfp4(t, state[base + "_scales"])
        elif kind is None:
            t = t.transpose(-1, -2)  # [E, out, in]
        leaf = "bias" if kind == "_bias" else "weight"
        if proj == "down_proj":
            parts = {"down": t}
        else:  # HF's even rows (bias entries) are the gate's, odd ones the up projection's
            parts = {"gate": t[..., 0::2], "up": t[..., 1::2]} if kind == "_bias" else {"gate": t[:, 0::2],
                                                                                         "up": t[:, 1::2]}
        for part, value in parts.items():
            value = value.contiguous()
            out[f"blk.{layer}.ffn_{part}_exps.{leaf}"] = (value, gguf.GGMLQuantizationType.MXFP4) \
                if kind == "_blocks" else value
    return out


def _tensors(hf, arch: str, blocks: dict, state: dict | None = None) -> dict:
    """HF parameters (or `state`, a checkpoint's tensors) -> the converter's GGUF tensors (modify_tensors +
    TensorNameMap); `blocks`: HF name -> gguf_quant.QuantizedTensor written in its blocks instead."""
    cfg = hf.config
    n_blocks = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if arch == "glm4moe" else 0)
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, n_blocks)
    state = {n: t.detach().clone() for n, t in (state or hf.state_dict()).items()}
    if arch == "gpt-oss":
        return _gpt_oss_tensors(state, names)
    out = {}
    for name, t in state.items():
        t = blocks[name].data if name in blocks else t
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # "lm_head is not used in llama.cpp"
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm scales by 1 + w
        if arch in ("granite", "smollm3") and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, cfg.num_attention_heads)
        if arch in ("granite", "smollm3") and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, cfg.num_key_value_heads)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: stacked gate and up, [E, I, H] each
            layer = name.split(".")[2]
            gate, up = t.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = t
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        out[mapped] = (t, blocks[name].qtype) if name in blocks else t
    if arch == "phi3":
        out["rope_factors_long.weight"] = torch.tensor(cfg.rope_parameters["long_factor"])
        out["rope_factors_short.weight"] = torch.tensor(cfg.rope_parameters["short_factor"])
    if arch == "glm4moe":  # the MTP block, after the decoder's layers
        mtp = cfg.num_hidden_layers
        out[f"blk.{mtp}.nextn.eh_proj.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size)
        out[f"blk.{mtp}.nextn.enorm.weight"] = torch.ones(cfg.hidden_size)
        out[f"blk.{mtp}.attn_norm.weight"] = torch.ones(cfg.hidden_size)
    return out


def write_gguf(hf, arch: str, path: str, blocks: dict | None = None, edit=None, state: dict | None = None) -> str:
    """The tiny HF model (or `state`: its checkpoint's tensors, e.g. MXFP4 blocks) as a llama.cpp GGUF file;
    edit(metadata writer) may add keys, and drop tensors by returning their names."""
    w = gguf.GGUFWriter(path, GGUF_ARCH[arch])
    w.add_name(f"tiny-{arch}")
    _metadata(w, GGUF_ARCH[arch], hf.config)
    mxfp4 = state is not None and any(n.endswith("_blocks") for n in state)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if blocks else gguf.LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4
                    else gguf.LlamaFileType.ALL_F32)
    _vocabulary(w, hf.config)
    drop = set(edit(w) or ()) if edit is not None else set()
    for name, t in _tensors(hf, GGUF_ARCH[arch], blocks or {}, state).items():
        if name in drop:
            continue
        if isinstance(t, tuple):  # blocks: uint8 rows
            w.add_tensor(name, t[0].numpy(), raw_dtype=gguf.GGMLQuantizationType(t[1]))
        else:
            w.add_tensor(name, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the tests -----------------------------------------------------------------------------------------

def _tiny(tmp_path, arch: str, seed: int = 7):
    hf_dir = str(tmp_path / "hf")
    return hf_dir, build_tiny_model(arch, hf_dir, seed=seed, **OVERRIDES.get(arch, {}))


def _assert_loads_as(cls, hf_config, reference, path: str, config) -> None:
    """The model loaded from `reference` ((name, tensor) of the HF checkpoint) and from the GGUF file: every
    parameter filled, and each equal (norms within 1e-6: Gemma's (1 + w) - 1 in fp32)."""
    models = []
    for cfg, weights in ((hf_config, iter(reference)), (config, gguf_weights(path, config, show_progress=False))):
        model = cls(cfg, TorchAttentionBackend())
        assert model.load_weights(weights) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
        models.append(dict(model.named_parameters()))
    for pname, p in models[0].items():
        torch.testing.assert_close(models[1][pname], p, rtol=0, atol=1e-6 if "norm" in pname else 0, msg=pname)


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_file_loads_as_the_checkpoint_and_decodes_as_hf(tmp_path, arch):
    hf_dir, hf = _tiny(tmp_path, arch)
    path = write_gguf(hf, arch, str(tmp_path / f"{arch}.gguf"))
    src = resolve_source(path)
    config = load_hf_config(src)
    name, cls = resolve_architecture(config)
    assert name == hf.config.architectures[0]
    assert load_tokenizer(src).decode([258, 111]) == "hello"  # the file's vocabulary (merges "he"+"ll")

    # the loader: every parameter as the safetensors checkpoint gives it (Gemma's norms: (1 + w) - 1)
    _assert_loads_as(cls, hf.config, load_file(os.path.join(hf_dir, "model.safetensors")).items(), path, config)

    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)  # all past Phi-3's 16-token window
    outs, _ = generate(path, prompts)
    assert tokens(outs) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_config_reads_what_llamacpp_stores(tmp_path):
    """The fields the files carry beyond sizes: Gemma 3's layer pattern and per-layer-type rope, Phi-3's
    LongRoPE factors and attention factor, GLM-4.5's MTP layer outside num_hidden_layers."""
    cfgs = {}
    for arch in ("gemma3", "phi3", "glm4_moe"):
        _, hf = _tiny(tmp_path / arch, arch)
        cfgs[arch] = (hf.config, load_hf_config(resolve_source(write_gguf(hf, arch, str(tmp_path / f"{arch}.gguf")))))
    ref, got = cfgs["gemma3"]
    assert got.layer_types == ref.layer_types and got.sliding_window == ref.sliding_window
    assert got.rope_parameters == ref.rope_parameters
    ref, got = cfgs["phi3"]
    for key in ("long_factor", "short_factor"):
        assert got.rope_parameters[key] == pytest.approx(ref.rope_parameters[key])
    assert got.rope_parameters["attention_factor"] == pytest.approx((1 + np.log(32) / np.log(16)) ** 0.5)
    assert got.partial_rotary_factor == 0.75 and got.original_max_position_embeddings == 16
    ref, got = cfgs["glm4_moe"]
    assert (got.num_hidden_layers, got.num_nextn_predict_layers) == (3, 1)
    assert (got.n_group, got.topk_group, got.routed_scaling_factor) == (4, 2, 2.5)


def test_q8_0_file_keeps_its_blocks_and_matches_hf_on_them(tmp_path):
    """Granite's layer weights as Q8_0 blocks (q/k rows permuted as blocks): kept in blocks on the CPU,
    the same function as HF over the dequantized values."""
    from roofline.cpu import ops as cpu_ops
    from tests.reference.quantized import quantized_layer_weights

    _, hf = _tiny(tmp_path, "granite")
    blocks = quantized_layer_weights(hf, 8)  # hf now holds the blocks' values
    path = write_gguf(hf, "granite", str(tmp_path / "granite-q8_0.gguf"), blocks=blocks)
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)

    def kept(llm):
        layer = llm.llm_engine.executor.worker.model.model.layers[0]
        assert (layer.self_attn.qkv_proj.quant is not None) == cpu_ops.available()

    outs, _ = generate(path, prompts, inspect=kept)
    assert tokens(outs) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_gpt_oss_mxfp4_file_holds_the_release_blocks_and_decodes_as_hf(tmp_path):
    """The release's MXFP4 experts, converted as llama.cpp does (gate / up rows split, nibbles repacked to
    ggml's MXFP4): the file's expert tensors are MXFP4, gguf's own dequantizer reads HF's values from them
    (the repacking is ggml's), the loader gives every parameter HF transformers' dequantization of the same
    blocks bit for bit, and the engine greedy-decodes HF's tokens."""
    from transformers import AutoModelForCausalLM

    from tests.reference.mxfp4_checkpoint import write_mxfp4_checkpoint

    hf_dir, _ = _tiny(tmp_path, "gpt_oss")
    mx_dir = str(tmp_path / "mxfp4")
    write_mxfp4_checkpoint(hf_dir, mx_dir)
    hf = AutoModelForCausalLM.from_pretrained(mx_dir, dtype=torch.float32).eval()  # HF dequantizes the blocks
    path = write_gguf(hf, "gpt_oss", str(tmp_path / "gpt-oss-mxfp4.gguf"),
                      state=load_file(os.path.join(mx_dir, "model.safetensors")))

    reader = gguf.GGUFReader(path)
    experts = {t.name: t for t in reader.tensors if re.search(r"ffn_(gate|up|down)_exps\.weight$", t.name)}
    assert len(experts) == 3 * hf.config.num_hidden_layers
    assert {t.tensor_type for t in experts.values()} == {gguf.GGMLQuantizationType.MXFP4}
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj  # [E, H, 2I]: even columns gate, odd up
    t = experts["blk.1.ffn_up_exps.weight"]
    ggml_values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
    assert torch.equal(torch.from_numpy(np.array(ggml_values)), gate_up[:, :, 1::2].mT)

    config = load_hf_config(resolve_source(path))
    assert config.rope_parameters == hf.config.rope_parameters and config.layer_types == hf.config.layer_types
    _, cls = resolve_architecture(config)
    state = hf.state_dict()
    _assert_loads_as(cls, hf.config, state.items(), path, config)
    model = cls(config, TorchAttentionBackend())
    model.load_weights(gguf_weights(path, config, show_progress=False))
    for i, layer in enumerate(model.model.layers):  # bit for bit, signed zeros too
        w13 = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        want = torch.cat([w13[:, :, 0::2], w13[:, :, 1::2]], 2).mT
        assert torch.equal(layer.mlp.experts.w13_weight.view(torch.int32), want.contiguous().view(torch.int32))

    prompts = shared_prefix_prompts(hf.config.vocab_size, n=2, seed=4)  # past the 6-key window
    outs, _ = generate(path, prompts)
    assert tokens(outs) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_gpt_oss_mxfp4_nan_exponent_names_the_tensor(tmp_path):
    """An e8m0 NaN exponent (255) in a GGUF file's MXFP4 experts: a load error naming the tensor."""
    from tests.reference.mxfp4_checkpoint import write_mxfp4_checkpoint

    hf_dir, hf = _tiny(tmp_path, "gpt_oss")
    write_mxfp4_checkpoint(hf_dir, str(tmp_path / "mxfp4"))
    state = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    state["model.layers.1.mlp.experts.gate_up_proj_scales"][3, 5, 0] = 255  # row 5: an up row (odd)
    path = write_gguf(hf, "gpt_oss", str(tmp_path / "nan.gguf"), state=state)
    config = load_hf_config(resolve_source(path))
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.1\.ffn_up_exps\.weight'.*NaN exponent"):
        list(gguf_weights(path, config, show_progress=False))


def _refused(tmp_path, arch, edit, match):
    _, hf = _tiny(tmp_path, arch)
    path = write_gguf(hf, arch, str(tmp_path / f"{arch}.gguf"), edit=edit)
    with pytest.raises(ValueError, match=match):
        load_hf_config(resolve_source(path))


@pytest.mark.parametrize("arch,edit,match", [
    # LongRoPE without one of its factor sets: refused, not served with the other
    ("phi3", lambda w: ["rope_factors_short.weight"], r"rope_factors_short\.weight is missing"),
    # OLMo 3 (sliding windows) under the olmo2 architecture
    ("olmo2", lambda w: w.add_sliding_window(4096), r"'olmo2\.attention\.sliding_window' = 4096"),
    # a scaling the mapping does not reproduce
    ("granite", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), r"'granite\.rope\.scaling\.type'"),
    # a key no llama.cpp reader of the architecture has
    ("gemma3", lambda w: w.add_uint32("gemma3.attention.sliding_window_pattern", 4),
     r"'gemma3\.attention\.sliding_window_pattern'"),
    # a tensor with no HF counterpart (llama3-style rope factors)
    ("smollm3", lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)) and None,
     r"GGUF tensor 'rope_freqs\.weight'"),
    # a YaRN attention factor: llama.cpp multiplies it into 1 + 0.1 ln(factor), HF takes it as the whole factor
    ("gpt_oss", lambda w: w.add_rope_scaling_yarn_attn_factor(0.5), r"'gpt-oss\.rope\.scaling\.yarn_attn_factor'"),
    # a key llama.cpp's gpt-oss reader does not read (its layer pattern is fixed)
    ("gpt_oss", lambda w: w.add_uint32("gpt-oss.attention.sliding_window_pattern", 3),
     r"'gpt-oss\.attention\.sliding_window_pattern'"),
    # a file without a layer's sinks: refused, not served with zero sinks
    ("gpt_oss", lambda w: ["blk.1.attn_sinks.weight"], r"'blk\.1\.attn_sinks\.weight' is missing"),
])
def test_what_cannot_be_honoured_fails_at_start_up_naming_it(tmp_path, arch, edit, match):
    _refused(tmp_path, arch, edit, match)
