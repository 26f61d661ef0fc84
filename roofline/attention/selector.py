"""Which attention backend runs: the one place that knows every implementation (the interface in
backend.py knows none of them)."""

from __future__ import annotations

from roofline.attention.backend import AttentionBackend


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """Backend by config name: 'torch' (reference, CPU and CUDA), 'cpu' (native CPU kernels),
    'triton' (GPU kernels), 'auto' (triton on CUDA, cpu on CPU when each is usable, else torch)."""
    if name == "auto":
        name = "torch"
        if device.startswith("cpu"):
            from roofline.cpu import ops as cpu_ops

            name = "cpu" if cpu_ops.available() else "torch"
        elif device.startswith("cuda"):
            try:
                import triton  # noqa: F401

                name = "triton"
            except ImportError:
                name = "torch"
    if name == "torch":
        from roofline.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        if not device.startswith("cpu"):
            raise ValueError(f"attention backend 'cpu' runs on the CPU only, not on {device!r}")
        from roofline.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from roofline.attention.triton.backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, torch, cpu, triton")
