"""The CPU worker's allocator setting: activation buffers up to 32 MiB come from the heap, which keeps
them for reuse, instead of fresh mappings that are returned on free and faulted in again, zeroed."""

import os
import subprocess
import sys

import pytest

# Where a fresh 20 MiB tensor lands: inside glibc's [heap] (brk) region, or in a mapping of its own.
PROBE = """
import sys, torch
from roofline.worker.worker import REUSE_FREED_MEMORY, reuse_freed_cpu_memory
REUSE_FREED_MEMORY.set(False if sys.argv[2:] == ["switched-off"] else None)
took = reuse_freed_cpu_memory() if sys.argv[1] == "on" else False
t = torch.empty(5 << 20, dtype=torch.float32)
p = t.data_ptr()
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        in_heap = lo <= p < hi
        break
else:
    in_heap = False
print(took, in_heap)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt, /proc/self/maps")


def _probe(mode: str, *extra: str):
    out = subprocess.run([sys.executable, "-c", PROBE, mode, *extra], capture_output=True, text=True, check=True,
                         env=dict(os.environ))
    took, in_heap = out.stdout.split()
    return took == "True", in_heap == "True"


def test_large_buffers_come_from_the_heap():
    assert _probe("on") == (True, True)
    assert _probe("off") == (False, False)  # glibc's default: a mapping of its own


def test_switch_turns_it_off():
    """--no-cpu-reuse-freed-memory (EngineConfig.cpu_reuse_freed_memory, applied by the worker)."""
    assert _probe("on", "switched-off") == (False, False)
