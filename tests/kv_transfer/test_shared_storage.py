"""SharedStorageConnector: a prefill engine writes a prompt's KV blocks as files, a decode engine loads
them by prefix hash and decodes; greedy tokens equal one colocated engine's and HF's, and every block
returns to both pools.  The directory also serves as a prefix tier that outlives an engine."""

from __future__ import annotations

import os

import pytest

from roofline import LLM
from roofline.sampling_params import SamplingParams
from tests.reference.hf_models import hf_greedy

BLOCK = 8
PROMPT_LENS = (5, 8, 9, 23, 40, 61)
MAX_TOKENS = 10


def storage_config(role: str, path: str, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path, **extra}}


def engine(path: str, kv_transfer_config=None, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=96, block_size=BLOCK, show_progress=False,
               kv_transfer_config=kv_transfer_config, **kw)


def prompts(vocab: int = 384) -> list[list[int]]:
    return [[(7 * i + 13 * n) % (vocab - 10) + 5 for i in range(n)] for n in PROMPT_LENS]


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def kv_idle(llm: LLM) -> bool:
    s = llm.llm_engine.scheduler.get_stats()
    return s.kv_cache_usage == 0 and s.num_free_blocks == s.num_total_blocks and not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]


def test_prefill_then_decode_matches_colocated_and_hf(tiny, tmp_path):
    path, hf = tiny
    store = str(tmp_path / "kv")
    prefill = engine(path, storage_config("kv_producer", store))
    decode = engine(path, storage_config("kv_consumer", store))
    colocated = engine(path)
    ps = prompts()
    firsts = prefill.generate([{"prompt_token_ids": p} for p in ps],
                              greedy(1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    params = [f.kv_transfer_params for f in firsts]
    assert all(p is not None and p["do_remote_prefill"] for p in params)
    assert [len(p["remote_block_ids"]) for p in params] == [n // BLOCK for n in PROMPT_LENS]
    outs = decode.generate([{"prompt_token_ids": p} for p in ps],
                           [greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
    ref = colocated.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False)
    for p, f, o, r in zip(ps, firsts, outs, ref):
        expected = hf_greedy(hf, p, MAX_TOKENS)
        assert o.outputs[0].token_ids == expected
        assert r.outputs[0].token_ids == expected
        assert f.outputs[0].token_ids == expected[:1]
        # every full prompt block but the last token's came from the files
        assert o.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
    tracker = decode.llm_engine.scheduler.kv_transfer
    block_bytes = decode.llm_engine.executor.block_bytes()
    assert tracker.bytes_received == sum((n - 1) // BLOCK for n in PROMPT_LENS) * block_bytes
    assert kv_idle(prefill) and kv_idle(decode)


def test_storage_is_a_prefix_tier_that_survives_a_restart(tiny, tmp_path):
    path, hf = tiny
    store = str(tmp_path / "kv")
    p = prompts()[-1]
    first = engine(path, storage_config("kv_both", store))
    out1 = first.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)[0]
    assert out1.num_cached_tokens == 0
    files = [f for d, _, fs in os.walk(store) for f in fs]
    assert len(files) == len(p) // BLOCK
    first.llm_engine.shutdown()
    del first
    second = engine(path, storage_config("kv_both", store))  # a fresh pool: only the files know the prompt
    out2 = second.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)[0]
    assert out2.num_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
    assert out2.outputs[0].token_ids == out1.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
    assert kv_idle(second)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_missing_blocks(tiny, tmp_path, policy):
    """A decode told the prefill happened, but the files never came: recompute here, or a clear error."""
    path, hf = tiny
    store = str(tmp_path / "kv")
    decode = engine(path, dict(storage_config("kv_consumer", store), kv_load_failure_policy=policy))
    p = prompts()[-2]
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": [0, 1]}
    out = decode.generate({"prompt_token_ids": p}, greedy(kv_transfer_params=params), use_tqdm=False)[0]
    if policy == "recompute":
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS)
        assert out.num_cached_tokens == 0
    else:
        assert out.outputs[0].finish_reason == "error"
        assert "KV transfer failed" in out.error and "not in the shared storage" in out.error
    assert kv_idle(decode)


def test_bad_transfer_params_are_rejected(tiny, tmp_path):
    path, _ = tiny
    plain = engine(path)
    with pytest.raises(ValueError, match="no KV connector"):
        plain.generate({"prompt_token_ids": [5, 6, 7]}, greedy(kv_transfer_params={"do_remote_decode": True}),
                       use_tqdm=False)
    consumer = engine(path, storage_config("kv_consumer", str(tmp_path / "kv")))
    for bad, field in [({"do_remote_decode": True}, "do_remote_decode"),
                       ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
                       ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
                       ({"remote_port": 70000}, "remote_port")]:
        with pytest.raises(ValueError, match=field):
            consumer.generate({"prompt_token_ids": [5, 6, 7]}, greedy(kv_transfer_params=bad), use_tqdm=False)
    assert kv_idle(consumer)
    with pytest.raises(ValueError, match="kv_role"):
        engine(path, {"kv_connector": "SharedStorageConnector", "kv_role": "kv_sideways"})
    with pytest.raises(ValueError, match="shared_storage_path"):
        engine(path, {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"})
