"""The step bitmask: built from matchers in the engine, applied to logits in the worker (plain torch).
apply_token_bitmask must agree with xgrammar's own kernel and with the bit layout read one bit at a time,
touch only the rows it is given, and leave allowed logits bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roofline.sampling_params import StructuredOutputsParams
from roofline.structured_output.bitmask import (
    apply_token_bitmask,
    bitmask_tensor,
    bitmask_width,
    build_step_bitmask,
)
from roofline.structured_output.matcher import RequestGrammar


@pytest.mark.parametrize("vocab", [31, 32, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [[0], [2, 0], [1, 3, 4]])
def test_apply_matches_the_bit_layout_and_xgrammar(vocab, rows):
    import xgrammar as xgr

    g = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(5, vocab, generator=g)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), bitmask_width(vocab)), generator=g, dtype=torch.int64)
    mask = words.to(torch.int32)
    ours = logits.clone()
    apply_token_bitmask(ours, rows, mask)

    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little").reshape(len(rows), -1)[:, :vocab]
    expected = logits.clone()
    for i, r in enumerate(rows):
        expected[r][torch.from_numpy(bits[i] == 0)] = float("-inf")
    assert torch.equal(ours, expected)  # allowed logits untouched bit for bit, other rows too

    full = torch.full((5, mask.shape[1]), -1, dtype=torch.int32)
    full[rows] = mask
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)


def test_tokens_past_the_mask_are_masked():
    logits = torch.zeros(1, 40)  # a padded vocabulary wider than the 32 tokens the mask covers
    apply_token_bitmask(logits, [0], torch.tensor([[-1]], dtype=torch.int32))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(32))


def test_whole_batch_fast_path():
    logits = torch.randn(2, 64)
    mask = torch.tensor([[0b101, 0], [-1, 1]], dtype=torch.int32)
    apply_token_bitmask(logits, [0, 1], mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(33))


def test_built_bitmask_round_trips_and_skips_unready_rows(grammar_cache):
    from concurrent.futures import Future

    vocab = grammar_cache.vocab_size
    ready = RequestGrammar(grammar_cache.get(StructuredOutputsParams(choice=["yes", "no"])), [])
    ready.compiled.result(60)
    compiling = RequestGrammar(Future(), [])  # its compile has not finished: not constrained yet
    ids, data = build_step_bitmask([("a", compiling), ("b", ready)], vocab)
    assert ids == ["b"]
    mask = bitmask_tensor(data, 1, torch.device("cpu"))
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, [0], mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    tok = grammar_cache.tokenizer
    texts = {tok.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert build_step_bitmask([("a", compiling)], vocab) == ([], None)
