"""ConfigSnapshot: every attribute of a resolved transformers config, read back without transformers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

from roofline.hf_config import (
    _SKIPPED,
    ConfigSnapshot,
    load_config_dir,
    snapshot,
)

# model_type of every architecture the registry serves (Gemma 3 text and its multimodal wrapper)
MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "smollm3", "granite", "olmo2", "gemma2", "gemma3_text",
               "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next",
               "deepseek_v2", "deepseek_v3", "deepseek_v32"]


def _same(a, b) -> bool:
    if isinstance(a, ConfigSnapshot):
        return a.to_dict() == b.to_dict()
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _readable_attributes(config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(config):
            if name.startswith("__") or name in _SKIPPED:
                continue
            try:
                value = getattr(config, name)
            except Exception:
                continue
            if not callable(value):
                yield name, value


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_attribute_survives_the_round_trip(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, dtype=torch.float32, rope_parameters=None)
    config._name_or_path = "/models/x"
    snap = ConfigSnapshot.from_json(snapshot(config).to_json())
    checked, left_out = 0, set()
    for name, value in _readable_attributes(config):
        if not hasattr(snap, name):
            left_out.add(name)
            continue
        assert _same(getattr(snap, name), value), (name, getattr(snap, name), value)
        checked += 1
    assert checked > 40
    assert left_out <= {"sub_configs", "sub_configs_defaults"}  # a multimodal config's part classes: not data
    assert snap.to_dict() == config.to_dict()
    assert snap.get_text_config().to_dict() == config.get_text_config().to_dict()
    assert snap.config_class == type(config).__name__
    assert getattr(snap, "no_such_field", "default") == "default"  # getattr with a default behaves alike
    with pytest.raises(AttributeError):
        snap.no_such_field


def test_aliases_and_mutation():
    from transformers import GptOssConfig

    snap = snapshot(GptOssConfig(num_local_experts=8))
    assert snap.num_experts == snap.num_local_experts == 8  # attribute_map aliases are captured
    snap.sliding_window = 64
    assert snap.to_dict()["sliding_window"] == 64
    assert snapshot(snap) is snap
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        snap.save_pretrained(d)
        assert dict(AutoConfig.from_pretrained(d).to_dict(), _name_or_path="") == snap.to_dict()


def test_load_config_dir_caches_per_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96).save_pretrained(model)
    first = load_config_dir(str(model))
    assert (first.hidden_size, first.head_dim, first.config_class) == (64, 16, "LlamaConfig")

    def must_not_read(path):
        raise AssertionError("the cache entry should have answered")

    assert load_config_dir(str(model), read=must_not_read) == first
    d = json.loads((model / "config.json").read_text())
    d["hidden_size"] = 128
    (model / "config.json").write_text(json.dumps(d))
    assert load_config_dir(str(model)).hidden_size == 128  # a changed file is read again


def test_a_second_process_reads_the_default_config_without_transformers():
    from roofline.model_executor.loader.source import load_hf_config, resolve_source

    expected = load_hf_config(resolve_source(None))  # fills this machine's cache if it is empty
    code = ("import sys; from roofline.model_executor.loader.source import load_hf_config, resolve_source; "
            "c = load_hf_config(resolve_source(None)); "
            "print(c.to_json()); print(any(m.startswith('transformers') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert ConfigSnapshot.from_json(out[0]) == expected
    assert out[1] == "False"
