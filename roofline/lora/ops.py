"""The grouped LoRA shrink/expand over a step's adapter groups, and which implementation runs.

Every implementation computes, for each (slot, rank r, rows [start, end)) group and each slice s the slot's
adapter has weights for:

    t = x[start:end] a[slot, s, :r]^T          (shrink: [rows, r])
    y[start:end, slice s] += t bt[slot, :r, slice s]   (expand)

  * `add_lora_torch`: torch ops per group and slice -- the reference, and the route on any device the
    others do not take.
  * `add_lora_native`: cpu/lora_kernels.c, one call per layer and step for every group (fp32 on the CPU,
    the native kernels loaded: --cpu-kernels).
  * `add_lora_triton`: the Triton shrink and expand kernels (lora/triton_ops.py) on CUDA.
"""

from __future__ import annotations

import ctypes

import torch

from roofline.cpu import ops as cpu_ops

_P, _I = ctypes.c_void_p, ctypes.c_int64
cpu_ops.declare("lora_shrink_expand_f32", [_P, _I, _P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _P, _P, _I, ctypes.c_int],
                ctypes.c_int)


def add_lora_torch(x: torch.Tensor, y: torch.Tensor, layer, groups) -> None:
    for slot, r, start, end in groups:
        xs = x[start:end]
        for s, (off, n) in enumerate(layer.slices):
            if not layer.slice_on[slot][s]:
                continue
            t = xs @ layer.a[slot, s, :r].t()  # shrink [rows, r]
            y[start:end, off:off + n].addmm_(t, layer.bt[slot, :r, off:off + n])  # expand


def native_takes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """fp32 CPU rows with unit column stride, and the native kernels loaded."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and y.dtype == torch.float32 and x.dim() == 2
            and x.stride(1) == 1 and y.stride(1) == 1 and cpu_ops.available())


def add_lora_native(x: torch.Tensor, y: torch.Tensor, layer, groups, lib=None) -> None:
    """lib: the kernels' library (default: the loaded build; tests pass another build)."""
    g = torch.tensor(groups, dtype=torch.int64)
    rc = (lib or cpu_ops.library()).lora_shrink_expand_f32(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1], y.shape[1], layer.a.data_ptr(),
        layer.bt.data_ptr(), len(layer.slices), layer.a.shape[2], layer.slice_off_t.data_ptr(),
        layer.slice_size_t.data_ptr(), layer.slice_on_t.data_ptr(), g.data_ptr(), len(groups),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lora_shrink_expand_f32 refused its arguments ({len(layer.slices)} slices, groups {groups})")


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def _triton():
    """lora/triton_ops, or None where Triton is not installed."""
    try:
        from roofline.lora import triton_ops
    except ImportError:
        return None
    return triton_ops


def add_lora(x: torch.Tensor, y: torch.Tensor, layer, groups) -> None:
    """y += the groups' LoRA deltas, by the fastest route this batch has."""
    if native_takes(x, y):
        add_lora_native(x, y, layer, groups)
        return
    kernels = _triton() if _on_cuda(x) and y.stride(1) == 1 else None
    if kernels is not None:
        kernels.add_lora(x, y, layer, groups)
    else:
        add_lora_torch(x, y, layer, groups)
