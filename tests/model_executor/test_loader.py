"""Model resolution and loading: unknown architectures, missing paths, dummy weights."""

from __future__ import annotations

import json

import pytest

from roofline import LLM, SamplingParams
from roofline.model_executor.loader.source import default_model_file, resolve_source
from tests.reference.hf_models import parity_devices, tiny_config


def test_default_model_is_the_packaged_gguf():
    src = resolve_source(None)
    assert src.fmt == "gguf" and src.gguf_file.endswith(".gguf")
    assert default_model_file().endswith(".gguf")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a local path"):
        resolve_source(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no loadable weights"):
        resolve_source(str(tmp_path))


def test_unknown_architecture_lists_supported(tmp_path):
    cfg = tiny_config("llama").to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dummy_weights_for_any_config(tmp_path, arch):
    cfg = tiny_config(arch).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16, show_progress=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_rope_scaling_llama3_matches_hf():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from roofline.model_executor.layers.rotary import _inv_freq, rope_parameters

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      rope_theta=500000.0)
    ours, _ = _inv_freq(rope_parameters(cfg), 64, 131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)


def test_gguf_config_and_tokenizer_are_cached_in_hf_format(tmp_path, monkeypatch):
    """The GGUF metadata is parsed once per file: later loads read the saved HF files and get the
    same config and tokenizer; with no writable cache the GGUF is parsed each time."""
    from transformers import AutoConfig, AutoTokenizer

    from roofline.model_executor.loader import source as source_mod

    src = resolve_source(None)
    # each of the two GGUF parses (config, tokenizer) runs once: the cache is filled from the same objects
    parsed = {}
    for name in ("_gguf_config", "_gguf_tokenizer"):
        def once(s, name=name, parse=getattr(source_mod, name)):
            if name not in parsed:
                parsed[name] = parse(s)
            return parsed[name]
        monkeypatch.setattr(source_mod, name, once)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # cache_dir() cannot be created: parse the GGUF
    assert source_mod.gguf_metadata_dir(src) is None
    direct_config = source_mod.load_hf_config(src)
    direct_tok = source_mod.load_tokenizer(src)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = source_mod.gguf_metadata_dir(src)
    assert first is not None and first.startswith(str(tmp_path / "cache"))
    assert source_mod.gguf_metadata_dir(src) == first

    def refusing_gguf(load):
        def wrapped(*args, **kwargs):
            assert not kwargs.get("gguf_file"), "the GGUF file was parsed again"
            return load(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(AutoConfig, "from_pretrained", refusing_gguf(AutoConfig.from_pretrained))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refusing_gguf(AutoTokenizer.from_pretrained))
    config = source_mod.load_hf_config(src)
    tok = source_mod.load_tokenizer(src)
    assert config.to_dict() == direct_config.to_dict()
    messages = [{"role": "user", "content": "héllo wörld 你好 🤖"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        direct_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "héllo wörld 你好 🤖 <|im_start|>user"
    assert tok.encode(text) == direct_tok.encode(text) and len(tok) == len(direct_tok)
    assert (tok.eos_token_id, tok.bos_token_id) == (direct_tok.eos_token_id, direct_tok.bos_token_id)


@pytest.mark.parametrize("device", parity_devices())
def test_dummy_weights_are_drawn_on_the_device_and_seeded(device):
    """Same seed, same weights (drawn where the parameters live); another seed, others; within
    +-0.05 (bf16 rounding); norms at 1."""
    import torch

    from roofline.model_executor.loader.weights import init_dummy_weights

    def params(seed):
        model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 48), "input_layernorm": torch.nn.LayerNorm(64)})
        model.to(device=device, dtype=torch.bfloat16)
        init_dummy_weights(model, seed)
        return {n: p.detach().float().cpu() for n, p in model.named_parameters()}

    a, b, c = params(3), params(3), params(4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["proj.weight"], c["proj.weight"])
    assert a["proj.weight"].abs().max() <= 0.0505 and a["proj.weight"].std() > 0.02
    assert torch.equal(a["input_layernorm.weight"], torch.ones(64))
