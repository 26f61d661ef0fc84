/* Native CPU kernels over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), called
 * through ctypes by gguf_quant.py; compiled into the same library as cpu_kernels.c (cpu_ops.py), whose
 * packed GEMM and layer stack they share.
 *
 * A weight [N x K] stays in its file layout: row n is K / QK blocks of its format, `row_bytes` apart.
 * Every kernel expands a block in registers to exactly the values gguf's dequantization
 * (gguf.quants.dequantize) gives, then accumulates in fp32 -- the arithmetic of each format is
 * chosen so the expansion is bit-identical to numpy's:
 *   Q4_0  d * (q - 8)               d (fp16) times a 4-bit integer: exact in fp32
 *   Q4_1  d * q + m                 d * q is exact, so fma(d, q, m) rounds once, as numpy's d*q + m does
 *   Q8_0  d * q                     exact
 *   Q4_K  (d*sc) * q - (dmin*m)     d*sc, dmin*m and (d*sc) * q exact (11 + 6 + 4 bits): one rounding = fma
 *   Q5_K  the same with 5-bit q     exact products (22 bits): fma
 *   Q6_K  (d*sc) * (q - 32)         d*sc exact; the product with q may round: a plain multiply, as numpy
 * (fp16 -> fp32 conversions are exact.)  Built with -ffp-contract=off, so nothing else fuses.
 *
 *   quant_dequantize_f32  rows of blocks -> fp32 [rows x K] (the reference the tests compare with gguf)
 *   quant_linear_f32      C [M x N] = A [M x K] W^T (+ bias): one row (M == 1) by a threaded GEMV that
 *                         streams each weight row once (threads split the output rows; each row's sum
 *                         has one fixed order, whatever the thread count); more rows by expanding 16
 *                         weight rows at a time into one panel of cpu_kernels.c's packed GEMM and running
 *                         its register tiles over it -- a row's values are those of gemm_packed_f32 over
 *                         the dequantized weight, bit for bit, whatever M.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_AVX512 1
#endif
#elif defined(__F16C__)
#include <immintrin.h>
#endif

/* cpu_kernels.c (the same library) */
void gemm_packed_f32(const float *a, int64_t lda, const float *panels, const float *bias, float *c, int64_t ldc,
                     int64_t M, int64_t K, int64_t N, int nthreads);

/* ggml's type ids */
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 };

#define QPANEL 16  /* GEMM_NR of cpu_kernels.c: output columns per packed panel */
#define QMB 96     /* GEMM_MB: more rows than this expand the whole weight once instead of per panel */

static inline float half_to_float(const uint8_t *p) {
#ifdef __F16C__
    uint16_t hv;
    memcpy(&hv, p, sizeof hv);
    return _cvtsh_ss(hv);  /* exact, like the bit conversion below */
#endif
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf / nan */
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* elements and bytes per block; 0 for a type these kernels do not take */
int64_t quant_block_elems(int qt) {
    switch (qt) {
    case QT_Q4_0: case QT_Q4_1: case QT_Q8_0: return 32;
    case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: return 256;
    default: return 0;
    }
}

int64_t quant_block_bytes(int qt) {
    switch (qt) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    case QT_Q6_K: return 210;
    default: return 0;
    }
}

/* ---- one block -> its values (the portable expansion; the reference for every other path) ---- */

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (gguf's Q4_K.get_scale_min) */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

static void deq_block(int qt, const uint8_t *b, float *o) {
    switch (qt) {
    case QT_Q4_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 16; i++) {
            o[i] = d * (float)((b[2 + i] & 0x0f) - 8);
            o[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
        break;
    }
    case QT_Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int i = 0; i < 16; i++) {
            o[i] = d * (float)(b[4 + i] & 0x0f) + m;  /* d * q exact: the sum rounds once, as in numpy */
            o[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
        break;
    }
    case QT_Q8_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)b[2 + i];
        break;
    }
    case QT_Q4_K:
    case QT_Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *sc6 = b + 4, *qh = b + 16, *qs = b + (qt == QT_Q5_K ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k_scale_min(sc6, j, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            for (int i = 0; i < 32; i++) {
                int v = (q[i] >> shift) & 0x0f;
                if (qt == QT_Q5_K) v |= ((qh[i] >> j) & 1) << 4;
                o[j * 32 + i] = ds * (float)v - dm;
            }
        }
        break;
    }
    case QT_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int g = 0; g < 8; g++) {  /* 8 groups of 32 values, as gguf's reshapes order them */
            const int half = g / 4, lshift = ((g / 2) & 1) * 4, i0 = (g & 1) * 32, hshift = (g & 3) * 2;
            for (int t = 0; t < 32; t++) {
                const int lo = (ql[half * 64 + i0 + t] >> lshift) & 0x0f;
                const int hi = (qh[half * 32 + t] >> hshift) & 0x03;
                const int e = g * 32 + t;
                const float ds = d * (float)sc[e / 16];
                o[e] = ds * (float)((lo | (hi << 4)) - 32);
            }
        }
        break;
    }
    }
}

static void deq_row(int qt, const uint8_t *row, int64_t K, float *out) {
    const int64_t qk = quant_block_elems(qt), bb = quant_block_bytes(qt);
    for (int64_t b = 0; b < K / qk; b++) deq_block(qt, row + b * bb, out + b * qk);
}

void quant_dequantize_f32(int qt, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t K, float *out,
                          int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * K > 65536)
    for (int64_t r = 0; r < rows; r++) deq_row(qt, w + r * row_bytes, K, out + r * K);
}

/* ---- GEMV: one row of x times each weight row ------------------------------------------------ */

#ifdef QUANT_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* the 32 values of a 4-bit block: w = fma(d, q, m) (Q4_1; Q4_0 passes m = -8d: d*q - 8d = d*(q-8)
 * exactly, one rounding of an exact value) -- then four FMAs into the accumulators */
static inline void dot_nibbles(const uint8_t *qs, __m256 d, __m256 m, const float *x, __m256 *acc) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_fmadd_ps(d, u8x8_to_ps(lo), m), acc[0]);
    acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_fmadd_ps(d, u8x8_to_ps(_mm_srli_si128(lo, 8)), m), acc[1]);
    acc[2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_fmadd_ps(d, u8x8_to_ps(hi), m), acc[2]);
    acc[3] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_fmadd_ps(d, u8x8_to_ps(_mm_srli_si128(hi, 8)), m), acc[3]);
}
#endif

#ifdef QUANT_AVX512
/* AVX-512: 16 values a vector -- half the instructions of AVX2 for the same expansion */
static inline __m512 u8x16_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

static inline void dot_nibbles512(const uint8_t *qs, __m512 d, __m512 m, const float *x, __m512 *acc) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_fmadd_ps(d, u8x16_to_ps(lo), m), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_fmadd_ps(d, u8x16_to_ps(hi), m), acc[1]);
}

static float dot_row512(int qt, const uint8_t *row, const float *x, int64_t nb, int64_t bb) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const float *xb = x + b * 32;
        __m512 *a = acc + 2 * (b & 1);  /* two blocks in flight: four independent accumulator chains */
        const __m512 d = _mm512_set1_ps(half_to_float(blk));
        if (qt == QT_Q4_1) {
            dot_nibbles512(blk + 4, d, _mm512_set1_ps(half_to_float(blk + 2)), xb, a);
        } else if (qt == QT_Q4_0) {
            dot_nibbles512(blk + 2, d, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)), xb, a);
        } else {
            for (int g = 0; g < 2; g++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * g));
                const __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
                a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16 * g), w, a[g]);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#endif

/* x . (row n of W) for K values.  One fixed order per format and build (the thread count never changes it). */
static float dot_row(int qt, const uint8_t *row, const float *x, int64_t K) {
    const int64_t qk = quant_block_elems(qt), bb = quant_block_bytes(qt), nb = K / qk;
#ifdef QUANT_AVX512
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) return dot_row512(qt, row, x, nb, bb);
#endif
#ifdef QUANT_AVX2
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            const float *xb = x + b * 32;
            if (b + 4 < nb) _mm_prefetch((const char *)(blk + 4 * bb), _MM_HINT_T0);
            const __m256 d = _mm256_set1_ps(half_to_float(blk));
            if (qt == QT_Q4_1) {
                dot_nibbles(blk + 4, d, _mm256_set1_ps(half_to_float(blk + 2)), xb, acc);
            } else if (qt == QT_Q4_0) {
                dot_nibbles(blk + 2, d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)), xb, acc);
            } else {
                for (int g = 0; g < 4; g++) {
                    const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * g));
                    const __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * g), w, acc[g]);
                }
            }
        }
        return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    }
#endif
    float vals[256];
    float s = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        deq_block(qt, row + b * bb, vals);
        const float *xb = x + b * qk;
        float p = 0.f;
#pragma omp simd reduction(+ : p)
        for (int64_t i = 0; i < qk; i++) p += xb[i] * vals[i];
        s += p;
    }
    return s;
}

static void quant_gemv(int qt, const float *x, const uint8_t *w, int64_t row_bytes, const float *bias, float *y,
                       int64_t K, int64_t N, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
    for (int64_t n = 0; n < N; n++) {
        const float s = dot_row(qt, w + n * row_bytes, x, K);
        y[n] = bias ? s + bias[n] : s;
    }
}

/* ---- more rows: weight rows expanded into packed panels ------------------------------------- */

/* rows n0 .. n0+nn of W expanded into one panel [K x 16] (zero past nn), the layout of pack_panels_f32;
 * rowbuf holds K floats */
static void expand_panel(int qt, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nn, int64_t K,
                         float *panel, float *rowbuf) {
    for (int64_t j = 0; j < QPANEL; j++) {
        if (j < nn) {
            deq_row(qt, w + (n0 + j) * row_bytes, K, rowbuf);
            for (int64_t k = 0; k < K; k++) panel[k * QPANEL + j] = rowbuf[k];
        } else {
            for (int64_t k = 0; k < K; k++) panel[k * QPANEL + j] = 0.f;
        }
    }
}

static void quant_gemm(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                       float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads) {
    const int64_t np = (N + QPANEL - 1) / QPANEL;
    if (M > QMB) {  /* a prefill chunk: expand the whole weight once, then the packed GEMM over all of it */
        float *panels = (float *)malloc((size_t)(np * K * QPANEL) * sizeof(float));
#pragma omp parallel num_threads(nthreads)
        {
            float *rowbuf = (float *)malloc((size_t)K * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t p = 0; p < np; p++) {
                const int64_t n0 = p * QPANEL;
                expand_panel(qt, w, row_bytes, n0, N - n0 < QPANEL ? N - n0 : QPANEL, K, panels + p * K * QPANEL,
                             rowbuf);
            }
            free(rowbuf);
        }
        gemm_packed_f32(a, lda, panels, bias, c, ldc, M, K, N, nthreads);
        free(panels);
        return;
    }
    /* a decode batch: each thread expands a panel into its own buffer (L2) and runs every row over it */
#pragma omp parallel num_threads(nthreads) if (np > 1)
    {
        float *panel = (float *)malloc((size_t)(K * QPANEL) * sizeof(float));
        float *rowbuf = (float *)malloc((size_t)K * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < np; p++) {
            const int64_t n0 = p * QPANEL, nn = N - n0 < QPANEL ? N - n0 : QPANEL;
            expand_panel(qt, w, row_bytes, n0, nn, K, panel, rowbuf);
            gemm_packed_f32(a, lda, panel, bias ? bias + n0 : 0, c + n0, ldc, M, K, nn, 1);
        }
        free(panel);
        free(rowbuf);
    }
}

/* C [M x N] = A [M x K] (row stride lda) W^T (+ bias), W [N x K] in blocks of format qt (rows row_bytes
 * apart); C's rows ldc apart.  K must be a multiple of the format's block (GGUF guarantees it). */
void quant_linear_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                      float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads) {
    if (M == 1) quant_gemv(qt, a, w, row_bytes, bias, c, K, N, nthreads);
    else quant_gemm(qt, a, lda, w, row_bytes, bias, c, ldc, M, K, N, nthreads);
}
