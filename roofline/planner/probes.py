"""The hardware probes: measured copy bandwidth and matmul FLOP/s of the running device, as a
HardwareSpec.  Used by `roofline plan --measure` (planner/measure.py) and, once per process at
start-up, by the engine's live roofline (metrics/step_roofline.py)."""

from __future__ import annotations

import statistics
import time
from typing import Optional

from roofline.planner.hardware import GiB, HardwareSpec, cpu_placeholder

_TORCH_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


def _sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cpu_time_clock(device: str) -> bool:
    """Whether to time with the calling thread's CPU time instead of the wall clock.

    On a CPU running torch with one thread, all the model's work happens on the calling thread, so
    its CPU time is the time the work took on the core, minus the time other processes held the
    core. On a shared machine that is what the roofline describes; the wall clock also counts the
    neighbours' time slices. With more threads (or on a GPU) the wall clock is used."""
    import torch

    return device == "cpu" and torch.get_num_threads() == 1


def _clock(device: str):
    return time.thread_time if cpu_time_clock(device) else time.perf_counter


def median_time(fn, device: str, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn on the probes' clock (cpu_time_clock)."""
    clock = _clock(device)
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        _sync(device)
        times.append(clock() - t0)
    return statistics.median(times)


def measure_bandwidth(device: str = "cpu", nbytes: Optional[int] = None, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s: a `nbytes` tensor copied into another, counting read + write
    (median of `repeats`)."""
    import torch

    if nbytes is None:
        nbytes = (1 * GiB) if device.startswith("cuda") else (256 << 20)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up / fault pages in
    _sync(device)
    t = median_time(lambda: dst.copy_(src), device, repeats)
    del src, dst
    return 2 * n * 4 / t


def measure_matmul_flops(device: str = "cpu", dtype: str = "float32", n: Optional[int] = None, repeats: int = 3) -> float:
    """Dense matmul FLOP/s for an n x n x n product in `dtype` (2 n^3 FLOPs each; median of repeats)."""
    import torch

    tdt = getattr(torch, dtype if dtype in ("float32", "bfloat16", "float16") else
                  {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    if n is None:
        n = 8192 if device.startswith("cuda") else 1536
    a = torch.randn(n, n, device=device).to(tdt)
    b = torch.randn(n, n, device=device).to(tdt)
    a @ b
    _sync(device)
    return 2.0 * n ** 3 / median_time(lambda: a @ b, device, repeats)


def last_level_cache_bytes() -> int:
    """The CPU's largest cache in bytes (sysfs; 32 MiB where it does not say)."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


def cold_median_time(fn, repeats: int) -> float:
    """Median seconds of 2 x repeats + 1 calls of fn on the CPU probes' clock, each after the caches are emptied
    (twice the last-level cache read, not timed): what fn touched before is gone from every level, as for a
    layer's call inside a model step, between two of which the other layers' weights and caches pass."""
    import torch

    buffer = torch.ones(2 * last_level_cache_bytes() // 4, dtype=torch.float32)
    clock = _clock("cpu")
    times = []
    for _ in range(2 * repeats + 1):
        buffer.sum()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _kernel_rate(fn, flops: float, repeats: int, sample_s: float = 0.05, cold: bool = False) -> float:
    """FLOP/s of a native CPU kernel call `fn` of `flops` FLOPs: the median of `repeats` samples, each as many
    calls as take about `sample_s` (a short call timed alone on a shared machine reads a whole time slice of
    a neighbour as its own).  cold: each sample is one call after the caches are emptied (not timed), and there
    are 2 x repeats + 1 of them -- as a model's attention kernel runs: between two calls of a layer's
    attention the step streams the other weights through every cache, so its cache rows come from memory,
    while back-to-back calls over a few MB find them in the last-level cache."""
    fn()  # warm up: pages faulted in, scratch allocated
    if cold:
        return flops / cold_median_time(fn, repeats)
    t0 = time.perf_counter()
    fn()
    calls = max(1, round(sample_s / max(time.perf_counter() - t0, 1e-6)))

    def sample():
        for _ in range(calls):
            fn()

    return flops * calls / median_time(sample, "cpu", repeats)


def _latent_cache(positions: int, heads: int):
    """A paged cache of `positions` random rows of DeepSeek's latent (512 + 64), its block table and an absorbed
    query of `heads` heads (the probes of the latent decode)."""
    import torch

    bs, width = 16, 576
    nblocks = positions // bs
    cache = torch.randn(1, nblocks, bs, 1, width) * 0.1
    return cache, torch.arange(nblocks, dtype=torch.int32)[None], torch.randn(1, heads, width)


def measure_attention_flops(positions: int = 4096, heads: int = 64, repeats: int = 5) -> float:
    """FLOP/s of the CPU's native latent-attention decode (cpu_ops.mla_decode: DeepSeek's 512 + 64 latent, one
    query over `positions` rows): the rate attention FLOPs run at, which dot-product kernels reach well below
    a large matmul's.  The planner's attention_time uses it beside the copy bandwidth.  Timed cold, as the
    sparse decode: warm, a 4096-row cache (9 MB) sits in the last-level cache across calls."""
    import torch

    from roofline.cpu import ops as cpu_ops

    if not cpu_ops.available():
        raise RuntimeError("native CPU kernels unavailable: no attention rate to measure")
    cache, tables, q = _latent_cache(positions, heads)
    lens = torch.tensor([positions])
    return _kernel_rate(lambda: cpu_ops.mla_decode(q, cache, tables, lens, 512, 0.1),
                        2.0 * positions * heads * (576 + 512), repeats, cold=True)


def measure_sparse_attention_flops(topk: int = 2048, positions: int = 16384, heads: int = 64,
                                   repeats: int = 5) -> float:
    """FLOP/s of DSA's sparse latent decode (cpu_dsa.sparse_mla_decode: one query over `topk` rows scattered
    over a `positions`-row cache, as the indexer's top-k leaves them): the rate of a DSA decode's attention
    FLOPs, whose rows are gathered through the block table one by one.  Timed cold (_kernel_rate), as in a
    model, whose other weights and caches pass through the caches between two calls of one layer."""
    import torch

    from roofline.cpu import dsa as cpu_dsa

    cache, tables, q = _latent_cache(positions, heads)
    kept = torch.randperm(positions, generator=torch.Generator().manual_seed(0))[:topk][None]
    return _kernel_rate(lambda: cpu_dsa.sparse_mla_decode(q, cache, tables, kept, 0.1, 512),
                        2.0 * topk * heads * (576 + 512), repeats, cold=True)


def measure_indexer_flops(positions: int = 16384, heads: int = 64, dim: int = 128, topk: int = 2048,
                          repeats: int = 5) -> float:
    """FLOP/s of DSA's native indexer as a decode runs it: its scores (cpu_dsa.index_scores: one query token,
    heads x dim, over `positions` paged keys) and their top-`topk` (cpu_dsa.topk_positions), per FLOP of the
    scores; timed cold, as the sparse decode."""
    import torch

    from roofline.cpu import dsa as cpu_dsa

    bs = 16
    nblocks = positions // bs
    cache = torch.randn(1, nblocks, bs, 1, dim)
    q, w = torch.randn(1, heads, dim), torch.randn(1, heads)
    table = torch.arange(nblocks, dtype=torch.int32)

    def indexer():
        cpu_dsa.topk_positions(cpu_dsa.index_scores(q, w, cache, table, positions - 1, positions, 0.1), topk)

    return _kernel_rate(indexer, 2.0 * positions * heads * dim, repeats, cold=True)


def measure_hardware(device: str = "cpu", dtype: str = "float32", name: Optional[str] = None) -> HardwareSpec:
    """A HardwareSpec for the running device with measured bandwidth and FLOP/s for `dtype`."""
    import torch

    bw = measure_bandwidth(device)
    fl = measure_matmul_flops(device, dtype)
    pdt = _TORCH_DTYPES.get(dtype, "fp32")
    compute = "bf16" if pdt == "fp16" else pdt
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        mem, label = props.total_memory, name or props.name
    else:
        mem, label = cpu_placeholder().memory_bytes, name or "cpu"
    return HardwareSpec(name=label, memory_bytes=int(mem), hbm_bandwidth=bw, peak_flops={compute: fl},
                        description=f"measured on {device} with {torch.get_num_threads()} torch threads"
                                    + (", thread CPU time" if cpu_time_clock(device) else ""), measured=True)


def measure_cpu_hardware(dtype: str = "float32") -> HardwareSpec:
    return measure_hardware("cpu", dtype)
