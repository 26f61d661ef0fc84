"""NgramProposer (prompt lookup): the drafts are the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, n tried from prompt_lookup_max down to prompt_lookup_min.

Input-grounded generation (summaries, code edits, quoting a document) repeats spans it has seen, so
the continuation of an earlier match is often exactly what the model produces next.  No model, no
KV: the drafts are deterministic (q one-hot).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from roofline.spec_decode.proposer import ProposalBatch, Proposals, Proposer


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the last n tokens (longest n first)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: each has at least one token after it
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            # the match's continuation; when it runs into the end of the sequence, the sequence repeats
            # with period (length - start) as far as the match shows, so the guess goes on cyclically
            start = int(hits[-1]) + n
            cont = tokens[start:]
            return np.resize(cont, min(k, max(len(cont), k))).tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, batch: ProposalBatch) -> Proposals:
        drafts = [lookup(np.asarray(t, dtype=np.int64), self.n_min, self.n_max, batch.k) if batch.k > 0 else []
                  for t in batch.token_ids]
        return Proposals(drafts)
