/* The grouped LoRA delta of one linear layer over a step's rows (roofline/lora/ops.py wraps it; its torch
 * code, add_lora_torch, is the reference), compiled into the same library as cpu_kernels.c.
 *
 *   lora_shrink_expand_f32   for each adapter group g = (slot, rank r, rows [start, end)), one pass:
 *                              shrink  t[i, s, k] = x[i, :] . a[slot, s, k, :]          k < r, slice s on
 *                              expand  y[i, off_s + j] += sum_k t[i, s, k] bt[slot, k, off_s + j]
 *                            a [slots, S, R, in] (each slice's lora_A), bt [slots, R, out] (lora_B transposed,
 *                            scaling folded in), slice_on [slots, S] (the slot's adapter has weights there).
 *
 * Threads split the shrink's dot products, then (after a barrier) the expand's (row, 64-column tile) pairs;
 * every output value is computed by one thread in a fixed order, so a row's result depends on nothing but
 * its own inputs (not on the batch, not on the thread count).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LORA_TILE 64     /* output columns per expand work item */
#define LORA_MAX_SLICES 8

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
static float lora_hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

static float lora_dot(const float *x, const float *w, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(w + i + 16), acc1);
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; i < n; i++) s += x[i] * w[i];
    return s;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), acc1);
    }
    float s = lora_hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += x[i] * w[i];
    return s;
#else
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += x[i] * w[i];
        s1 += x[i + 1] * w[i + 1];
        s2 += x[i + 2] * w[i + 2];
        s3 += x[i + 3] * w[i + 3];
    }
    float s = (s0 + s1) + (s2 + s3);
    for (; i < n; i++) s += x[i] * w[i];
    return s;
#endif
}

/* out[p * ldo + q] = x[p * ldx :] . w[q * ldw :] (length n) for p < rows (1 or 2) and q < 4: each x row is read
 * once for four ranks, each rank's row once for both x rows */
static void lora_dot4(const float *x, int64_t ldx, int rows, const float *w, int64_t ldw, int64_t n, float *out,
                      int64_t ldo) {
    int64_t i = 0;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if defined(__AVX512F__)
    __m512 acc[2][4];
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++) acc[p][q] = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = rows > 1 ? _mm512_loadu_ps(x + ldx + i) : x0;
        for (int q = 0; q < 4; q++) {
            const __m512 wv = _mm512_loadu_ps(w + q * ldw + i);
            acc[0][q] = _mm512_fmadd_ps(x0, wv, acc[0][q]);
            acc[1][q] = _mm512_fmadd_ps(x1, wv, acc[1][q]);
        }
    }
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++) s[p][q] = _mm512_reduce_add_ps(acc[p][q]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[2][4];
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++) acc[p][q] = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = rows > 1 ? _mm256_loadu_ps(x + ldx + i) : x0;
        for (int q = 0; q < 4; q++) {
            const __m256 wv = _mm256_loadu_ps(w + q * ldw + i);
            acc[0][q] = _mm256_fmadd_ps(x0, wv, acc[0][q]);
            acc[1][q] = _mm256_fmadd_ps(x1, wv, acc[1][q]);
        }
    }
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 4; q++) s[p][q] = lora_hsum256(acc[p][q]);
#endif
    for (int p = 0; p < rows; p++)
        for (int64_t j = i; j < n; j++)
            for (int q = 0; q < 4; q++) s[p][q] += x[p * ldx + j] * w[q * ldw + j];
    for (int p = 0; p < rows; p++)
        for (int q = 0; q < 4; q++) out[p * ldo + q] = s[p][q];
}

/* y[p * ldy + 0:n] += sum_k t[p * ldt + k] * b[k * ldb + 0:n], k < r, for p < rows (1 or 2): 32 columns of both rows
 * at a time stay in registers across k, each b load serving both rows */
static void lora_expand_tile(float *y, int64_t ldy, const float *t, int64_t ldt, int rows, const float *b, int64_t ldb,
                             int64_t r, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 32 <= n; j += 32) {
        __m512 acc[2][2];
        for (int p = 0; p < rows; p++)
            for (int c = 0; c < 2; c++) acc[p][c] = _mm512_loadu_ps(y + p * ldy + j + 16 * c);
        for (int64_t k = 0; k < r; k++) {
            const __m512 b0 = _mm512_loadu_ps(b + k * ldb + j), b1 = _mm512_loadu_ps(b + k * ldb + j + 16);
            for (int p = 0; p < rows; p++) {
                const __m512 tk = _mm512_set1_ps(t[p * ldt + k]);
                acc[p][0] = _mm512_fmadd_ps(tk, b0, acc[p][0]);
                acc[p][1] = _mm512_fmadd_ps(tk, b1, acc[p][1]);
            }
        }
        for (int p = 0; p < rows; p++)
            for (int c = 0; c < 2; c++) _mm512_storeu_ps(y + p * ldy + j + 16 * c, acc[p][c]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; j + 32 <= n; j += 32) {
        __m256 acc[2][4];
        for (int p = 0; p < rows; p++)
            for (int c = 0; c < 4; c++) acc[p][c] = _mm256_loadu_ps(y + p * ldy + j + 8 * c);
        for (int64_t k = 0; k < r; k++) {
            __m256 bv[4];
            for (int c = 0; c < 4; c++) bv[c] = _mm256_loadu_ps(b + k * ldb + j + 8 * c);
            for (int p = 0; p < rows; p++) {
                const __m256 tk = _mm256_set1_ps(t[p * ldt + k]);
                for (int c = 0; c < 4; c++) acc[p][c] = _mm256_fmadd_ps(tk, bv[c], acc[p][c]);
            }
        }
        for (int p = 0; p < rows; p++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(y + p * ldy + j + 8 * c, acc[p][c]);
    }
#endif
    for (int p = 0; p < rows; p++)
        for (int64_t jj = j; jj < n; jj++) {
            float acc = y[p * ldy + jj];
            for (int64_t k = 0; k < r; k++) acc += t[p * ldt + k] * b[k * ldb + jj];
            y[p * ldy + jj] = acc;
        }
}

/* groups: [ngroups x 4] int64 (slot, rank, start, end); returns 0, or -1 when an argument is out of range */
int lora_shrink_expand_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t in, int64_t out,
                           const float *a, const float *bt, int64_t nslices, int64_t max_rank,
                           const int64_t *slice_off, const int64_t *slice_size, const uint8_t *slice_on,
                           const int64_t *groups, int64_t ngroups, int nthreads) {
    if (nslices < 1 || nslices > LORA_MAX_SLICES) return -1;
    int64_t max_rows = 0, tiles_of[LORA_MAX_SLICES + 1];
    tiles_of[0] = 0;
    for (int64_t s = 0; s < nslices; s++) tiles_of[s + 1] = tiles_of[s] + (slice_size[s] + LORA_TILE - 1) / LORA_TILE;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t rank = groups[4 * g + 1], rows = groups[4 * g + 3] - groups[4 * g + 2];
        if (rank < 1 || rank > max_rank || rows < 0) return -1;
        if (rows > max_rows) max_rows = rows;
    }
    float *t = (float *)malloc((size_t)(max_rows * nslices * max_rank + 1) * sizeof(float));
    if (!t) return -1;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t slot = groups[4 * g], r = groups[4 * g + 1], start = groups[4 * g + 2];
        const int64_t rows = groups[4 * g + 3] - start;
        const uint8_t *on = slice_on + slot * nslices;
        const float *ga = a + slot * nslices * max_rank * in;
        const float *gb = bt + slot * max_rank * out;
        const int64_t quads = (r + 3) / 4, pairs = (rows + 1) / 2, dots = pairs * nslices * quads;
        const int64_t items = pairs * tiles_of[nslices];
#pragma omp parallel num_threads(nthreads) if (rows * r * (nslices * in + out) > 65536)
        {
#pragma omp for schedule(static)
            for (int64_t w = 0; w < dots; w++) {  /* shrink: two rows by four ranks (or the last few) at a time */
                const int64_t i = 2 * (w / (nslices * quads)), s = (w / quads) % nslices, k = 4 * (w % quads);
                const int nrows = i + 1 < rows ? 2 : 1;
                const int64_t ldt = nslices * max_rank;
                float *dst = t + (i * nslices + s) * max_rank + k;
                const float *xr = x + (start + i) * ldx, *wr = ga + (s * max_rank + k) * in;
                if (!on[s]) continue;
                if (k + 4 <= r) {
                    lora_dot4(xr, ldx, nrows, wr, in, in, dst, ldt);
                } else {
                    for (int p = 0; p < nrows; p++)
                        for (int64_t q = 0; k + q < r; q++) dst[p * ldt + q] = lora_dot(xr + p * ldx, wr + q * in, in);
                }
            }
#pragma omp for schedule(static)
            for (int64_t w = 0; w < items; w++) {  /* expand: two rows by one tile at a time */
                const int64_t i = 2 * (w / tiles_of[nslices]), tile = w % tiles_of[nslices];
                int64_t s = 0;
                while (tile >= tiles_of[s + 1]) s++;
                if (!on[s]) continue;
                const int64_t c0 = (tile - tiles_of[s]) * LORA_TILE, rest = slice_size[s] - c0;
                const int64_t col = slice_off[s] + c0;
                lora_expand_tile(y + (start + i) * ldy + col, ldy, t + (i * nslices + s) * max_rank, nslices * max_rank,
                                 i + 1 < rows ? 2 : 1, gb + col, out, r, rest < LORA_TILE ? rest : LORA_TILE);
            }
        }
    }
    free(t);
    return 0;
}
