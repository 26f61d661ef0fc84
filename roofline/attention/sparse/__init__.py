"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer's top-k of positions per query token,
and MLA attending only to those positions: see dsa.py."""

from roofline.attention.sparse.dsa import TopkSelection, select_topk, write_index_keys

__all__ = ["TopkSelection", "select_topk", "write_index_keys"]
