/* Native CPU kernels of DeepSeek Sparse Attention's lightning indexer (attention/sparse/dsa.py has the torch
 * reference), called through ctypes by roofline/cpu/dsa.py; compiled into the same library as cpu_kernels.c
 * (whose mla_sparse_decode_f32 runs the sparse latent attention itself).
 *
 *   dsa_index_scores_f32  the index scores of `rows` consecutive query tokens of one sequence against the
 *                         index keys of its context, read from the paged cache through its block table:
 *                           out[r, t] = sum_h w[r, h] * relu(scale * q[r, h] . k_t)   for t <= first + r
 *                                       -inf                                         past the row's position
 *                         Threads split the context; each key row is read once for every query row and head.
 *   dsa_topk_f32          the positions of the k largest scores of each row (any order; among equal scores at
 *                         the boundary, an unspecified one), by quickselect over (score, position) pairs.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void *kernel_scratch(size_t bytes);  /* quant_kernels.c */

void dsa_index_scores_f32(const float *q, const float *w, int64_t rows, int64_t heads, int64_t dim,
                          const float *cache, const int32_t *block_table, int64_t block_size, int64_t first, int64_t S,
                          float scale, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (S * rows * heads > 32768)
    for (int64_t t = 0; t < S; t++) {
        const float *k = cache + ((int64_t)block_table[t / block_size] * block_size + t % block_size) * dim;
        for (int64_t r = 0; r < rows; r++) {
            if (t > first + r) {
                out[r * S + t] = -INFINITY;
                continue;
            }
            const float *qr = q + r * heads * dim;
            float total = 0.f;
            for (int64_t h = 0; h < heads; h++) {
                const float *qh = qr + h * dim;
                float d = 0.f;
#pragma omp simd reduction(+ : d)
                for (int64_t i = 0; i < dim; i++) d += qh[i] * k[i];
                d *= scale;
                if (d > 0.f) total += w[r * heads + h] * d;
            }
            out[r * S + t] = total;
        }
    }
}

typedef struct {
    float v;
    int64_t i;
} scored_t;

/* the k largest of a[0 .. n) moved to a[0 .. k) (Hoare partitions around a median of three) */
static void select_largest(scored_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        float x = a[lo].v, y = a[mid].v, z = a[hi].v;
        const float pivot = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i].v > pivot) i++;
            while (a[j].v < pivot) j--;
            if (i <= j) {
                const scored_t tmp = a[i];
                a[i] = a[j];
                a[j] = tmp;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

void dsa_topk_f32(const float *scores, int64_t rows, int64_t S, int64_t k, int64_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows > 1)
    {
        scored_t *buf = (scored_t *)kernel_scratch((size_t)S * sizeof(scored_t));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *s = scores + r * S;
            for (int64_t t = 0; t < S; t++) {
                buf[t].v = s[t];
                buf[t].i = t;
            }
            const int64_t kk = k < S ? k : S;
            select_largest(buf, S, kk);
            for (int64_t j = 0; j < kk; j++) out[r * k + j] = buf[j].i;
            for (int64_t j = kk; j < k; j++) out[r * k + j] = -1;
        }
        free(buf);
    }
}
