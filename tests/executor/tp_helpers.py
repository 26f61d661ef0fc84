"""Helpers for the tensor-parallel tests (also imported inside worker processes: keep it light)."""

from __future__ import annotations

from roofline.worker.worker import Worker

TIE = 1e-4  # a logit gap below this is a tie: summation order may flip the argmax


class FailOnRank1Worker(Worker):
    """Fails to load on rank 1 only (a start-up failure of one rank among healthy ones)."""

    def __init__(self, config, source, rank: int = 0, show_progress: bool = True) -> None:
        if rank == 1:
            raise MemoryError("rank 1 could not allocate its shard (injected)")
        super().__init__(config, source, rank=rank, show_progress=show_progress)


def assert_same_greedy(ref_outputs, outputs, lp_tol: float = 1e-3) -> int:
    """Greedy tokens identical to the reference; a divergence is accepted only where the reference's
    top two logits are tied (gap < TIE) and the other run took the other tied token.  Returns the
    number of tie flips.  Both runs must have asked for logprobs >= 2."""
    flips = 0
    for ref, out in zip(ref_outputs, outputs):
        a, b = ref.outputs[0], out.outputs[0]
        assert len(a.token_ids) == len(b.token_ids)
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[i], b.logprobs[i]
            if ta != tb:
                ranked = sorted(la.items(), key=lambda kv: -kv[1].logprob)
                gap = ranked[0][1].logprob - ranked[1][1].logprob
                assert gap < TIE and tb in la, (
                    f"prompt {ref.prompt_token_ids[:8]}...: position {i} differs ({ta} vs {tb}) with a "
                    f"logit gap of {gap:.3g} >= {TIE}: not a tie"
                )
                flips += 1
                break  # the continuations legitimately differ after a tie flip
            assert abs(la[ta].logprob - lb[tb].logprob) < lp_tol, (i, la[ta].logprob, lb[tb].logprob)
    return flips


CHATS = ["What is the capital of France?", "List three prime numbers.",
         "Write a short poem about autumn leaves falling in a quiet park."]


def chat_prompts(tok) -> list[dict]:
    """CHATS through the model's chat template, as token-id prompts."""
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in CHATS]
    return [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]


async def kill_rank_mid_generation(engine, ranks, rank: int, kill=None) -> tuple[float, list[str]]:
    """Start two long requests on `engine` (an AsyncLLM), SIGKILL `rank` (or call kill()) once the first has
    a token; every stream must then end in EngineDeadError.  Returns (seconds until all ended, their errors)."""
    import asyncio
    import os
    import signal
    import time

    import pytest

    from roofline import SamplingParams
    from roofline.engine.async_llm import EngineDeadError

    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    streams = [await engine.add_request(f"r{i}", [5 + i, 6, 7], params) for i in range(2)]
    first = await asyncio.wait_for(streams[0].__anext__(), 60)
    assert first.outputs[0].token_ids
    if kill is None:
        os.kill(ranks.by_rank(rank).proc.pid, signal.SIGKILL)
    else:
        kill()
    t0 = time.monotonic()
    errors = []
    for s in streams:
        with pytest.raises(EngineDeadError) as e:
            while True:
                out = await asyncio.wait_for(s.__anext__(), 30)
                assert not out.finished, "finished 400 tokens before the kill took effect?"
        errors.append(str(e.value))
    return time.monotonic() - t0, errors


class HangOnRank1Worker(Worker):
    """Rank 1 hangs holding the GIL in its third step (a deadlocked C call): its heartbeat stops."""

    def __init__(self, config, source, rank: int = 0, show_progress: bool = True) -> None:
        super().__init__(config, source, rank=rank, show_progress=show_progress)
        self.steps = 0

    def execute(self, out):
        self.steps += 1
        if self.rank == 1 and self.steps == 3:
            import ctypes

            ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL: no thread of this process runs
        return super().execute(out)
