"""Block-FP8 GEMMs on an H100/H200: correctness against the torch reference, then speed.

    python3 scripts/gpu_fp8_bench.py [--quick | --sweep]

(a) For a few DeepSeek-V3 shapes, with weights quantised from random bf16 ones in [128, 128] blocks:
    the group quantisation byte for byte against its torch reference, w8a8 against the fp64 product of
    the dequantised activations and weight, weight-only against F.linear on the dequantised weight.
(b) For M in (1, 16, 64, 256, 2048) and DeepSeek-V3's projections, the median GPU time (each call
    replayed as a CUDA graph, L2 flushed before each replay) of the w8a8 GEMM (and, apart, the
    activation quantisation it needs), the weight-only GEMM on bf16 x, and torch's bf16 F.linear with
    a bf16 weight of the same shape; TFLOP/s, and the weight stream (N*K bytes for fp8, 2*N*K for
    bf16) in GB/s and as a share of the device's copy bandwidth (a 1 GiB torch copy, read + write).
w8a8 is compared with the fp64 product at 1e-3 of the output's range: Hopper's FP8 tensor cores add
the products of one K tile with a ~14-bit mantissa (the kernel promotes to fp32 every block_k = 128,
as DeepSeek does).  --sweep instead times a few tile configs on a few shapes (to tune _tiles).
Needs only torch and triton; runs in about 1 minute on an H100/H200.  Prints everything to stdout.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from roofline.model_executor.layers.quantization import fp8_triton as fp8  # noqa: E402

BLOCK = 128
SHAPES = [  # (N, K, what)
    (24576, 1536, "q_b"),
    (2112, 7168, "q_a+kv_a"),
    (7168, 16384, "o_proj"),
    (4096, 7168, "expert gate_up"),
    (7168, 2048, "expert down"),
    (36864, 7168, "dense gate_up"),
]
MS = (1, 16, 64, 256, 2048)


def quantize_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/block), ceil(K/block)]): DeepSeek's weight recipe."""
    n, k = w.shape
    nb, kb = triton.cdiv(n, block), triton.cdiv(k, block)
    padded = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    s = padded.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = (padded / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), s


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def check(dev: torch.device, fp8_dot: bool) -> bool:
    ok = True
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k in [(1, 2112, 7168), (5, 576, 1536), (64, 7168, 2048), (300, 24576, 1536), (33, 4096, 7168)]:
        try:
            w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            w_q, w_s = quantize_weight(w)
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            w_deq = fp8.dequantize_block_fp8(w_q, w_s, BLOCK, BLOCK)
            x_q, x_s = fp8.per_token_group_quant_fp8(x, BLOCK)
            r_q, r_s = fp8.per_token_group_quant_fp8_ref(x, BLOCK)
            q_same = torch.equal(x_q.view(torch.uint8), r_q.view(torch.uint8)) and torch.equal(x_s, r_s)
            ref_wo = F.linear(x.double(), w_deq.double())
            e_wo = rel_err(fp8.weight_only_block_fp8_matmul(x, w_q, w_s, BLOCK, BLOCK, torch.float32), ref_wo)
            e_wo16 = rel_err(fp8.weight_only_block_fp8_matmul(x, w_q, w_s, BLOCK, BLOCK), ref_wo)
            line = (f"  M={m:<4} N={n:<6} K={k:<6} quant bytes equal: {q_same}  "
                    f"weight-only fp32 out {e_wo:.1e}, bf16 out {e_wo16:.1e}")
            good = q_same and e_wo < 1e-5 and e_wo16 < 1e-2
            if fp8_dot:
                x_deq = x_q.double() * x_s.double().repeat_interleave(BLOCK, dim=1)[:, :k]
                e_w8 = rel_err(fp8.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, BLOCK, torch.float32),
                               F.linear(x_deq, w_deq.double()))
                e_lin = rel_err(fp8.block_fp8_linear(x, w_q, w_s, BLOCK, BLOCK, mode="w8a8"), ref_wo)
                line += f"  w8a8 vs dequantised x {e_w8:.1e}, linear vs bf16 x {e_lin:.1e}"
                good = good and e_w8 < 1e-3 and e_lin < 5e-2
            print(line + ("" if good else "  <-- FAIL"), flush=True)
            ok = ok and good
        except Exception as e:  # noqa: BLE001 -- report and go on to the timings
            print(f"  M={m} N={n} K={k}: {type(e).__name__}: {str(e).splitlines()[0][:300]}  <-- FAIL", flush=True)
            ok = False
    return ok


_FLUSH: list[torch.Tensor] = []


def bench(fn, reps: int = 25) -> float:
    """Median GPU microseconds of fn captured in a CUDA graph (so Python launch overhead is not timed,
    as in the engine's decode graphs), L2 flushed before each replay; nan where it fails."""
    try:
        if not _FLUSH:
            _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        fn()  # compile
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            _FLUSH[0].zero_()
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
        return times[reps // 2] * 1e3
    except Exception as e:  # noqa: BLE001 -- a kernel that cannot compile here is reported, not fatal
        print(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        return float("nan")


SWEEP_SHAPES = [(1, 2112, 7168), (1, 7168, 2048), (16, 36864, 7168), (64, 7168, 16384), (256, 24576, 1536),
                (2048, 36864, 7168), (2048, 7168, 2048)]
SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (16, 32, 4, 4), (16, 64, 4, 4), (16, 64, 4, 6), (16, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4),
    (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3),
]


def sweep(dev: torch.device) -> None:
    """Each tile config on a few shapes (w8a8, and weight-only for M <= 16), to tune _tiles."""
    g = torch.Generator(device=dev).manual_seed(2)
    default_tiles = fp8._tiles
    for m, n, k in SWEEP_SHAPES:
        w_q, w_s = quantize_weight(torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        x_q, x_s = fp8.per_token_group_quant_fp8(x, BLOCK)
        d = default_tiles(m, BLOCK)
        print(f"M={m} N={n} K={k}  (default BM={d['BLOCK_M']} BN={d['BLOCK_N']} "
              f"w={d['num_warps']} s={d['num_stages']})", flush=True)
        for bm, bn, warps, stages in SWEEP_CONFIGS:
            if (m <= 16) != (bm == 16) and not (m <= 64 and bm == 64):
                continue
            fp8._tiles = lambda _m, _bk, c=(bm, bn, warps, stages): dict(
                BLOCK_M=c[0], BLOCK_N=c[1], BLOCK_K=BLOCK, num_warps=c[2], num_stages=c[3])
            t_w8 = bench(lambda: fp8.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, BLOCK, torch.bfloat16))
            t_wo = bench(lambda: fp8.weight_only_block_fp8_matmul(x, w_q, w_s, BLOCK, BLOCK)) \
                if m <= 16 else float("nan")
            fp8._tiles = default_tiles
            print(f"  BM={bm:<3} BN={bn:<3} warps={warps} stages={stages}:  w8a8 {t_w8:7.1f} us "
                  f"({2 * m * n * k / t_w8 / 1e6:5.1f} TF/s, {n * k / t_w8 / 1e3:5.0f} GB/s)  "
                  f"weight-only {t_wo:7.1f} us", flush=True)


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device torch copy, bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median") * 1e-3
    return 2 * src.numel() / t / 1e9


def main() -> None:
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    if "--sweep" in sys.argv:
        sweep(dev)
        return
    cap = torch.cuda.get_device_capability(dev)
    fp8_dot = fp8.has_fp8_tensor_cores(dev)
    print(f"{torch.cuda.get_device_name(dev)} sm{cap[0]}{cap[1]}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    t0 = time.time()
    print("correctness:")
    ok = check(dev, fp8_dot)
    print(f"correctness {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f} s)\n", flush=True)

    copy_gbs = copy_bandwidth(dev)
    print(f"device copy (1 GiB, read + write): {copy_gbs:.0f} GB/s\n")

    hdr = f"{'M':>5} {'N':>6} {'K':>6} {'quant us':>8} | " + " | ".join(
        f"{name:>8} {'TF/s':>6} {'GB/s':>6} {'%bw':>4}" for name in ("w8a8 us", "wo us", "bf16 us"))
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator(device=dev).manual_seed(1)
    for n, k, what in SHAPES[:2] if quick else SHAPES:
        w_bf16 = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        w_q, w_s = quantize_weight(w_bf16)
        for m in MS[:3] if quick else MS:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            x_q, x_s = fp8.per_token_group_quant_fp8(x, BLOCK)
            t_q = bench(lambda: fp8.per_token_group_quant_fp8(x, BLOCK))
            t_w8 = bench(lambda: fp8.w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, BLOCK, BLOCK, torch.bfloat16)) \
                if fp8_dot else float("nan")
            t_wo = bench(lambda: fp8.weight_only_block_fp8_matmul(x, w_q, w_s, BLOCK, BLOCK))
            t_bf = bench(lambda: F.linear(x, w_bf16))
            flop = 2 * m * n * k
            cols = []
            for t, wbytes in ((t_w8, n * k), (t_wo, n * k), (t_bf, 2 * n * k)):
                gbs = wbytes / (t * 1e-6) / 1e9
                cols.append(f"{t:8.1f} {flop / (t * 1e-6) / 1e12:6.1f} {gbs:6.0f} {100 * gbs / copy_gbs:3.0f}%")
            print(f"{m:5d} {n:6d} {k:6d} {t_q:8.1f} | " + " | ".join(cols) + f"   {what if m == MS[0] else ''}",
                  flush=True)
    print(f"\n(GPU times in us, median of CUDA-graph replays; %bw = weight GB/s / device copy GB/s)  "
          f"total {time.time() - t0:.0f} s")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
