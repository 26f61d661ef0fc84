"""The scheduler keeps at most max_loras adapters among the running requests (so every step fits the workers'
slots), lets base-model and same-adapter requests go ahead of one that must wait, and finishes them all."""

from __future__ import annotations

import pytest

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.request import Request
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput
from roofline.lora.request import LoRARequest
from roofline.sampling_params import SamplingParams

A, B, C = (LoRARequest(n, i, f"/{n}") for i, n in enumerate("abc", 1))


@pytest.mark.parametrize("max_loras,policy,mode", [(1, "fcfs", "recompute"), (2, "priority", "swap"),
                                                   (1, "fcfs", "swap")])
def test_running_adapters_stay_within_max_loras(max_loras, policy, mode):
    sc = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8, max_model_len=1000, policy=policy,
                         preemption_mode=mode)
    sched = Scheduler(sc, CacheConfig(block_size=4), 12, num_swap_blocks=24 if mode == "swap" else 0,
                      max_loras=max_loras)
    loras = [A, B, None, A, C, None, B, A]
    reqs = [Request(f"r{i}", [3 + i] * (5 + i), SamplingParams(max_tokens=6, ignore_eos=True), arrival_time=float(i),
                    lora_request=lora) for i, lora in enumerate(loras)]
    for r in reqs:
        sched.add_request(r)
    first_step = None
    for step in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        running = {r.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(running) <= max_loras
        in_step = {sched.requests[s.req_id].lora_int_id for s in out.scheduled} - {0}
        assert len(in_step) <= max_loras
        if first_step is None:
            first_step = {s.req_id for s in out.scheduled}
        sampled = [s.req_id for s in out.scheduled if s.sample]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[7] for _ in sampled],
                                                        logprobs=[None] * len(sampled), prompt_logprobs={}))
    assert all(r.is_finished and r.num_output_tokens == 6 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 12
    if max_loras == 1 and mode == "recompute":  # B waits; the base request and A's second go ahead of it
        assert {"r0", "r2"} <= first_step and "r1" not in first_step
