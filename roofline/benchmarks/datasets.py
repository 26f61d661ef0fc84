"""Benchmark workloads: the BENCHMARKS.md generators (bit-identical across tools), a ShareGPT-format
file reader, and Poisson arrival times.

BENCHMARKS.md, "Generating a workload": Python's `random.Random(seed)`; for each of the n requests,
in this order: `L = rng.randint(in_min, in_max)`, the prompt `[rng.randrange(100, 49000) for _ in
range(L)]`, then `O = rng.randint(out_min, out_max)` (49000 becomes vocab_size - 100 for a model
with a smaller vocabulary).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 49000


@dataclass
class SampleRequest:
    prompt: Union[str, list[int]]  # token ids (sent as such) or text
    prompt_len: int
    output_len: int  # tokens to generate (exactly, with ignore_eos)


def token_id_high(vocab_size: Optional[int] = None) -> int:
    """Exclusive upper bound of the random token ids."""
    if vocab_size is not None and vocab_size < TOKEN_ID_HIGH:
        return vocab_size - 100
    return TOKEN_ID_HIGH


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0,
                    vocab_size: Optional[int] = None) -> list[SampleRequest]:
    """The W1/W2 generator (defaults there: n=64, in 64..256, out 32..256, seed 0)."""
    rng = random.Random(seed)
    hi = token_id_high(vocab_size)
    out = []
    for _ in range(num):
        length = rng.randint(input_len[0], input_len[1])
        prompt = [rng.randrange(TOKEN_ID_LOW, hi) for _ in range(length)]
        olen = rng.randint(output_len[0], output_len[1])
        out.append(SampleRequest(prompt, length, olen))
    return out


def shared_prefix_requests(num: int = 64, prefix_len: int = 512, suffix_len: int = 32, output_len: int = 32,
                           seed: int = 1, vocab_size: Optional[int] = None) -> list[SampleRequest]:
    """W3: one common prefix drawn from random.Random(seed), then each request's unique suffix drawn
    from the same generator, in request order."""
    rng = random.Random(seed)
    hi = token_id_high(vocab_size)
    prefix = [rng.randrange(TOKEN_ID_LOW, hi) for _ in range(prefix_len)]
    out = []
    for _ in range(num):
        suffix = [rng.randrange(TOKEN_ID_LOW, hi) for _ in range(suffix_len)]
        out.append(SampleRequest(prefix + suffix, prefix_len + suffix_len, output_len))
    return out


def _conversation_pairs(data: Iterable[dict]) -> list[tuple[str, str]]:
    """(first user turn, the reply to it) of each ShareGPT conversation."""
    pairs = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        prompt = first.get("value", first.get("content"))
        reply = second.get("value", second.get("content"))
        if isinstance(prompt, str) and isinstance(reply, str) and prompt and reply:
            pairs.append((prompt, reply))
    return pairs


def sharegpt_requests(path: str, num: int, tokenize: Callable[[str], list[int]], seed: int = 0,
                      max_prompt_len: int = 1024, max_total_len: int = 2048,
                      fixed_output_len: Optional[int] = None) -> list[SampleRequest]:
    """Sample `num` conversations from a ShareGPT-format JSON file (a list of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}).

    The prompt is the first turn, tokenized; the output length is the token length of the reply
    (or `fixed_output_len`). Pairs with fewer than 4 prompt or output tokens, a prompt longer than
    `max_prompt_len` or a total longer than `max_total_len` are skipped.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = _conversation_pairs(data)
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num:
            break
        ids = tokenize(prompt)
        olen = fixed_output_len if fixed_output_len is not None else len(tokenize(reply))
        if len(ids) < 4 or olen < 4 or len(ids) > max_prompt_len or len(ids) + olen > max_total_len:
            continue
        out.append(SampleRequest(ids, len(ids), olen))
    if len(out) < num:
        raise ValueError(f"{path}: only {len(out)} usable conversations (wanted {num})")
    return out


def arrival_times(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start): Poisson arrivals at `request_rate` per second (the first
    at 0, then exponential gaps from random.Random(seed)); all at 0 when the rate is infinite."""
    if request_rate == float("inf"):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num):
        if i:
            t += rng.expovariate(request_rate)
        out.append(t)
    return out
