"""One request's failure fails that request alone: the engine keeps serving the others, their greedy
tokens are unchanged, and every KV block comes back.  Seeds anywhere in the signed 64-bit range work,
also with n > 1 (they used to overflow the generator and kill the engine)."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from roofline.executor.base import ExecutorDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def llm(tiny_models):
    path, _ = tiny_models["llama"]
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)


def _free(llm):
    st = llm.llm_engine.get_stats()
    return st.num_free_blocks == st.num_total_blocks


def test_a_failing_request_fails_alone(llm, monkeypatch):
    base = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                        use_tqdm=False)]
    engine = llm.llm_engine
    real = engine.executor.execute
    poisoned = set()

    def execute(out):  # the step raises whenever the poisoned request is in it, wherever it sits
        if any(s.req_id in poisoned for s in out.scheduled):
            raise ValueError("poisoned request")
        return real(out)

    monkeypatch.setattr(engine.executor, "execute", execute)
    nxt = next(llm._counter)  # request ids are llm-<counter>: the next call's second prompt is nxt + 2
    poisoned.add(f"llm-{nxt + 2}")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert outs[1].error and "poisoned request" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert outs[i].outputs[0].token_ids == base[i]
    assert _free(llm)
    # and the engine still serves
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == base[0]


def test_a_dead_executor_still_stops_the_engine(llm, monkeypatch):
    def execute(out):
        raise ExecutorDeadError("rank 1 was killed by SIGKILL")

    monkeypatch.setattr(llm.llm_engine.executor, "execute", execute)
    with pytest.raises(ExecutorDeadError):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert _free(llm)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0, -1])
def test_extreme_seeds_with_n2_are_served_and_reproducible(llm, seed):
    params = SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=6)
    a = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert a.error is None and [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert _free(llm)


@pytest.mark.parametrize("kwargs", [dict(seed=2**64 - 1), dict(seed=10**30), dict(seed=-(2**63) - 1),
                                    dict(seed=True), dict(temperature=float("nan")),
                                    dict(repetition_penalty=float("nan")), dict(top_p=float("inf")),
                                    dict(max_tokens=True), dict(n=2.0), dict(min_p=float("nan"))])
def test_sampling_params_reject_out_of_range_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
