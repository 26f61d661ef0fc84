/* Native CPU kernels of DeepSeek Sparse Attention's lightning indexer (attention/sparse/dsa.py has the torch
 * reference), called through ctypes by roofline/cpu/dsa.py; compiled into the same library as cpu_kernels.c
 * (whose mla_sparse_decode_f32 runs the sparse latent attention itself).
 *
 *   dsa_index_scores_f32  the index scores of `rows` consecutive query tokens of one sequence against the
 *                         index keys of its context, read from the paged cache through its block table:
 *                           out[r, t] = sum_h w[r, h] * relu(scale * q[r, h] . k_t)   for t <= first + r
 *                                       -inf                                         past the row's position
 *                         Threads split the context in tiles of 16 keys, transposed once into L1 and scored
 *                         four heads at a time (4 x 16 sums in registers) for every query row.
 *   dsa_topk_f32          the positions of the k largest scores of each row (any order; among equal scores at
 *                         the boundary, an unspecified one), by quickselect over (score, position) pairs.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void *kernel_scratch(size_t bytes);  /* quant_kernels.c */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define KEY_TILE 16  /* keys scored together: their transposed rows [dim x 16] stay in L1 */
#define HEAD_TILE 4  /* heads per pass over them: 4 x 16 running sums in registers */

/* sums[h][j] = q_h . k_j for HEAD_TILE heads (from q, rows `dim` apart) and the tile's 16 keys kt [dim x 16];
 * cpu_kernels.c's MLA latent decode scores its latent rows with it too */
void score_tile_f32(const float *q, int64_t dim, const float *kt, float sums[HEAD_TILE][KEY_TILE]);
void score_tile_f32(const float *q, int64_t dim, const float *kt, float sums[HEAD_TILE][KEY_TILE]) {
#if defined(__AVX512F__)
    __m512 acc[HEAD_TILE];
    for (int h = 0; h < HEAD_TILE; h++) acc[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i++) {
        const __m512 k = _mm512_loadu_ps(kt + i * KEY_TILE);
        for (int h = 0; h < HEAD_TILE; h++) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * dim + i]), k, acc[h]);
    }
    for (int h = 0; h < HEAD_TILE; h++) _mm512_storeu_ps(sums[h], acc[h]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[HEAD_TILE], hi[HEAD_TILE];
    for (int h = 0; h < HEAD_TILE; h++) lo[h] = hi[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i++) {
        const __m256 k0 = _mm256_loadu_ps(kt + i * KEY_TILE), k1 = _mm256_loadu_ps(kt + i * KEY_TILE + 8);
        for (int h = 0; h < HEAD_TILE; h++) {
            const __m256 qv = _mm256_set1_ps(q[h * dim + i]);
            lo[h] = _mm256_fmadd_ps(qv, k0, lo[h]);
            hi[h] = _mm256_fmadd_ps(qv, k1, hi[h]);
        }
    }
    for (int h = 0; h < HEAD_TILE; h++) {
        _mm256_storeu_ps(sums[h], lo[h]);
        _mm256_storeu_ps(sums[h] + 8, hi[h]);
    }
#else
    for (int h = 0; h < HEAD_TILE; h++)
        for (int j = 0; j < KEY_TILE; j++) sums[h][j] = 0.f;
    for (int64_t i = 0; i < dim; i++)
        for (int h = 0; h < HEAD_TILE; h++)
            for (int j = 0; j < KEY_TILE; j++) sums[h][j] = fmaf(q[h * dim + i], kt[i * KEY_TILE + j], sums[h][j]);
#endif
}

void dsa_index_scores_f32(const float *q, const float *w, int64_t rows, int64_t heads, int64_t dim,
                          const float *cache, const int32_t *block_table, int64_t block_size, int64_t first, int64_t S,
                          float scale, float *out, int nthreads) {
    const int64_t tiles = (S + KEY_TILE - 1) / KEY_TILE;
#pragma omp parallel num_threads(nthreads) if (S * rows * heads > 32768)
    {
        float *kt = (float *)kernel_scratch((size_t)(dim * KEY_TILE) * sizeof(float));
        float *qpad = (float *)kernel_scratch((size_t)(HEAD_TILE * dim) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t t0 = tile * KEY_TILE, nt = S - t0 < KEY_TILE ? S - t0 : KEY_TILE;
            for (int64_t j = 0; j < KEY_TILE; j++) {  /* the tile's keys, transposed (zeros past the context) */
                const int64_t t = t0 + j;
                const float *k = j < nt ? cache + ((int64_t)block_table[t / block_size] * block_size + t % block_size) * dim : 0;
                for (int64_t i = 0; i < dim; i++) kt[i * KEY_TILE + j] = k ? k[i] : 0.f;
            }
            for (int64_t r = 0; r < rows; r++) {
                float total[KEY_TILE] = {0};
                const float *qr = q + r * heads * dim;
                for (int64_t h0 = 0; h0 < heads; h0 += HEAD_TILE) {
                    const int64_t nh = heads - h0 < HEAD_TILE ? heads - h0 : HEAD_TILE;
                    const float *qh = qr + h0 * dim;
                    if (nh < HEAD_TILE) {  /* a last partial group of heads: padded with zero queries */
                        memset(qpad, 0, (size_t)(HEAD_TILE * dim) * sizeof(float));
                        memcpy(qpad, qh, (size_t)(nh * dim) * sizeof(float));
                        qh = qpad;
                    }
                    float sums[HEAD_TILE][KEY_TILE];
                    score_tile_f32(qh, dim, kt, sums);
                    for (int64_t h = 0; h < nh; h++) {
                        const float wh = w[r * heads + h0 + h];
                        for (int j = 0; j < KEY_TILE; j++) {
                            const float d = sums[h][j] * scale;
                            if (d > 0.f) total[j] += wh * d;
                        }
                    }
                }
                for (int64_t j = 0; j < nt; j++) out[r * S + t0 + j] = t0 + j > first + r ? -INFINITY : total[j];
            }
        }
        free(kt);
        free(qpad);
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
