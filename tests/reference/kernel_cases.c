/* The GGUF kernels on one case read from stdin, for builds this machine cannot load into Python: the
 * NEON build of roofline/cpu's kernels, cross-compiled and run under qemu-aarch64 (scripts/neon_checks.sh,
 * which compiles this file together with the kernel sources and checks the results in Python).
 *
 * stdin:  int64 qt, rows, K, M, nthreads; the file-layout blocks [rows x row_bytes]; for Q4_0/Q4_1/Q8_0 the
 *         same blocks in the q8 mode's interleaved layout; x [M x K] fp32.
 * stdout: fp32, in order:
 *         quant_dequantize_f32                        [rows x K]
 *         quant_linear_f32 over all M rows            [M x rows]
 *         quant_linear_f32 one row at a time          [M x rows]
 *         quant_linear_silu_mul_f32 (rows even)       [M x rows/2]
 *         silu_and_mul_f32 of the projection (rows even)  [M x rows/2]
 *         quant_linear_f32 with QT_ACT_Q8 (Q4_0/Q4_1/Q8_0)  [M x rows] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int64_t quant_block_elems(int qt);
int64_t quant_block_bytes(int qt);
void quant_dequantize_f32(int qt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t K, float *out,
                          int nthreads);
void quant_linear_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                      float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads);
void quant_linear_silu_mul_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, float *c,
                               int64_t ldc, int64_t M, int64_t K, int64_t d, int nthreads);
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads);

static void *take(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, stdin) != bytes) {
        fprintf(stderr, "kernel_cases: short input\n");
        exit(2);
    }
    return p;
}

static void put(const float *v, int64_t n) {
    if (fwrite(v, sizeof(float), (size_t)n, stdout) != (size_t)n) exit(3);
}

int main(void) {
    const int64_t *h = take(5 * sizeof(int64_t));
    const int qt = (int)h[0];
    const int64_t rows = h[1], K = h[2], M = h[3];
    const int threads = (int)h[4];
    const int64_t row_bytes = K / quant_block_elems(qt) * quant_block_bytes(qt);
    const int act_q8 = qt == 2 || qt == 3 || qt == 8;
    const uint8_t *w = take((size_t)(rows * row_bytes));
    const uint8_t *wq8 = act_q8 ? take((size_t)(rows * row_bytes)) : 0;
    const float *x = take((size_t)(M * K) * sizeof(float));
    float *deq = malloc((size_t)(rows * K) * sizeof(float));
    float *y = malloc((size_t)(M * rows) * sizeof(float)), *y1 = malloc((size_t)(M * rows) * sizeof(float));
    quant_dequantize_f32(qt, w, row_bytes, rows, K, deq, threads);
    put(deq, rows * K);
    quant_linear_f32(qt, x, K, w, row_bytes, 0, y, rows, M, K, rows, threads);
    put(y, M * rows);
    for (int64_t m = 0; m < M; m++) quant_linear_f32(qt, x + m * K, K, w, row_bytes, 0, y1 + m * rows, rows, 1, K, rows, threads);
    put(y1, M * rows);
    if (rows % 2 == 0) {
        const int64_t d = rows / 2;
        quant_linear_silu_mul_f32(qt, x, K, w, row_bytes, y1, d, M, K, d, threads);
        put(y1, M * d);
        silu_and_mul_f32(y, y1, M, d, threads);
        put(y1, M * d);
    }
    if (act_q8) {
        quant_linear_f32(qt | 0x80, x, K, wq8, row_bytes, 0, y, rows, M, K, rows, threads);
        put(y, M * rows);
    }
    return 0;
}
