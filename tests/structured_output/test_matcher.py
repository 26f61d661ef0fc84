"""RequestGrammar: advances with accepted tokens, allows the stop token only once the grammar is
complete, rolls back by k tokens (the speculative-decoding hook), and a request whose compile is still
running waits in the scheduler's queue without losing its place."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.request import Request
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput
from roofline.sampling_params import SamplingParams, StructuredOutputsParams
from roofline.structured_output.bitmask import bitmask_width
from roofline.structured_output.matcher import RequestGrammar

EOS = 2


def allowed(g: RequestGrammar, vocab: int) -> set[int]:
    mask = torch.zeros((1, bitmask_width(vocab)), dtype=torch.int32)
    g.fill(mask, 0)
    bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


def test_accept_stop_and_rollback(grammar_cache):
    tok = grammar_cache.tokenizer
    vocab = grammar_cache.vocab_size
    g = RequestGrammar(grammar_cache.get(StructuredOutputsParams(regex="ab[0-9]{2}")), [EOS])
    g.compiled.result(60)
    ids = tok.encode("ab12", add_special_tokens=False)
    assert EOS not in allowed(g, vocab)
    g.accept(ids[:-1])
    before = allowed(g, vocab)
    assert EOS not in before  # the grammar is not complete: no EOS
    g.accept(ids[-1:])
    assert g.is_completed() and allowed(g, vocab) == {EOS}
    g.rollback(1)
    assert not g.is_completed() and allowed(g, vocab) == before
    with pytest.raises(ValueError, match="roll back"):
        g.rollback(len(ids) + 1)
    g.accept(ids[-1:] + [EOS])
    assert not g.constrains  # terminated: nothing left to constrain


def test_a_constraint_after_the_thinking_starts_at_its_end_token(grammar_cache):
    """start_after_token_id (a reasoning model's end-of-think): free text until that token, then the
    grammar constrains what follows it, from the token after it on."""
    tok = grammar_cache.tokenizer
    end = tok.encode("<|im_end|>", add_special_tokens=False)[0]  # any single token stands in for </think>
    g = RequestGrammar(grammar_cache.get(StructuredOutputsParams(regex="ab[0-9]{2}")), [EOS], start_after_token_id=end)
    g.compiled.result(60)
    thinking = tok.encode("let me think", add_special_tokens=False)
    assert not g.constrains  # free while thinking
    g.accept(thinking)
    assert not g.constrains and g.num_accepted == 0
    answer = tok.encode("ab12", add_special_tokens=False)
    g.accept(thinking[:1] + [end] + answer[:1])  # the end token and the first answer token in one step
    assert g.constrains and g.num_accepted == 1 and not g.broken
    g.accept(answer[1:])
    assert g.is_completed() and allowed(g, grammar_cache.vocab_size) == {EOS}


def test_an_ungrammatical_token_leaves_the_request_unconstrained(grammar_cache):
    tok = grammar_cache.tokenizer
    g = RequestGrammar(grammar_cache.get(StructuredOutputsParams(regex="[0-9]+")), [EOS])
    g.compiled.result(60)
    g.accept(tok.encode("x", add_special_tokens=False))
    assert g.broken and not g.constrains


def test_scheduler_leaves_a_compiling_request_waiting():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128),
                      CacheConfig(block_size=4), num_blocks=32)
    fut: Future = Future()
    first = Request("constrained", [5, 6, 7], SamplingParams(max_tokens=4), EOS)
    first.grammar = RequestGrammar(fut, [EOS])
    second = Request("free", [8, 9], SamplingParams(max_tokens=4), EOS)
    sched.add_request(first)
    sched.add_request(second)
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["free"]
    assert sched.waiting == [first]
    fut.set_result(None)  # compiled (the scheduler only asks whether it is done)
    # the first step comes back: "free" sampled one token (a request whose step is out is not scheduled again)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["free"], sampled_token_ids=[[3]], logprobs=[None],
                                                    prompt_logprobs={}))
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["free", "constrained"]  # free decodes, constrained prefills
    assert [n.req_id for n in out.new_requests] == ["constrained"] and out.new_requests[0].sampling.structured
