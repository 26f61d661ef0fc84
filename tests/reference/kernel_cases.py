"""The GGUF kernels checked through a stand-alone program (kernel_cases.c compiled with the kernel sources),
for builds this machine cannot load into Python: `python -m tests.reference.kernel_cases --cc
aarch64-linux-gnu-gcc --isa neon --run "qemu-aarch64 -L /usr/aarch64-linux-gnu"` checks the NEON build under
qemu (scripts/neon_checks.sh).  With the host compiler it checks a host build the same way (the test suite
runs it so, so the program and these checks stay in working order).

Each case: one format, rows x K blocks, M rows of activations, a thread count.  The checks are the test
suite's: the expansion is gguf's dequantization bit for bit; the projection is the fp32 matmul of those
values (float64 reference, fp32 tolerance); up to 8 rows each row is the one-row GEMV's bits; the fused
gate/up SiLU is the projection followed by silu_and_mul bit for bit; the q8 mode is the Q8_1 emulation;
the thread count changes no bit."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from roofline.cpu import ops as cpu_ops
from roofline.cpu.gguf_quant import ACT_Q8_FORMATS, FORMATS, interleave_rows
from tests.reference.quantized import q8_emulation, random_blocks

HARNESS = Path(__file__).with_name("kernel_cases.c")
ROWS = (38, 64)  # 38: two interleaved groups and six file-layout rows, gate/up halves of 19 (not fused); 64: fused
COLS = 512
ROW_COUNTS = (1, 5, 8, 9, 40, 100)


def build(cc: str, isa: str, out: Path) -> Path:
    """The harness and the kernel sources as one program, with ops.py's flags for `isa`."""
    flags = [*cpu_ops.BASE_FLAGS, *cpu_ops.ISA_BUILDS[isa][0]]
    cmd = [*shlex.split(cc), *flags, str(HARNESS), *map(str, cpu_ops.SOURCES), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True)
    return out


def run_case(program: Path, run: str, qtype: int, rows: int, m: int, threads: int, seed: int) -> dict:
    """One case through the program: its outputs by name, with the inputs they came from."""
    w = random_blocks(qtype, rows, COLS, seed=seed)
    x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(seed))
    blocks = w.data.numpy()
    payload = [np.array([qtype, rows, COLS, m, threads], dtype=np.int64).tobytes(), blocks.tobytes()]
    if qtype in ACT_Q8_FORMATS:
        payload.append(interleave_rows(blocks, qtype).tobytes())
    payload.append(x.numpy().astype(np.float32).tobytes())
    got = subprocess.run([*shlex.split(run), str(program)], input=b"".join(payload), capture_output=True, check=True)
    out = np.frombuffer(got.stdout, dtype=np.float32)
    names = [("dequantized", rows * COLS), ("linear", m * rows), ("one_by_one", m * rows)]
    if rows % 2 == 0:
        names += [("silu_fused", m * rows // 2), ("silu_after", m * rows // 2)]
    if qtype in ACT_Q8_FORMATS:
        names.append(("q8", m * rows))
    if out.size != sum(n for _, n in names):
        raise AssertionError(f"the program wrote {out.size} floats, expected {sum(n for _, n in names)}")
    res, at = {"w": w, "x": x}, 0
    for name, n in names:
        res[name] = torch.from_numpy(out[at:at + n].copy())
        at += n
    return res


def check_case(r: dict, qtype: int, rows: int, m: int) -> None:
    w, x = r["w"], r["x"]
    dense = w.dequantize()
    assert torch.equal(r["dequantized"].view(rows, COLS).view(torch.int32), dense.view(torch.int32)), "expansion"
    y = r["linear"].view(m, rows)
    want = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(y, want, atol=5e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    if m <= 8:
        assert torch.equal(y, r["one_by_one"].view(m, rows)), "rows routes: each row the one-row GEMV's bits"
    if rows % 2 == 0:
        assert torch.equal(r["silu_fused"], r["silu_after"]), "fused gate/up SiLU"
        d = rows // 2
        fused = F.silu(want[:, :d]) * want[:, d:]
        torch.testing.assert_close(r["silu_fused"].view(m, d), fused, atol=1e-4 * max(1.0, fused.abs().max().item()),
                                   rtol=1e-3)
    if qtype in ACT_Q8_FORMATS:
        torch.testing.assert_close(r["q8"].view(m, rows), q8_emulation(x, w), atol=2e-4, rtol=1e-5)


def check_build(program: Path, run: str = "", row_counts=ROW_COUNTS, formats=None) -> int:
    """Every case against the checks above, the thread counts 1 and 2 compared bit for bit; the cases run."""
    n = 0
    for qtype in formats or sorted(FORMATS):
        for rows in ROWS:
            for m in row_counts:
                seed = 1000 * qtype + 10 * rows + m
                one, two = (run_case(program, run, qtype, rows, m, t, seed) for t in (1, 2))
                check_case(two, qtype, rows, m)
                for name, v in one.items():
                    if isinstance(v, torch.Tensor) and name != "x":
                        assert torch.equal(v, two[name]), f"{name}: 1 and 2 threads differ"
                n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cc", default="cc", help="C compiler (a cross compiler for another machine's build)")
    p.add_argument("--isa", default="portable", choices=sorted(cpu_ops.ISA_BUILDS), help="which build's flags")
    p.add_argument("--run", default="", help="prefix that runs the program (an emulator: qemu-aarch64 -L ...)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        program = build(args.cc, args.isa, Path(tmp) / "kernel_cases")
        n = check_build(program, args.run)
    print(f"{args.isa} build ({args.cc}{', run by ' + args.run if args.run else ''}): {n} cases x 2 thread "
          f"counts passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
