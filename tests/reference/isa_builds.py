"""Running a check under each of this CPU's vector builds of the native kernels (AVX-512, AVX2)."""

from __future__ import annotations

from typing import Iterator

from roofline.cpu import ops as cpu_ops


def each_vector_build() -> Iterator[str]:
    """Load each vector build this CPU runs (not the portable C one) in turn and yield its name; the
    automatic choice is restored afterwards, whatever the check raised."""
    try:
        for isa in [isa for isa in cpu_ops.supported_isas() if isa != "portable"]:
            cpu_ops.select_isa(isa)
            assert cpu_ops.available() and cpu_ops.loaded_isa() == isa
            yield isa
    finally:
        cpu_ops.select_isa("auto")
