"""Attention tests: without a CUDA device, Triton kernels run through its CPU interpreter.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it has to be set before
roofline.attention.triton.kernels is imported; if that module was imported earlier in this process
without the interpreter (on a CPU-only box), it is reloaded so its kernels are interpreted.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _mod = sys.modules.get("roofline.attention.triton.kernels")
    if _mod is not None and type(_mod._paged_attn_kernel).__name__ != "InterpretedFunction":
        importlib.reload(_mod)
