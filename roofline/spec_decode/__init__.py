"""Speculative decoding: proposers (who guesses the next k tokens) and the rejection sampler (which
keeps the guesses the target model would have produced, exactly in distribution).

    proposer.py           the Proposer interface
    factory.py            create_proposer: a method name to its proposer (EAGLE-style heads plug in here)
    draft_model.py        a smaller model with the same vocabulary, its own KV pool
    ngram.py              prompt lookup over prompt + output so far
    rejection_sampler.py  greedy and random acceptance, recovered and bonus tokens
    draft_length.py       the per-step number of drafts, from the cost model and the acceptance rate

The step contract (1 + k tokens per request, rollback of rejected ones) lives in roofline/core
(scheduler, kv_cache_manager, scheduler_output) and roofline/worker/model_runner.py, and so do the
acceptance counters the scheduler keeps (core/spec_decode_stats.py: metrics, bench).
"""
