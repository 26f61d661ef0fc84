/* Native CPU kernels over FP8 block weights (DeepSeek-V3's format), called through ctypes by fp8_quant.py;
 * compiled into the same library as cpu_kernels.c and quant_kernels.c (ops.py).
 *
 * A weight W [N x K] is e4m3 bytes, row n K bytes from row n-1 (one byte per weight, as the checkpoint stores
 * it), with fp32 scales S [ceil(N / sr) x ceil(K / bk)] (row stride ss): rows n of W share scale row n / sr
 * (sr = 128 for DeepSeek's [128, 128] blocks, 1 where the engine keeps a scale per row), columns k share
 * scale column k / bk (bk a multiple of 16; the last block of a row may be partial: K = 576 is 4.5 blocks).
 * A weight's value is  e4m3(w) * s  in fp32: the byte's exact value times its block's scale, rounded once --
 * what torch computes for  w.float() * s  (the reference dequantization, fp8_quant.dequantize_reference).
 *
 * The vector builds expand eight (AVX2) or sixteen (AVX-512) bytes at once without a table: an e4m3 byte
 * (sign, 4 exponent bits biased by 7, 3 mantissa bits) moved into an fp16's bit positions (sign-extended to
 * 16 bits and shifted left by 7, the bit below the sign cleared: sign at 15, exponent and mantissa at 13..7)
 * is the same number times 2^-8 (fp16's bias is 15: normal values and e4m3's
 * subnormals both land exactly), F16C converts that exactly, and the product with (256 s) -- exact, a power
 * of two -- is the same real number as e4m3(w) * s, so it rounds to the same fp32.  (0x7f / 0xff, e4m3's
 * NaN, never reach the kernels: the loader refuses weights holding them.)
 *
 *   fp8_dequantize_f32   W -> fp32 [N x K] (the kernels' own expansion; tests compare it with torch's)
 *   fp8_linear_f32       C [M x N] = A [M x K] W^T (+ bias).  Up to FP8_ROWS_MAX rows (decodes, a speculative
 *                        verify): a threaded GEMV that expands each weight chunk once for every row; each
 *                        (row, output) sum runs in one fixed order whatever M and the thread count, so a row's
 *                        values are the one-row GEMV's, bit for bit.  More rows: cpu_kernels.c's packed GEMM
 *                        over panels expanded on the fly (expanded_panels_gemm): a row's values are then
 *                        gemm_packed_f32's over the dequantized weight, bit for bit.
 *   fp8_linear_silu_mul_f32   silu(A W_g^T) * (A W_u^T) for W = [W_g; W_u]: fused in the panel route.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FP8_LANES 16
#else
#define FP8_LANES 8
#endif
#else
#define FP8_LANES 1
#endif

#define FP8_ROWS_MAX 8  /* rows the GEMV route takes */
#define FP8_PANEL 16    /* GEMM_NR of cpu_kernels.c */

/* cpu_kernels.c / quant_kernels.c (the same library) */
typedef void (*panel_expander_t)(const void *ctx, int64_t n0, int64_t nn, int64_t K, float *panel, float *rowbuf);
void expanded_panels_gemm(panel_expander_t expand, const void *ctx, const float *a, int64_t lda, const float *bias,
                          float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int silu, int nthreads);
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads);
void *kernel_scratch(size_t bytes);

typedef struct {
    const uint8_t *w;  /* [N x K] e4m3 */
    int64_t K;
    const float *s;    /* scales */
    int64_t ss, sr, bk;  /* scale row stride, weight rows per scale row, columns per scale block */
} fp8_weight_t;

/* e4m3's value of one byte, exactly */
static inline float e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (b & 0x80) ? -v : v;
}

static inline const float *scale_row(const fp8_weight_t *W, int64_t n) { return W->s + (n / W->sr) * W->ss; }

#if FP8_LANES == 16
/* 16 bytes -> e4m3(w) * s through fp16 bits (see the file's comment), with s256 = 256 s broadcast */
static inline __m512 fp8_chunk(const uint8_t *p, __m512 s256) {
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff));
    return _mm512_mul_ps(_mm512_cvtph_ps(bits), s256);
}
/* 16 bytes -> e4m3(w) * s through fp32 bits (see fp8_chunk32 below), with sbig = 2^120 s broadcast */
static inline __m512 fp8_chunk32(const uint8_t *p, __m512 sbig) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32((int)0x87f00000));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), sbig);
}
typedef __m512 vec_t;
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
static inline float vsum(__m512 v) {  /* fixed order: halves, then hsum8's */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif FP8_LANES == 8
static inline __m256 fp8_chunk(const uint8_t *p, __m256 s256) {
    const __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i bits = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xbfff));
    return _mm256_mul_ps(_mm256_cvtph_ps(bits), s256);
}
/* The GEMV's cheaper expansion: the byte sign-extended to 32 bits and shifted left by 20 puts its exponent and
 * mantissa at fp32's bits 26..20 and its sign at 31 (the mask clears the sign's copies at 30..27): an fp32 of
 * e4m3(w) * 2^-120 -- a normal number, or for e4m3's subnormals an fp32 denormal, both exact.  Its product with
 * (2^120 s), exact while |s| < 2^7, is again the real number e4m3(w) * s, rounded once: the same fp32 as above.
 * Two vector integer ops and the multiply instead of the F16C conversion's four, and the multiply and FMA
 * alone on the FP multiply ports.  It needs denormal inputs honoured (MXCSR's DAZ off; the GEMV checks) and
 * takes scale blocks with |s| < 2^7 (DeepSeek's are ~1e-4..1e-2; larger ones take fp8_chunk). */
static inline __m256 fp8_chunk32(const uint8_t *p, __m256 sbig) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87f00000));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), sbig);
}
typedef __m256 vec_t;
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
static inline float vsum(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#endif

/* whether this thread's MXCSR honours denormal inputs (DAZ, bit 6, off): fp8_chunk32's condition, read by each
 * GEMV tile on the thread that runs it (torch.set_flush_denormal and OpenMP's pool threads each have their own) */
static int denormals_honoured(void) {
#if FP8_LANES > 1
    return !(_mm_getcsr() & 0x0040);
#else
    return 0;
#endif
}

/* row n's K values into out (the one expansion every route uses) */
static void expand_row(const fp8_weight_t *W, int64_t n, float *out) {
    const uint8_t *w = W->w + n * W->K;
    const float *s = scale_row(W, n);
    const int64_t K = W->K;
    int64_t k = 0;
#if FP8_LANES > 1
    const int64_t kv = K / FP8_LANES * FP8_LANES;
    for (int64_t k0 = 0; k0 < kv; k0 += W->bk) {
        const int64_t k1 = k0 + W->bk < kv ? k0 + W->bk : kv;
        const vec_t sc = VSET1(s[k0 / W->bk] * 256.f);
        for (k = k0; k < k1; k += FP8_LANES) VSTORE(out + k, fp8_chunk(w + k, sc));
    }
    k = kv;
#endif
    for (; k < K; k++) out[k] = e4m3_value(w[k]) * s[k / W->bk];
}

void fp8_dequantize_f32(const uint8_t *w, int64_t N, int64_t K, const float *s, int64_t ss, int64_t sr, int64_t bk,
                        float *out, int nthreads) {
    const fp8_weight_t W = {w, K, s, ss, sr, bk};
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) expand_row(&W, n, out + n * K);
}

/* ---- the GEMV route: R output rows n .. n+R-1 times M input rows, each (row, output) pair one running sum over
 * the row's chunks of FP8_LANES (then the scalar tail), so its bits do not depend on R, M or the threads.
 * One function per (R, M) with arrays of exactly R x M accumulators, which the compiler keeps in registers. ---- */
#if FP8_LANES > 1
/* Each scale block's rows prefetch their lines `ahead` bytes on: 2 KiB, as quant_kernels.c's GEMVs do, in rows of
 * at least 4 KiB; in shorter rows 2 KiB would land in the tile's next row, read at the same time, so those take
 * the next tile's same place (a thread's tiles are consecutive).  The hardware prefetcher alone left a thread's
 * row streams waiting on memory: one row, 2 threads, the Zen 5, 7168 x 16384 26-30 -> 37-41 GB/s, and from a
 * cold cache 24576 x 1536 13-16 -> 31-48 GB/s. */
#define FP8_GEMV_PREFETCH 2048 /* (a prefetch past the matrix's end is harmless: it never faults) */
#define FP8_PREFETCH_BLOCK(RR)                                                                                \
    for (int r = 0; r < RR; r++)                                                                               \
        for (int64_t p = k0; p < k1; p += 64) _mm_prefetch((const char *)(w[r] + p + ahead), _MM_HINT_T0);
/* the chunks k0 .. k1 of one scale block, expanded by CHUNK with the rows' scales sc */
#define BLOCK_CHUNKS(RR, MM, CHUNK)                                                                           \
    for (k = k0; k < k1; k += FP8_LANES) {                                                                     \
        vec_t x[MM];                                                                                           \
        for (int m = 0; m < MM; m++) x[m] = VLOAD(a + m * lda + k);                                            \
        for (int r = 0; r < RR; r++) {                                                                         \
            const vec_t wv = CHUNK(w[r] + k, sc[r]);                                                           \
            for (int m = 0; m < MM; m++) acc[r][m] = VFMA(wv, x[m], acc[r][m]);                                \
        }                                                                                                      \
    }
#define VECTOR_PART(RR, MM)                                                                                   \
    const int64_t kv = K / FP8_LANES * FP8_LANES;                                                              \
    vec_t acc[RR][MM];                                                                                         \
    const int64_t ahead = K >= 2 * FP8_GEMV_PREFETCH ? FP8_GEMV_PREFETCH : RR * K;                             \
    const int honoured = denormals_honoured(); /* this thread's MXCSR: fp8_chunk32's condition */             \
    for (int r = 0; r < RR; r++)                                                                               \
        for (int m = 0; m < MM; m++) acc[r][m] = VZERO();                                                      \
    for (int64_t k0 = 0; k0 < kv; k0 += W->bk) { /* one scale block at a time */                              \
        const int64_t k1 = k0 + W->bk < kv ? k0 + W->bk : kv, kb = k0 / W->bk;                                 \
        vec_t sc[RR];                                                                                          \
        FP8_PREFETCH_BLOCK(RR)                                                                                 \
        int bits32 = honoured;                                                                                 \
        for (int r = 0; r < RR; r++) bits32 &= fabsf(s[r][kb]) < 0x1p7f;                                      \
        if (bits32) {                                                                                          \
            for (int r = 0; r < RR; r++) sc[r] = VSET1(s[r][kb] * 0x1p120f);                                   \
            BLOCK_CHUNKS(RR, MM, fp8_chunk32)                                                                  \
        } else {                                                                                               \
            for (int r = 0; r < RR; r++) sc[r] = VSET1(s[r][kb] * 256.f);                                      \
            BLOCK_CHUNKS(RR, MM, fp8_chunk)                                                                    \
        }                                                                                                      \
    }                                                                                                          \
    k = kv;                                                                                                    \
    for (int r = 0; r < RR; r++)                                                                               \
        for (int m = 0; m < MM; m++) sum[r][m] = vsum(acc[r][m]);
#else
#define VECTOR_PART(RR, MM)                                                                                   \
    for (int r = 0; r < RR; r++)                                                                               \
        for (int m = 0; m < MM; m++) sum[r][m] = 0.f;
#endif

#define DEFINE_TILE(RR, MM)                                                                                   \
    static void gemv_tile_##RR##_##MM(const fp8_weight_t *W, int64_t n, const float *a, int64_t lda,            \
                                      const float *bias, float *c, int64_t ldc) {                              \
        const int64_t K = W->K;                                                                                \
        const uint8_t *w[RR];                                                                                  \
        const float *s[RR];                                                                                    \
        for (int r = 0; r < RR; r++) {                                                                         \
            w[r] = W->w + (n + r) * K;                                                                         \
            s[r] = scale_row(W, n + r);                                                                        \
        }                                                                                                      \
        float sum[RR][MM];                                                                                     \
        int64_t k = 0;                                                                                         \
        VECTOR_PART(RR, MM)                                                                                    \
        for (; k < K; k++)                                                                                     \
            for (int r = 0; r < RR; r++) {                                                                     \
                const float wv = e4m3_value(w[r][k]) * s[r][k / W->bk];                                        \
                for (int m = 0; m < MM; m++) sum[r][m] += wv * a[m * lda + k];                                 \
            }                                                                                                  \
        for (int r = 0; r < RR; r++)                                                                           \
            for (int m = 0; m < MM; m++) c[m * ldc + n + r] = bias ? sum[r][m] + bias[n + r] : sum[r][m];       \
    }

DEFINE_TILE(4, 1)
DEFINE_TILE(4, 2)
DEFINE_TILE(2, 3)
DEFINE_TILE(2, 4)
DEFINE_TILE(1, 1)
DEFINE_TILE(1, 2)
DEFINE_TILE(1, 3)
DEFINE_TILE(1, 4)
DEFINE_TILE(1, 5)
DEFINE_TILE(1, 6)
DEFINE_TILE(1, 7)
DEFINE_TILE(1, 8)

/* output rows per tile for M input rows: R * M accumulators stay in registers */
static inline int tile_rows(int64_t M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

static void gemv_tile_any(const fp8_weight_t *W, int64_t n, int R, const float *a, int64_t lda, int M,
                          const float *bias, float *c, int64_t ldc) {
#define TILE(RR, MM) gemv_tile_##RR##_##MM(W, n, a, lda, bias, c, ldc)
    if (R == 4 && M == 1) TILE(4, 1);
    else if (R == 4 && M == 2) TILE(4, 2);
    else if (R == 2 && M == 3) TILE(2, 3);
    else if (R == 2 && M == 4) TILE(2, 4);
    else if (R == 1) {
        switch (M) {
        case 1: TILE(1, 1); break;
        case 2: TILE(1, 2); break;
        case 3: TILE(1, 3); break;
        case 4: TILE(1, 4); break;
        case 5: TILE(1, 5); break;
        case 6: TILE(1, 6); break;
        case 7: TILE(1, 7); break;
        default: TILE(1, 8); break;
        }
    } else {  /* another R (tail rows of a tile): one row at a time */
        for (int r = 0; r < R; r++) gemv_tile_any(W, n + r, 1, a, lda, M, bias, c, ldc);
    }
#undef TILE
}

static void fp8_gemv(const fp8_weight_t *W, const float *a, int64_t lda, const float *bias, float *c, int64_t ldc,
                     int64_t M, int64_t N, int nthreads) {
    const int R = tile_rows(M);
    const int64_t tiles = (N + R - 1) / R;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tiles * W->K > 65536)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = t * R;
        const int rr = N - n < R ? (int)(N - n) : R;
        gemv_tile_any(W, n, rr, a, lda, (int)M, bias, c, ldc);
    }
}

/* ---- the panel route: rows n0 .. n0+nn into one packed panel [K x 16] (zero past nn) ---- */
static void fp8_expand_panel(const void *ctx, int64_t n0, int64_t nn, int64_t K, float *panel, float *rowbuf) {
    const fp8_weight_t *W = (const fp8_weight_t *)ctx;
    for (int64_t j = 0; j < FP8_PANEL; j++) {
        if (j < nn) {
            expand_row(W, n0 + j, rowbuf);
            for (int64_t k = 0; k < K; k++) panel[k * FP8_PANEL + j] = rowbuf[k];
        } else {
            for (int64_t k = 0; k < K; k++) panel[k * FP8_PANEL + j] = 0.f;
        }
    }
}

int fp8_rows_route(int64_t M) { return M <= FP8_ROWS_MAX; }

void fp8_linear_f32(const float *a, int64_t lda, const uint8_t *w, int64_t K, const float *s, int64_t ss, int64_t sr,
                    int64_t bk, const float *bias, float *c, int64_t ldc, int64_t M, int64_t N, int nthreads) {
    const fp8_weight_t W = {w, K, s, ss, sr, bk};
    if (fp8_rows_route(M)) fp8_gemv(&W, a, lda, bias, c, ldc, M, N, nthreads);
    else expanded_panels_gemm(fp8_expand_panel, &W, a, lda, bias, c, ldc, M, K, N, 0, nthreads);
}

/* c [M x d] = silu(a W_g^T) * (a W_u^T), W = [W_g; W_u] (2d rows): the values of fp8_linear_f32 then
 * silu_and_mul_f32; the panel route fuses it where d is a multiple of 16 */
void fp8_linear_silu_mul_f32(const float *a, int64_t lda, const uint8_t *w, int64_t K, const float *s, int64_t ss,
                             int64_t sr, int64_t bk, float *c, int64_t ldc, int64_t M, int64_t d, int nthreads) {
    const fp8_weight_t W = {w, K, s, ss, sr, bk};
    if (!fp8_rows_route(M) && d % FP8_PANEL == 0) {
        expanded_panels_gemm(fp8_expand_panel, &W, a, lda, 0, c, ldc, M, K, d, 1, nthreads);
        return;
    }
    float *gate_up = (float *)kernel_scratch((size_t)(M * 2 * d) * sizeof(float));
    fp8_linear_f32(a, lda, w, K, s, ss, sr, bk, 0, gate_up, 2 * d, M, 2 * d, nthreads);
    if (ldc == d) {
        silu_and_mul_f32(gate_up, c, M, d, nthreads);
    } else {
        for (int64_t r = 0; r < M; r++) silu_and_mul_f32(gate_up + r * 2 * d, c + r * ldc, 1, d, 1);
    }
    free(gate_up);
}
