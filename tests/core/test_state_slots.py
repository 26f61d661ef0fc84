"""Recurrent-state slots (linear-attention layers, attention/kv_spec.recurrent_spec) in the KV manager and the
scheduler: one slot per request from its first allocation to its blocks' release (finish, abort, recompute
preemption); a request waits while no slot is free; every slot back at the end."""

from __future__ import annotations

import torch

from roofline.attention import kv_spec
from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput
from roofline.sampling_params import SamplingParams


def req(rid: str, n: int = 20, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_slot_comes_with_the_first_blocks_and_goes_back_with_them():
    kv = KVCacheManager(16, 4, enable_caching=False, num_state_slots=2)
    a, b, c = req("a"), req("b"), req("c")
    assert kv.allocate_slots(a, 8) is not None and kv.get_state_slot("a") == 0
    assert kv.allocate_slots(a, 4) is not None and kv.get_state_slot("a") == 0  # the same slot while it runs
    assert kv.allocate_slots(b, 4) is not None and kv.get_state_slot("b") == 1
    free_blocks = kv.pool.num_free_blocks
    assert kv.allocate_slots(c, 4) is None  # no slot: nothing changes, like a short pool
    assert kv.pool.num_free_blocks == free_blocks and kv.get_state_slot("c") == -1
    kv.free(a)
    assert kv.allocate_slots(c, 4) is not None and kv.get_state_slot("c") == 0
    kv.free(b), kv.free(c)
    assert kv.num_free_state_slots == 2 and kv.pool.num_free_blocks == 16
    assert not kv.can_fork and not kv.can_swap_out(a)
    assert KVCacheManager(16, 4).can_fork and KVCacheManager(16, 4).get_state_slot("a") == -1


def run_to_end(sched: Scheduler) -> list:
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        slots = {s.req_id: s.state_slot for s in out.scheduled}
        assert len(set(slots.values())) == len(slots) and -1 not in slots.values()  # one own slot per request
        steps.append(out)
        sampled = [s.req_id for s in out.scheduled if s.sample]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[7] for _ in sampled],
                                                        logprobs=[None] * len(sampled), prompt_logprobs={}))
    return steps


def test_the_scheduler_hands_out_slots_and_takes_them_back_under_preemption():
    sc = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=256, enable_chunked_prefill=True)
    cc = CacheConfig(block_size=4, enable_prefix_caching=False)
    sched = Scheduler(sc, cc, num_blocks=10, num_state_slots=3)
    for i in range(5):
        sched.add_request(req(f"r{i}", n=18, max_tokens=12))
    steps = run_to_end(sched)
    assert sched.num_preemptions > 0  # 10 blocks of 4 hold one 30-token request, not two
    assert max(len(o.scheduled) for o in steps) <= 3
    assert sched.kv.num_free_state_slots == 3 and not sched.kv.req_state_slot
    assert sched.kv.pool.num_free_blocks == 10


def test_an_abort_gives_the_slot_back():
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(sc, CacheConfig(block_size=4, enable_prefix_caching=False), num_blocks=32, num_state_slots=2)
    sched.add_request(req("a"))
    sched.schedule()
    assert sched.kv.num_free_state_slots == 1
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_state_slots == 2


def test_recurrent_spec_sizes_and_allocation():
    spec = kv_spec.recurrent_spec(conv_dim=128, conv_kernel=4, num_v_heads=4, k_head_dim=16, v_head_dim=8)
    assert spec.recurrent and spec.values_per_token == 0 and spec.bytes_per_token(torch.float32) == 0
    assert spec.state_values == 128 * 3 + 4 * 16 * 8
    attn = kv_spec.attention_spec(2, 16)
    specs = [spec, attn]
    assert kv_spec.bytes_per_block(specs, 4, torch.bfloat16) == attn.bytes_per_token(torch.bfloat16) * 4
    assert kv_spec.num_state_slots(specs, 8) == 8 and kv_spec.num_state_slots([attn], 8) == 0
    assert kv_spec.state_bytes(specs, 8) == 8 * spec.state_values * 4
    caches = kv_spec.allocate(specs, 5, 4, lambda shape: torch.zeros(shape, dtype=torch.bfloat16), num_state_slots=8)
    assert caches[0].shape == (8, spec.state_values) and caches[0].dtype == torch.float32  # states in fp32
    assert caches[1].shape == (2, 5, 4, 2, 16) and caches[1].dtype == torch.bfloat16
    layout, _ = kv_spec.plan_layout(specs)
    assert not layout.grouped
