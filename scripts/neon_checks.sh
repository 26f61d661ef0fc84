#!/usr/bin/env bash
# The NEON (aarch64) build of the native CPU kernels, checked on an x86 machine: cross-compiled with ops.py's
# flags for that build and run under qemu-user, through tests/reference/kernel_cases (every GGUF format:
# the expansion is gguf's dequantization bit for bit, the projections match the fp32 matmul, the rows
# routes, the fused gate/up SiLU, the q8 mode, 1 and 2 threads alike).  Needs the Debian/Ubuntu packages
# gcc-aarch64-linux-gnu and qemu-user (a development check: the engine itself needs neither).  On an aarch64
# machine the test suite loads the NEON build itself.  Usage: bash scripts/neon_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CC_AARCH64=${CC_AARCH64:-aarch64-linux-gnu-gcc}
SYSROOT=${SYSROOT:-/usr/aarch64-linux-gnu}
for tool in "$CC_AARCH64" qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "neon_checks: $tool not found (apt-get install gcc-aarch64-linux-gnu qemu-user)"; exit 2; }
done
PY=${PY:-.venv/bin/python}
"$PY" -m tests.reference.kernel_cases --cc "$CC_AARCH64" --isa neon --run "qemu-aarch64 -L $SYSROOT"
