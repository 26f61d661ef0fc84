/* Native CPU kernels of DeepSeek Sparse Attention's lightning indexer (attention/sparse/dsa.py has the torch
 * reference), called through ctypes by roofline/cpu/dsa.py; compiled into the same library as cpu_kernels.c
 * (whose mla_sparse_decode_f32 runs the sparse latent attention itself, its scores in this file's dot_tile_f32).
 *
 *   dsa_index_scores_f32  the index scores of `rows` consecutive query tokens of one sequence against the
 *                         index keys of its context, read from the paged cache through its block table:
 *                           out[r, t] = sum_h w[r, h] * relu(scale * q[r, h] . k_t)   for t <= first + r
 *                                       -inf                                         past the row's position
 *                         The queries are transposed once (blocks of 16 heads); threads split the context in
 *                         chunks of 96 keys, each block of heads scoring a chunk six keys at a time (dot_tile:
 *                         the keys read in place through the block table, the next six prefetched).
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

/* The score tiles of the indexer and of cpu_kernels.c's MLA latent decode: the dot products of DOT_ROWS cache rows,
 * read in place (each row contiguous), with DOT_HEADS queries transposed into a block qt [dim x DOT_HEADS] (one
 * load of sixteen heads' values per dimension, each row's value broadcast: 6 x 16 sums in twelve registers, two
 * loads and six broadcasts per twelve FMAs).  The AVX-512 build runs the AVX2 code. */
#define DOT_ROWS 6  /* (dot_tile's AVX2 code names its six rows) */
#define DOT_HEADS 16

/* sums[j][h] = qt[., h] . rows[j] */
static inline void dot_tile(const float *qt, const float *const rows[DOT_ROWS], int64_t dim,
                            float sums[DOT_ROWS][DOT_HEADS]) {
#if defined(__AVX2__) && defined(__FMA__)
    /* named accumulators: GCC 12 keeps arrays of them on the stack, a store per FMA */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
           a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3], *r4 = rows[4], *r5 = rows[5];
    for (int64_t i = 0; i < dim; i++) {
        const __m256 q0 = _mm256_loadu_ps(qt + i * DOT_HEADS), q1 = _mm256_loadu_ps(qt + i * DOT_HEADS + 8);
        __m256 r;
#define DOT_ROW(j)                           \
        r = _mm256_broadcast_ss(r##j + i);   \
        a##j##0 = _mm256_fmadd_ps(r, q0, a##j##0); \
        a##j##1 = _mm256_fmadd_ps(r, q1, a##j##1);
        DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5)
#undef DOT_ROW
    }
    _mm256_storeu_ps(sums[0], a00), _mm256_storeu_ps(sums[0] + 8, a01);
    _mm256_storeu_ps(sums[1], a10), _mm256_storeu_ps(sums[1] + 8, a11);
    _mm256_storeu_ps(sums[2], a20), _mm256_storeu_ps(sums[2] + 8, a21);
    _mm256_storeu_ps(sums[3], a30), _mm256_storeu_ps(sums[3] + 8, a31);
    _mm256_storeu_ps(sums[4], a40), _mm256_storeu_ps(sums[4] + 8, a41);
    _mm256_storeu_ps(sums[5], a50), _mm256_storeu_ps(sums[5] + 8, a51);
#else
    for (int j = 0; j < DOT_ROWS; j++)
        for (int h = 0; h < DOT_HEADS; h++) sums[j][h] = 0.f;
    for (int64_t i = 0; i < dim; i++)
        for (int j = 0; j < DOT_ROWS; j++)
            for (int h = 0; h < DOT_HEADS; h++) sums[j][h] = fmaf(rows[j][i], qt[i * DOT_HEADS + h], sums[j][h]);
#endif
}

void dot_tile_f32(const float *qt, const float *const rows[DOT_ROWS], int64_t dim, float sums[DOT_ROWS][DOT_HEADS]);
void dot_tile_f32(const float *qt, const float *const rows[DOT_ROWS], int64_t dim, float sums[DOT_ROWS][DOT_HEADS]) {
    dot_tile(qt, rows, dim, sums);
}

/* q [heads x dim] -> qt: ceil(heads / 16) blocks [dim x 16] (zeros past the heads), dot_tile's queries */
void transpose_heads_f32(const float *q, int64_t heads, int64_t dim, float *qt);
void transpose_heads_f32(const float *q, int64_t heads, int64_t dim, float *qt) {
    const int64_t hp = (heads + DOT_HEADS - 1) / DOT_HEADS * DOT_HEADS;
    memset(qt, 0, (size_t)(hp * dim) * sizeof(float));
    for (int64_t h = 0; h < heads; h++) {
        float *col = qt + h / DOT_HEADS * dim * DOT_HEADS + h % DOT_HEADS;
        for (int64_t i = 0; i < dim; i++) col[i * DOT_HEADS] = q[h * dim + i];
    }
}

/* the n floats of a cache row on their way into L1: the score kernels take the next tile's rows in while they
 * score this one (a row the hardware prefetcher misses costs more than its FLOPs) */
void prefetch_row(const float *row, int64_t n);
void prefetch_row(const float *row, int64_t n) {
#if defined(__GNUC__)
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i, 0, 3);
#else
    (void)row, (void)n;
#endif
}

#define IDX_CHUNK 96  /* keys per work item of the index scores (16 tiles) */
_Static_assert(IDX_CHUNK % DOT_ROWS == 0, "a chunk holds whole tiles");
#define IDX_ROWS 32   /* query rows transposed per pass (bounds the transposed copy: 32 x 64 x 128 floats) */

/* total[j][l] += w[l] relu(scale sums[j][l]) + w[l + 8] relu(scale sums[j][l + 8]), l < 8: a tile's index
 * scores, summed over its sixteen heads into eight partial sums per key */
static inline void index_tile(const float *qt, const float *const k[DOT_ROWS], int64_t dim, float scale,
                              const float *w, float total[][8]) {
    float sums[DOT_ROWS][DOT_HEADS];
    dot_tile(qt, k, dim, sums);
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 s = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int j = 0; j < DOT_ROWS; j++) {  /* max(0, d): a NaN score stays NaN, as relu keeps it */
        const __m256 d0 = _mm256_max_ps(zero, _mm256_mul_ps(_mm256_loadu_ps(sums[j]), s));
        const __m256 d1 = _mm256_max_ps(zero, _mm256_mul_ps(_mm256_loadu_ps(sums[j] + 8), s));
        const __m256 t = _mm256_add_ps(_mm256_mul_ps(w0, d0), _mm256_mul_ps(w1, d1));
        _mm256_storeu_ps(total[j], _mm256_add_ps(_mm256_loadu_ps(total[j]), t));
    }
#else
    for (int j = 0; j < DOT_ROWS; j++)
        for (int l = 0; l < 8; l++) {
            const float d0 = sums[j][l] * scale, d1 = sums[j][l + 8] * scale;
            total[j][l] += w[l] * (d0 > 0.f ? d0 : 0.f) + w[l + 8] * (d1 > 0.f ? d1 : 0.f);
        }
#endif
}

void dsa_index_scores_f32(const float *q, const float *w, int64_t rows, int64_t heads, int64_t dim,
                          const float *cache, const int32_t *block_table, int64_t block_size, int64_t first, int64_t S,
                          float scale, float *out, int nthreads) {
    const int64_t hp = (heads + DOT_HEADS - 1) / DOT_HEADS * DOT_HEADS;
    const int64_t group = rows < IDX_ROWS ? rows : IDX_ROWS;
    const int64_t chunks = (S + IDX_CHUNK - 1) / IDX_CHUNK;
    /* each pass's query rows transposed, qt[r] [hp x dim] (transpose_heads_f32), and their weights wt[r] [hp]
     * (zeros past the heads) */
    float *qt = (float *)kernel_scratch((size_t)(group * hp * dim) * sizeof(float));
    float *wt = (float *)kernel_scratch((size_t)(group * hp) * sizeof(float));
    for (int64_t r0 = 0; r0 < rows; r0 += group) {
        const int64_t nr = rows - r0 < group ? rows - r0 : group;
        memset(wt, 0, (size_t)(nr * hp) * sizeof(float));
        for (int64_t r = 0; r < nr; r++) {
            transpose_heads_f32(q + (r0 + r) * heads * dim, heads, dim, qt + r * hp * dim);
            memcpy(wt + r * hp, w + (r0 + r) * heads, (size_t)heads * sizeof(float));
        }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (S * nr * heads > 32768)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t c0 = c * IDX_CHUNK, n = S - c0 < IDX_CHUNK ? S - c0 : IDX_CHUNK;
            const float *k[IDX_CHUNK];  /* the chunk's keys (past the context: the last one again) */
            for (int64_t j = 0; j < IDX_CHUNK; j++) {
                const int64_t t = c0 + (j < n ? j : n - 1);
                k[j] = cache + ((int64_t)block_table[t / block_size] * block_size + t % block_size) * dim;
            }
            for (int64_t r = 0; r < nr; r++) {
                const int64_t p = first + r0 + r;  /* the row's position: it scores keys t <= p */
                const int64_t m = p + 1 - c0 < n ? p + 1 - c0 : n;  /* the chunk's keys it scores */
                float *o = out + (r0 + r) * S + c0;
                for (int64_t j = m > 0 ? m : 0; j < n; j++) o[j] = -INFINITY;
                if (m <= 0) continue;
                float total[IDX_CHUNK][8];  /* per key: eight partial sums over the heads */
                memset(total, 0, (size_t)((m + DOT_ROWS - 1) / DOT_ROWS * DOT_ROWS) * sizeof(total[0]));
                for (int64_t h0 = 0; h0 < hp; h0 += DOT_HEADS) {  /* a block of heads' queries stays in L1 */
                    const float *qh = qt + (r * hp + h0) * dim, *wr = wt + r * hp + h0;
                    for (int64_t j0 = 0; j0 < m; j0 += DOT_ROWS) {
                        if (h0 == 0 && r == 0)  /* the first pass brings the next tile's keys in */
                            for (int64_t j = j0 + DOT_ROWS; j < j0 + 2 * DOT_ROWS && c0 + j < S; j++)
                                prefetch_row(j < n ? k[j] : cache + ((int64_t)block_table[(c0 + j) / block_size]
                                                                     * block_size + (c0 + j) % block_size) * dim, dim);
                        index_tile(qh, k + j0, dim, scale, wr, total + j0);
                    }
                }
                for (int64_t j = 0; j < m; j++) {
                    float sum = 0.f;
                    for (int l = 0; l < 8; l++) sum += total[j][l];
                    o[j] = sum;
                }
            }
        }
    }
    free(qt);
    free(wt);
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
