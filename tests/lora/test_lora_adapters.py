"""Adapters we cannot apply exactly are errors naming the adapter -- never the base model's output -- and the
engine keeps serving: bad files, keys, targets, ranks and config fields; an adapter that fails on the worker
fails its request alone."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from roofline import LLM, LoRARequest, SamplingParams
from roofline.lora.peft import read_adapter
from tests.lora.conftest import MAX_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def family(lora_family):
    return lora_family("llama")


@pytest.fixture(scope="module")
def llm(family):
    engine = LLM(family.path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=128, enable_lora=True,
                 max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    yield engine
    engine.llm_engine.shutdown()


def copy_adapter(src: str, dst: str, config=None, tensors=None) -> str:
    """A copy of adapter src at dst, its config updated with `config` and its tensors replaced by `tensors`."""
    shutil.copytree(src, dst)
    if config is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(path, "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        save_file(tensors(read_tensors(dst)), os.path.join(dst, "adapter_model.safetensors"))
    return dst


def read_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def renamed(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def run(llm, family, lora, prompt=0):
    return llm.generate([{"prompt_token_ids": family.prompts[prompt]}], GREEDY, use_tqdm=False, lora_request=lora)


BAD = {
    "wrong_prefix": (dict(tensors=renamed("base_model.model.", "")), "does not start with PEFT's"),
    "unknown_module": (dict(tensors=renamed("layers.1.", "layers.7.")), "does not map onto a linear layer"),
    "unknown_target_name": (dict(config={"target_modules": ["q_proj", "lm_head"]}), r"\['lm_head'\] are not supported"),
    "embedding_lora": (dict(tensors=lambda t: dict(t, **{"base_model.model.model.embed_tokens.lora_embedding_A":
                                                         torch.zeros(8, 384)})), "not a lora_A / lora_B weight"),
    "rank_above_max": (dict(config={"r": 16}, tensors=lambda t: {
        k: torch.cat([v, v], dim=0 if "lora_A" in k else 1) for k, v in t.items()}), "above max_lora_rank"),
    "rank_disagrees": (dict(config={"r": 4}), "config's r is 4"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "bias": (dict(config={"bias": "lora_only"}), "bias 'lora_only' is not supported"),
    "dora": (dict(config={"use_dora": True}), "use_dora"),
    "shape": (dict(tensors=lambda t: {k: (v[:, :32].contiguous() if k.endswith("q_proj.lora_A.weight") else v)
                                      for k, v in t.items()}), "32 input features, the layer has 64"),
    "half_missing": (dict(tensors=lambda t: {k: v for k, v in t.items()
                                             if not k.endswith("o_proj.lora_B.weight")}), "has no lora_B"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_an_error_naming_it(llm, family, tmp_path, case):
    changes, message = BAD[case]
    path = copy_adapter(family.loras[1].lora_path, str(tmp_path / case), **changes)
    lora = LoRARequest(f"bad-{case}", 100 + list(BAD).index(case), path)
    with pytest.raises(ValueError, match=message) as info:
        run(llm, family, lora)
    assert f"bad-{case}" in str(info.value)


@pytest.mark.parametrize("case,message", [
    ("no_dir", "is not a directory"), ("no_config", "adapter_config.json is missing"),
    ("no_weights", "adapter_model.safetensors is missing"), ("pickle_weights", "adapter_model.bin is a pickle"),
])
def test_missing_files(llm, family, tmp_path, case, message):
    path = tmp_path / case
    if case != "no_dir":
        shutil.copytree(family.loras[1].lora_path, path)
        if case == "no_config":
            os.remove(path / "adapter_config.json")
        else:
            os.rename(path / "adapter_model.safetensors", path / ("adapter_model.bin" if case == "pickle_weights"
                                                                 else "other.safetensors"))
    with pytest.raises(ValueError, match=message):
        run(llm, family, LoRARequest(case, 200 + len(case), str(path)))


def test_engine_keeps_serving_after_errors(llm, family, tmp_path):
    bad = copy_adapter(family.loras[1].lora_path, str(tmp_path / "bad"), config={"bias": "all"})
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": p} for p in family.prompts[:2]], GREEDY, use_tqdm=False,
                     lora_request=[family.loras[1], LoRARequest("bad", 300, bad)])
    outs = run(llm, family, family.loras[1], prompt=1)
    assert outs[0].outputs[0].token_ids == family.expected[1]
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_one_id_names_one_adapter(llm, family):
    run(llm, family, family.loras[1], prompt=1)
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a1'"):
        run(llm, family, LoRARequest("other", 1, family.loras[2].lora_path))


def test_lora_not_enabled(family):
    engine = LLM(family.path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            run(engine, family, family.loras[1])
    finally:
        engine.llm_engine.shutdown()


def test_unsupported_model_is_a_startup_error(tmp_path):
    from roofline.config import EngineArgs
    from roofline.lora.mapping import AdapterValidator
    from tests.reference.hf_models import tiny_config

    with pytest.raises(ValueError, match="MixtralForCausalLM does not support LoRA"):
        AdapterValidator(tiny_config("mixtral"), 8)
    with pytest.raises(ValueError, match="max_cpu_loras \\(1\\) must be at least max_loras \\(2\\)"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1).create_engine_config()


def test_adapter_failing_on_the_worker_fails_its_request_alone(llm, family, tmp_path):
    """Checked by the engine, then gone when the worker (one adapter kept loaded) needs it again: the request
    fails with an error naming the adapter and produces no tokens; the next request runs."""
    path = str(tmp_path / "vanishing")
    shutil.copytree(family.loras[2].lora_path, path)
    vanishing = LoRARequest("vanishing", 400, path)
    assert run(llm, family, vanishing, prompt=2)[0].outputs[0].token_ids == family.expected[2]
    run(llm, family, family.loras[1], prompt=1)  # takes the one slot and the one loaded place
    shutil.rmtree(path)
    out = run(llm, family, vanishing, prompt=2)[0]
    assert out.error is not None and "vanishing" in out.error
    assert out.outputs[0].token_ids == []
    assert run(llm, family, family.loras[1], prompt=1)[0].outputs[0].token_ids == family.expected[1]


def test_read_adapter_scaling(family):
    a1 = read_adapter("a1", family.loras[1].lora_path)
    a2 = read_adapter("a2", family.loras[2].lora_path)
    assert (a1.rank, a1.scaling) == (8, 2.0)  # alpha / r
    assert (a2.rank, a2.scaling) == (4, 4.0)  # rsLoRA: alpha / sqrt(r)
    assert "model.layers.0.self_attn.q_proj" in a1.modules


def test_forks_run_under_their_adapter(llm, family):
    """n > 1 completions and beam search fork their request: every fork keeps its adapter."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    out = llm.generate([{"prompt_token_ids": family.prompts[1]}], params, use_tqdm=False,
                       lora_request=family.loras[1])[0]
    assert [c.token_ids for c in out.outputs] == [family.expected[1]] * 2
    from roofline import BeamSearchParams

    beams = llm.beam_search([{"prompt_token_ids": family.prompts[2]}], BeamSearchParams(beam_width=2, max_tokens=4),
                            lora_request=family.loras[2])
    base = llm.beam_search([{"prompt_token_ids": family.prompts[2]}], BeamSearchParams(beam_width=2, max_tokens=4))
    assert beams[0].sequences[0].tokens != base[0].sequences[0].tokens
