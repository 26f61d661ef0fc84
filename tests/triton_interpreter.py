"""Running Triton kernels without a GPU: through Triton's CPU interpreter.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it must be set before the kernel
module is imported; a module imported earlier in this process without it (CPU-only box) is reloaded.
"""

import importlib
import os
import sys

import torch


def interpret_without_gpu(module: str, kernel: str) -> None:
    """Make `module`'s kernels (its `kernel` attribute tells) interpreted when there is no CUDA device."""
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get(module)
    if mod is not None and type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
        importlib.reload(mod)
