"""Shared fixtures: the default model (loaded once per session) and its HF reference."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_addoption(parser):
    parser.addoption("--engine-core-process", action="store_true", default=False,
                     help="every AsyncLLM.from_engine_args runs its engine core in a process of its own "
                          "(the server suite's second mode)")


@pytest.fixture(scope="session", autouse=True)
def engine_core_process_mode(request):
    """With --engine-core-process, servers built from EngineArgs drive an EngineCoreClient."""
    if not request.config.getoption("--engine-core-process"):
        yield False
        return
    import dataclasses

    from roofline.engine.async_llm import AsyncLLM

    original = AsyncLLM.__dict__["from_engine_args"]

    def in_own_process(cls, engine_args, **kwargs):
        return original.__func__(cls, dataclasses.replace(engine_args, engine_core_process=True), **kwargs)

    AsyncLLM.from_engine_args = classmethod(in_own_process)
    try:
        yield True
    finally:
        AsyncLLM.from_engine_args = original


@pytest.fixture(scope="session")
def default_llm():
    from roofline import LLM

    return LLM(dtype="float32", device="cpu", num_kv_blocks=1024, show_progress=False)


@pytest.fixture(scope="session")
def smollm2_on(request):
    """device -> an fp32 engine on the default model: the session's CPU engine, or one built on CUDA."""
    engines = {}

    def get(device):
        if device == "cpu":
            return request.getfixturevalue("default_llm")
        if device not in engines:
            from roofline import LLM

            engines[device] = LLM(dtype="float32", device=device, num_kv_blocks=1024, show_progress=False)
        return engines[device]

    return get


@pytest.fixture(scope="session")
def hf_default_model():
    from transformers import AutoModelForCausalLM

    from roofline.model_executor.loader.source import default_model_file

    f = default_model_file()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(f), gguf_file=os.path.basename(f),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (checkpoint dir, HF model) for tiny random Llama, Qwen2, Qwen3."""
    from tests.reference.hf_models import build_tiny_model

    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        out[arch] = (path, build_tiny_model(arch, path, seed=1))
    return out
