"""Triton kernels for the paged KV cache and the backend that uses them.

Import roofline.attention.triton.backend for TritonAttentionBackend; this package init stays
empty so that importing it does not import triton (set TRITON_INTERPRET before that, for CPU runs).
"""
