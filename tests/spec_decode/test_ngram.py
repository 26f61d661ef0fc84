"""Prompt lookup: the continuation of the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import numpy as np

from roofline.spec_decode.ngram import NgramProposer, lookup
from roofline.spec_decode.proposer import ProposalBatch


def test_longest_suffix_first_and_latest_occurrence():
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix [1, 2, 3] occurs at 0 (followed by 9, 9); [2, 3] alone would match later (followed by 7)
    assert lookup(toks, 1, 3, 2) == [9, 9]
    assert lookup(toks, 1, 2, 2) == [7, 8]  # the latest [2, 3]


def test_no_match_and_min_length():
    assert lookup(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert lookup(np.array([5, 1, 6, 1]), 2, 3, 3) == []  # only a 1-gram repeats
    assert lookup(np.array([5, 1, 6, 1]), 1, 3, 3) == [6, 1, 6]


def test_continuation_into_the_end_repeats_cyclically():
    # a loop of period 2: the latest match of [4, 5] is right before the end
    assert lookup(np.array([4, 5, 4, 5]), 2, 2, 5) == [4, 5, 4, 5, 4]


def test_proposer_batch():
    got = NgramProposer(1, 2).propose(ProposalBatch(["a", "b"], [[1, 2, 1], [3, 4]], 2))
    assert got.token_ids == [[2, 1], []] and got.probs is None
