"""Beam search inside the engine: every beam, in order, as HF transformers' generate(num_beams=W,
early_stopping=False) on the default model (fp32, CPU) and, under memory pressure, on a tiny random one;
beams fork copy-on-write and feed one token a step; every block returns at the end and on abort; plain
requests batched with a search keep their tokens."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, BeamSearchParams, SamplingParams
from roofline.core.beam_search import BeamSearch
from roofline.core.scheduler_output import SchedulerOutput
from roofline.engine.core_process import AddRequest, encoder, to_core_decoder
from roofline.sampling_params import MAX_BEAM_WIDTH
from tests.reference.hf_models import build_tiny_model, random_prompts

MAX_TOKENS = 12
# "Hi" ends on EOS within 12 tokens (W=2: both hypotheses finish early and the search stops before
# max_tokens); the France answers finish at different lengths (length_penalty reorders them)
CHATS = ["Hi", "What is the capital of France?"]


def chat_ids(llm, content: str) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def hf_beams(model, ids: list[int], width: int, max_tokens: int, length_penalty: float, ignore_eos: bool):
    """HF's beams, best first: (generated tokens, sequences_score).  ignore_eos: generate without an EOS id
    (the explicit attention mask keeps the prompt's <|im_end|>, which is also the pad id, attended)."""
    x = torch.tensor([ids])
    eos, threads = model.generation_config.eos_token_id, torch.get_num_threads()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    torch.set_num_threads(1)  # HF's search is many small ops: one thread is several times faster on a shared CPU
    try:
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width, do_sample=False,
                             max_new_tokens=max_tokens, num_return_sequences=width, length_penalty=length_penalty,
                             early_stopping=False, return_dict_in_generate=True, output_scores=True)
    finally:
        model.generation_config.eos_token_id = eos
        torch.set_num_threads(threads)
    beams = []
    for seq, score, idx in zip(out.sequences, out.sequences_scores, out.beam_indices):
        n = int((idx != -1).sum())  # this hypothesis' generated length (shorter ones are padded)
        beams.append((seq[len(ids) : len(ids) + n].tolist(), float(score)))
    return beams


def assert_all_blocks_free(llm):
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("width,length_penalty,ignore_eos", [(2, 1.0, False), (4, 2.0, False), (4, 0.5, True)])
def test_beams_match_hf(default_llm, hf_default_model, width, length_penalty, ignore_eos):
    prompts = [chat_ids(default_llm, c) for c in CHATS]
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = default_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = default_llm.get_tokenizer().eos_token_id
    for ids, out in zip(prompts, outs):
        ref = hf_beams(hf_default_model, ids, width, MAX_TOKENS, length_penalty, ignore_eos)
        ours = [(s.tokens[len(ids) :], s.score) for s in out.sequences]
        assert [t for t, _ in ours] == [t for t, _ in ref]
        for (tokens, score), (_, ref_score), seq in zip(ours, ref, out.sequences):
            assert seq.tokens[: len(ids)] == ids
            assert abs(score - ref_score) < 1e-4
            assert abs(seq.cum_logprob / len(tokens) ** length_penalty - score) < 1e-6
            ended_on_eos = not ignore_eos and tokens[-1] == eos
            assert seq.finish_reason == ("stop" if ended_on_eos else "length")
            assert ended_on_eos or len(tokens) == MAX_TOKENS
            assert seq.text == default_llm.get_tokenizer().decode(tokens[:-1] if ended_on_eos else tokens,
                                                                  skip_special_tokens=True)
    assert_all_blocks_free(default_llm)


def test_beams_under_memory_pressure_match_hf(tmp_path):
    """A pool far too small for 4 searches of 4 beams: beams give up their blocks, are preempted (recompute,
    swap) and wait for room in the running batch; the beams stay HF's.  EOS is a token this random model's
    beams pick, so that some hypotheses end early."""
    hf = build_tiny_model("llama", str(tmp_path), seed=1, eos_token_id=238)
    prompts = random_prompts(4, hf.config.vocab_size, 10, 30, seed=3)
    refs = [hf_beams(hf, p, 4, 10, 0.5, False) for p in prompts]
    assert any(len(ref[0][0]) < 10 for ref in refs)
    for variant in ({"max_num_seqs": 3},
                    {"preemption_mode": "swap", "swap_space": 0.01, "max_num_seqs": 1, "max_num_batched_tokens": 8}):
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=14, block_size=4, show_progress=False,
                  **variant)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(4, 10, length_penalty=0.5))
        for p, ref, out in zip(prompts, refs, outs):
            assert [s.tokens[len(p) :] for s in out.sequences] == [t for t, _ in ref], variant
        assert llm.llm_engine.get_stats().num_preemptions > 0
        assert_all_blocks_free(llm)
        del llm


def test_search_step_rules():
    """BeamSearch.step on made-up logprobs: an EOS within the first W candidates finishes a hypothesis,
    one ranked below them is dropped; the search stops once W hypotheses are in and the best live beam,
    at its current length, scores no better than the worst of them."""
    s = BeamSearch(width=2, max_tokens=10, length_penalty=1.0, eos_token_id=9)
    assert s.num_logprobs == 4
    assert s.step([[(1, -0.1), (9, -0.2), (2, -0.3), (3, -0.4)]]) == [(0, 1), (0, 2)]
    assert [(h.token_ids, h.score, h.finish_reason) for h in s.finished] == [([9], pytest.approx(-0.2), "stop")]
    # beams [1] (-0.1) and [2] (-0.3): candidates -0.15 (0, 4), -0.31 (1, 7), -0.6 (0, 5), -0.7 (0, EOS: 3rd)
    assert s.step([[(4, -0.05), (5, -0.5), (9, -0.6), (6, -0.7)], [(7, -0.01), (8, -0.9), (3, -1.0), (6, -1.1)]]) \
        == [(0, 4), (1, 7)]
    assert len(s.finished) == 1 and not s.done
    # [1, 4] + EOS: -0.2 over 3 tokens; the best live beam, -0.65 / 3, cannot beat the worst finished (-0.2)
    assert s.step([[(9, -0.05), (3, -0.5), (5, -0.6), (6, -0.7)], [(3, -0.9), (5, -1.0), (6, -1.1), (8, -1.2)]]) == []
    assert s.done and [h.token_ids for h in s.finished] == [[1, 4, 9], [9]]
    assert s.finished[0].score == pytest.approx(-0.2 / 3)
    # at max_tokens the W best candidates finish, whatever their token
    s = BeamSearch(width=2, max_tokens=1, length_penalty=2.0, eos_token_id=9)
    assert s.step([[(5, -0.1), (9, -0.2), (6, -0.3), (7, -0.4)]]) == [] and s.done
    assert [(h.token_ids, h.finish_reason) for h in s.finished] == [([5], "length"), ([9], "stop")]


def _group_items(out: SchedulerOutput, rid: str):
    return [s for s in out.scheduled if s.req_id == rid or s.req_id.startswith(f"{rid}#beam")]


def test_beams_fork_copy_on_write_and_feed_one_token_a_step(default_llm, monkeypatch):
    engine, sched = default_llm.llm_engine, default_llm.llm_engine.scheduler
    steps: list[SchedulerOutput] = []
    execute = engine.executor.execute
    monkeypatch.setattr(engine.executor, "execute", lambda out: steps.append(out) or execute(out))
    ids = chat_ids(default_llm, "Hi")  # 31 tokens: a full block and a partial one the forks share
    assert len(ids) % sched.block_size
    engine.add_request("beam-cow", ids, BeamSearchParams(4, 8, ignore_eos=True).sampling_params())
    final, shared = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        group = sched.beam_groups.get("beam-cow")
        if group is not None and len(group.beams) == 4:
            tables = [sched.kv.req_blocks[b.request_id] for b in group.beams]
            shared.append(len({t[0].block_id for t in tables}) == 1 and tables[0][0].ref_cnt >= 4)
    assert shared and all(shared)  # the prompt's first block: one block under every beam
    assert sum(len(s.blocks_to_copy) for s in steps) >= 3  # the shared partial block, copied on write
    first = next(i for i, s in enumerate(steps) if _group_items(s, "beam-cow"))
    later = [item for s in steps[first + 1 :] for item in _group_items(s, "beam-cow")]
    assert len(later) >= 4 * 6 and all(len(item.token_ids) == 1 for item in later)  # no beam is re-prefilled
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [8] * 4
    assert_all_blocks_free(default_llm)


def test_abort_mid_search_frees_every_block(default_llm):
    engine = default_llm.llm_engine
    engine.add_request("beam-abort", chat_ids(default_llm, "List three prime numbers."),
                       BeamSearchParams(4, 16).sampling_params())
    for _ in range(4):
        assert engine.step() == []  # a search streams nothing
    assert len(engine.scheduler.beam_groups["beam-abort"].beams) == 4
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_total_blocks
    engine.abort_requests(["beam-abort"])
    assert_all_blocks_free(default_llm)
    (out,) = engine.step()
    assert out.request_id == "beam-abort" and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert not engine.has_unfinished_requests() and not engine.scheduler.beam_groups


def test_plain_requests_unchanged_beside_a_search(default_llm):
    prompts = [{"prompt_token_ids": chat_ids(default_llm, c)} for c in ("Hi", "List three prime numbers.")]
    plain = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)]
    alone = default_llm.generate(prompts, plain, use_tqdm=False)
    beam = BeamSearchParams(4, MAX_TOKENS).sampling_params()
    mixed = default_llm.generate(prompts + prompts[:1], plain + [beam], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert len(mixed[2].outputs) == 4 and mixed[2].outputs[0].score is not None
    assert_all_blocks_free(default_llm)


def test_bad_beam_search_input():
    for width in (0, -1, MAX_BEAM_WIDTH + 1, 2.0):
        with pytest.raises(ValueError, match="beam_width"):
            BeamSearchParams(width, 8)
    for n in (0, MAX_BEAM_WIDTH + 1):
        with pytest.raises(ValueError, match="beam_width"):
            SamplingParams(n=n, use_beam_search=True)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(2, 8, length_penalty=float("nan"))
    for option in ({"stop": ["."]}, {"logprobs": 2}, {"min_tokens": 1}, {"repetition_penalty": 1.2}):
        with pytest.raises(ValueError, match=f"{next(iter(option))}.*use_beam_search"):
            SamplingParams(n=2, use_beam_search=True, **option)
    assert BeamSearchParams(MAX_BEAM_WIDTH, 8).sampling_params().n == MAX_BEAM_WIDTH


def test_prompt_too_long_for_a_search_is_refused(default_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.beam_search("Hi", BeamSearchParams(2, 10**7))
    assert_all_blocks_free(default_llm)


def test_beam_request_crosses_to_the_core_process():
    params = BeamSearchParams(3, 5, length_penalty=0.5, ignore_eos=True).sampling_params()
    msg = to_core_decoder.decode(encoder.encode(AddRequest("r", [1, 2], params, None, None, 0, None)))
    assert msg.params == params and msg.params.use_beam_search and msg.params.length_penalty == 0.5
