"""Loading MoE checkpoints (roofline/model_executor/layers/moe/checkpoint.py and the MoE models):
transformers 5's save_pretrained writes per-expert tensors (Mixtral `block_sparse_moe.experts.<e>.w1`,
Qwen `mlp.experts.<e>.gate_proj`); the same weights stacked as 3-D `experts.gate_up_proj` /
`experts.down_proj` load to the same model; dummy weights serve any MoE config; a checkpoint missing an
expert tensor, or a tensor-parallel size that does not divide the experts' width, fails at load
naming what is wrong."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from roofline import LLM, SamplingParams
from tests.reference.hf_models import TINY_MOE, build_tiny_model, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 2, 71]}, {"prompt_token_ids": [100, 3]}]


def _greedy(path: str) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=32, show_progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _rewrite(src: str, dst: str, edit) -> None:
    """Copy checkpoint src to dst with its tensors passed through edit(dict) -> dict."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg)
    (st,) = [n for n in os.listdir(src) if n.endswith(".safetensors")]
    save_file(edit(load_file(os.path.join(src, st))), os.path.join(dst, "model.safetensors"))


def _stack_experts(tensors: dict) -> dict:
    """Per-expert tensors -> transformers 5's in-memory 3-D layout (`<layer>.mlp.experts.gate_up_proj`)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            prefix = ".".join(parts[:i]).replace("block_sparse_moe", "mlp")
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(parts[i + 2], parts[i + 2])
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(parts[i + 1])] = t
        else:
            out[name] = t
    assert experts, "the checkpoint had per-expert tensors"
    for prefix, projs in experts.items():
        stack = {p: torch.stack([projs[p][e] for e in sorted(projs[p])]) for p in projs}
        out[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1).contiguous()
        out[f"{prefix}.experts.down_proj"] = stack["down_proj"].contiguous()
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_per_expert_and_stacked_checkpoints_load_the_same(tmp_path, arch):
    src = str(tmp_path / "per_expert")
    build_tiny_model(arch, src, seed=4)
    names = load_file(os.path.join(src, "model.safetensors")).keys()
    marker = {"mixtral": "block_sparse_moe.experts.0.w1.weight", "qwen2_moe": "mlp.experts.0.gate_proj.weight"}[arch]
    assert any(n.endswith(marker) for n in names), "what transformers' save_pretrained writes"
    stacked = str(tmp_path / "stacked")
    _rewrite(src, stacked, _stack_experts)
    assert _greedy(stacked) == _greedy(src)


@pytest.mark.parametrize("arch", list(TINY_MOE))
def test_dummy_weights_for_any_moe_config(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(arch).to_dict()))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16, show_progress=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_missing_expert_tensor_is_named(tmp_path):
    src = str(tmp_path / "full")
    build_tiny_model("qwen3_moe", src, seed=4)
    broken = str(tmp_path / "broken")
    _rewrite(src, broken, lambda t: {n: v for n, v in t.items() if n != "model.layers.1.mlp.experts.3.up_proj.weight"})
    with pytest.raises(ValueError, match=r"missing expert tensors \(1\): model\.layers\.1\.mlp\.experts\.3\.up_proj"):
        _greedy(broken)


def test_tp_that_does_not_divide_the_expert_width_fails_naming_the_field(tmp_path):
    cfg = tiny_config("qwen2_moe", moe_intermediate_size=30)  # heads 4, KV heads 2, dense width 96: all split by 4
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\) is not divisible by tensor_parallel_size \(4\)"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=4, num_kv_blocks=16,
            show_progress=False)


def test_unservable_routing_fails_at_load_naming_the_field(tmp_path):
    cfg = tiny_config("mixtral").to_dict()
    cfg["num_experts_per_tok"] = 9  # of 8 experts
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\)"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16, show_progress=False)


def _to_gguf_names(tensors: dict) -> dict:
    """HF checkpoint tensors -> llama.cpp's qwen2moe/qwen3moe names, experts stacked [E, out, in]."""
    from roofline.model_executor.loader.weights import _GGUF_LAYER, _GGUF_NAMES

    to_gguf = {hf: g for g, hf in _GGUF_NAMES.items()}
    layer_part = {hf: g for g, hf in _GGUF_LAYER.items()}
    out = {}
    for name, t in _stack_experts(tensors).items():
        if name in to_gguf:
            out[to_gguf[name]] = t
            continue
        parts = name.split(".")  # model.layers.<i>.<module path>.<weight|bias>
        layer, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
        if module == "mlp.experts" and leaf == "gate_up_proj":  # split back into llama.cpp's two stacks
            gate, up = t.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate.contiguous()
            out[f"blk.{layer}.ffn_up_exps.weight"] = up.contiguous()
        elif module == "mlp.experts":
            out[f"blk.{layer}.ffn_down_exps.weight"] = t
        elif module == "mlp.shared_expert_gate":
            out[f"blk.{layer}.ffn_gate_inp_shexp.{leaf}"] = t[0]  # llama.cpp keeps this [1, H] gate 1-D
        else:
            out[f"blk.{layer}.{layer_part[module]}.{leaf}"] = t
    return out


@pytest.mark.parametrize("arch,gguf_arch", [("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_gguf_expert_stacks_load_as_safetensors(tmp_path, arch, gguf_arch):
    """A GGUF file's MoE tensors (router, ffn_{gate,up,down}_exps stacks, shared expert and its gate)
    fill every parameter with the values the safetensors checkpoint gives."""
    import gguf

    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.model_executor.loader.weights import gguf_weights, safetensors_weights
    from roofline.model_executor.models.registry import resolve_architecture

    src = str(tmp_path / "st")
    hf = build_tiny_model(arch, src, seed=5)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), gguf_arch)
    for name, t in _to_gguf_names(load_file(os.path.join(src, "model.safetensors"))).items():
        writer.add_tensor(name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, cls = resolve_architecture(hf.config)
    models = []
    for weights in (safetensors_weights(src, False), gguf_weights(str(tmp_path / "m.gguf"), hf.config, False)):
        model = cls(hf.config, TorchAttentionBackend())
        loaded = model.load_weights(weights)
        assert loaded == {n for n, _ in model.named_parameters()}
        models.append(dict(model.named_parameters()))
    for name, p in models[0].items():
        assert torch.equal(p, models[1][name]), name
