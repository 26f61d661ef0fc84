"""Accelerator presets for the capacity planner: memory, HBM bandwidth and dense peak FLOP/s.

Numbers are vendor datasheet values for *dense* math (no 2:4 sparsity), which is what a decode or
prefill GEMM can reach at best. Memory sizes are what the device reports as total memory
(nvidia-smi's "MiB" figure), not the marketing "GB". Every field can be overridden from the
command line (`--hbm-bandwidth-tbs`, `--peak-tflops`, `--memory-gib`).

The `cpu` entry is a placeholder: its bandwidth and FLOP/s are measured on the running machine
(`roofline.planner.probes.measure_cpu_hardware`) unless given explicitly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional

MiB = 1 << 20
GiB = 1 << 30
TB = 1e12  # bandwidth "TB/s" and "TFLOP/s" are decimal

# Size in bytes of one element of each storage dtype the planner understands.
DTYPE_BYTES: Dict[str, float] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
}

# Which peak-FLOP/s table entry a given weight dtype computes in.
COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16", "fp8": "fp8"}

_DTYPE_ALIASES = {
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "fp8_e5m2": "fp8",
}


def normalize_dtype(name: str) -> str:
    """Map torch / HF / vLLM spellings ("bfloat16", "float8_e4m3fn", ...) to bf16|fp16|fp8|fp32."""
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; expected one of bf16, fp16, fp8, fp32")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    memory_bytes: int  # total device memory
    hbm_bandwidth: float  # bytes/s
    peak_flops: Dict[str, Optional[float]] = field(default_factory=dict)  # compute dtype -> dense FLOP/s
    description: str = ""
    measured: bool = False  # bandwidth/FLOP/s were measured on this machine rather than taken from a datasheet

    def flops_for(self, weight_dtype: str) -> float:
        """Dense peak FLOP/s for GEMMs whose weights are stored in `weight_dtype`.

        fp8 weights use the fp8 tensor-core rate where the part has one, else the bf16 rate
        (weight-only fp8 on an A100 dequantizes and runs bf16 math)."""
        compute = COMPUTE_DTYPE[normalize_dtype(weight_dtype)]
        value = self.peak_flops.get(compute)
        if value is None and compute == "fp8":
            value = self.peak_flops.get("bf16")
        if value is None:
            # a measured CPU may only have the one dtype it was measured in
            known = [v for v in self.peak_flops.values() if v]
            if not known:
                raise ValueError(f"hardware {self.name!r} has no peak FLOP/s figure; pass --peak-tflops")
            value = known[0]
        return float(value)

    def with_overrides(
        self,
        hbm_bandwidth_tbs: Optional[float] = None,
        peak_tflops: Optional[float] = None,
        memory_gib: Optional[float] = None,
    ) -> "HardwareSpec":
        """A copy with user-supplied figures; `peak_tflops` replaces the rate of every dtype."""
        changes = {}
        if hbm_bandwidth_tbs is not None:
            changes["hbm_bandwidth"] = float(hbm_bandwidth_tbs) * TB
        if peak_tflops is not None:
            changes["peak_flops"] = {k: float(peak_tflops) * TB for k in ("fp32", "bf16", "fp8")}
        if memory_gib is not None:
            changes["memory_bytes"] = int(float(memory_gib) * GiB)
        return dataclasses.replace(self, **changes) if changes else self


GPU_PRESETS: Dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec(
        name="h100-sxm",
        memory_bytes=81559 * MiB,  # "80 GB" HBM3
        hbm_bandwidth=3.35 * TB,
        peak_flops={"fp32": 66.9 * TB, "bf16": 989.4 * TB, "fp8": 1978.9 * TB},
        description="NVIDIA H100 SXM5 80GB",
    ),
    "h200": HardwareSpec(
        name="h200",
        memory_bytes=143771 * MiB,  # "141 GB" HBM3e
        hbm_bandwidth=4.8 * TB,
        peak_flops={"fp32": 66.9 * TB, "bf16": 989.4 * TB, "fp8": 1978.9 * TB},
        description="NVIDIA H200 SXM 141GB",
    ),
    "a100-80gb": HardwareSpec(
        name="a100-80gb",
        memory_bytes=81920 * MiB,
        hbm_bandwidth=2.039 * TB,
        peak_flops={"fp32": 19.5 * TB, "bf16": 312.0 * TB, "fp8": None},  # no fp8 tensor cores
        description="NVIDIA A100 SXM4 80GB",
    ),
    "l4": HardwareSpec(
        name="l4",
        memory_bytes=23034 * MiB,  # "24 GB" GDDR6
        hbm_bandwidth=0.300 * TB,
        peak_flops={"fp32": 30.3 * TB, "bf16": 121.0 * TB, "fp8": 242.5 * TB},
        description="NVIDIA L4 24GB",
    ),
}

_ALIASES = {
    "h100": "h100-sxm", "h100sxm": "h100-sxm", "h100-sxm5": "h100-sxm",
    "h200-sxm": "h200",
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-sxm": "a100-80gb",
}


def _cpu_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def cpu_placeholder() -> HardwareSpec:
    """The `cpu` entry before measurement: host memory known, bandwidth/FLOP/s unknown (0)."""
    return HardwareSpec(name="cpu", memory_bytes=_cpu_memory_bytes(), hbm_bandwidth=0.0, peak_flops={},
                        description="host CPU (bandwidth and FLOP/s measured)")


def preset_names() -> list:
    return sorted(GPU_PRESETS) + ["cpu"]


def get_hardware(name: str) -> HardwareSpec:
    """Look up a preset by name (case-insensitive, a few aliases). `cpu` returns the unmeasured placeholder."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key == "cpu":
        return cpu_placeholder()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(preset_names())}")
    return GPU_PRESETS[key]
