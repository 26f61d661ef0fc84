/* Native CPU kernels over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), called
 * by cpu_kernels.c's quant_linear_f32 (which gguf_quant.py calls through ctypes, and the layer stack
 * directly); compiled into the same library (ops.py).
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
 *   quant_rows_f32        C [M x N] = A [M x K] W^T (+ bias) for the row counts quant_rows_route takes: one
 *                         row by a threaded GEMV that streams each weight row once (threads split the output
 *                         rows; each row's sum has one fixed order, whatever the thread count); 2..8 rows
 *                         (a decode verifying speculative drafts, a few decodes) by the same GEMV decoding
 *                         each weight block once for a group of rows (up to six in the AVX2 build, taking a
 *                         block's groups of eight weights in passes; all of them in the AVX-512 build's
 *                         sixteen-lane registers, two weight rows at a time up to four rows) -- every row's
 *                         values are the one-row GEMV's, bit for bit, and the same in both builds; the
 *                         activation-quantized mode (QT_ACT_Q8) for any rows, over weights interleaved
 *                         sixteen rows at a time
 *   quant_expand_panel    16 weight rows expanded into one panel of cpu_kernels.c's packed GEMM, which
 *                         quant_linear_f32 there runs over more rows (its values: gemm_packed_f32's over the
 *                         dequantized weight, bit for bit, whatever M past the rows routes)
 * This file calls nothing of cpu_kernels.c: the GEMM driver lives there and calls these.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Scratch for the kernels of both files (cpu_kernels.c declares it): 64-byte (cache-line) aligned, the size
 * rounded up to match.  At malloc's 16-byte alignment every zmm load from the buffer splits two cache lines:
 * the tiles over expanded GGUF panels ran 27% slower than over torch's aligned packed weights (2048 rows,
 * 3072 x 576, Cascade Lake).  Freed with free(). */
void *kernel_scratch(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define QUANT_AVX512 1  /* the AVX-512 build: the GEMVs take a block's weights sixteen at a time */
#endif
#elif defined(__F16C__)
#include <immintrin.h>
#endif


/* ggml's type ids */
enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 };

#define QPANEL 16  /* GEMM_NR of cpu_kernels.c: output columns per packed panel */
#define QT_ACT_Q8 0x80  /* or-ed into the type: quantize the activations to 8 bits (see below) */

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

/* A 4-bit block's 16 bytes broadcast to both lanes as dwords D0..D3; lane l of group g takes
 * (D[l % 4] >> shift) & 15, shift = 8 * (l / 4) + 16 * (g % 2) + 4 * (g / 2): no byte shuffles, only
 * shifts and masks.  That nibble is value (g / 2) * 16 + 4 * (l % 4) + 2 * (g % 2) + l / 4 of the block,
 * so x is read permuted the same way (permute_x, once per GEMV).  w = fma(d, q, m) (Q4_1; Q4_0 passes
 * m = -8d: d*q - 8d = d*(q-8) exactly, one rounding of an exact value), then four FMAs. */
static inline __m256 nibble_group(__m256i q, __m256 d, __m256 m, int g) {
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8);
    const __m256i sg = _mm256_add_epi32(shift, _mm256_set1_epi32(16 * (g % 2) + 4 * (g / 2)));
    const __m256 v = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(q, sg), _mm256_set1_epi32(15)));
    return _mm256_fmadd_ps(d, v, m);
}

/* One 32-value block (Q4_0, Q4_1 or Q8_0) ready to give its weights eight at a time: group g's eight in
 * dot_row's order and roundings (4-bit formats: the permuted order above).  A caller takes a group's
 * weights just before it uses them, so only one group's are live beside the accumulators. */
typedef struct {
    __m256i q;        /* 4-bit formats: the block's 16 bytes in both lanes */
    __m256 d, m;      /* the scale, and the offset (Q4_1's m; Q4_0's -8d) */
    const int8_t *q8; /* Q8_0: the block's 32 values */
} block_decoder_t;

static inline block_decoder_t block_decoder(int qt, const uint8_t *blk) {
    block_decoder_t b;
    if (qt == QT_Q4_1) {  /* d and m converted together */
        int32_t dm;
        memcpy(&dm, blk, sizeof dm);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        b.d = _mm256_broadcastss_ps(f);
        b.m = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
        b.q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 4)));
        b.q8 = 0;
        return b;
    }
    b.d = _mm256_set1_ps(half_to_float(blk));
    if (qt == QT_Q4_0) {
        b.m = _mm256_mul_ps(b.d, _mm256_set1_ps(-8.0f));
        b.q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 2)));
        b.q8 = 0;
    } else {
        b.m = _mm256_setzero_ps();
        b.q = _mm256_setzero_si256();
        b.q8 = (const int8_t *)(blk + 2);
    }
    return b;
}

static inline __m256 block_group(int qt, const block_decoder_t *b, int g) {
    if (qt == QT_Q8_0)
        return _mm256_mul_ps(b->d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->q8 + 8 * g)))));
    return nibble_group(b->q, b->d, b->m, g);
}

#ifdef QUANT_AVX512
/* The AVX-512 build's decoder of one 32-value block, sixteen values at a time (block_pair).  A 4-bit
 * block has only 16 distinct values, table[q] = fma(d, q, m) (Q4_0: m = -8d), so a group is one shift
 * and one vpermps (which reads an index's low 4 bits: no mask, no conversion, no FMA per group) -- the
 * same values, bit for bit, as converting each nibble and taking the FMA.  The block's bytes are
 * broadcast straight from memory and d, m take one conversion: this build's shuffle port, not its FMA
 * units, bounded the GEMV before (12 shuffles a block, now 5). */
typedef struct {
    __m512 t;         /* 4-bit formats: the table; Q8_0: d in every lane */
    const uint8_t *q; /* the block's quant bytes */
} block_pairs_t;

/* fp16 -> fp32 of every 16-bit pattern (half_to_float's values), so a block's d and m are each one
 * broadcast straight from memory -- a load, where converting them took five vector uops of the ~12 a
 * two-row block's loop runs on the two AVX-512 ports */
static float half_table[65536];
__attribute__((constructor)) static void fill_half_table(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        const uint8_t b[2] = {(uint8_t)(h & 0xff), (uint8_t)(h >> 8)};
        half_table[h] = half_to_float(b);
    }
}
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_table[h];
}

#define GEMV_PREFETCH 2048  /* bytes ahead the AVX-512 GEMVs prefetch */

static inline block_pairs_t block_pairs(int qt, const uint8_t *blk) {
    block_pairs_t b;
    if (qt == QT_Q8_0) {
        b.t = _mm512_set1_ps(half_at(blk));
        b.q = blk + 2;
        return b;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = _mm512_set1_ps(half_at(blk));
    if (qt == QT_Q4_1) {
        b.t = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(half_at(blk + 2)));
        b.q = blk + 4;
        return b;
    }
    /* Q4_0: d (q - 8) with q - 8 exact, one rounding: fma(d, q, -8d)'s value */
    b.t = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    b.q = blk + 2;
    return b;
}

/* block_group's groups 2h and 2h+1 at once (lanes 0-7 and 8-15): the same values, lane for lane, so an
 * accumulator of sixteen lanes is two of block_group's eight-lane accumulators */
static inline __m512 block_pair(int qt, const block_pairs_t *b, int h) {
    if (qt == QT_Q8_0)
        return _mm512_mul_ps(b->t, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b->q + 16 * h)))));
    const __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)b->q));
    const __m512i shift = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24),
                                           _mm512_set1_epi32(4 * h));
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift), b->t);
}

/* the sum dot_row's four eight-lane accumulators give, from two sixteen-lane ones holding them in order */
static inline float hsum_pairs(__m512 a01, __m512 a23) {
    const __m256 a0 = _mm512_castps512_ps256(a01), a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01), 1));
    const __m256 a2 = _mm512_castps512_ps256(a23), a3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23), 1));
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* out[m] = x_m . row for MM rows (a constant after inlining: the 2 x MM accumulators stay in registers,
 * 16 of 32 at most) -- each row's products and order exactly those of the eight-lane code */
static inline __attribute__((always_inline)) void dot_rows_pairs(int qt, const uint8_t *row, int64_t bb,
                                                                 const float *x, int64_t ldx, const int MM,
                                                                 int64_t nb, float *out) {
    __m512 acc[8][2];
    for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    /* software-pipelined: block b+1's weights are decoded before block b's FMAs are issued, so the
     * decode's long dependency chain runs while the FMAs do (issued after them, it left the FMAs of
     * each block waiting on it) */
    block_pairs_t dec = block_pairs(qt, row);
    __m512 w0 = block_pair(qt, &dec, 0), w1 = block_pair(qt, &dec, 1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        _mm_prefetch((const char *)(blk + GEMV_PREFETCH), _MM_HINT_T0);
        __m512 n0 = w0, n1 = w1;
        if (b + 1 < nb) {
            dec = block_pairs(qt, blk + bb);
            n0 = block_pair(qt, &dec, 0);
            n1 = block_pair(qt, &dec, 1);
        }
        for (int m = 0; m < MM; m++) {
            acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + b * 32), w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + b * 32 + 16), w1, acc[m][1]);
        }
        w0 = n0;
        w1 = n1;
    }
    for (int m = 0; m < MM; m++) out[m] = hsum_pairs(acc[m][0], acc[m][1]);
}

/* dot_rows_pairs for two weight rows at once: out0[m] / out1[m] = x_m . row0 / row1, each sum the very chain
 * of dot_rows_pairs (so dot_row's, bit for bit), the activations loaded once for both rows.  One weight row's
 * sums are MM x 2 chains of dependent FMAs, one FMA per block each; the second row doubles the independent
 * chains (the one-row GEMV's reason for dot_row_pair, which keeps its own loop: this one at MM = 1 ran it
 * 2-13% slower on the Zen 5) -- 2 x MM x 2 accumulators, 16 of 32 registers at MM = 4; more rows go in two
 * calls, or one weight row at a time (dot_rows_two_any).  2 threads, 2-core Zen 5, 120 Q4_1 weights of 30
 * SmolLM2 layers from memory, best of 12: 2 rows 4.00-4.60 -> 3.20-3.71 ms, 4 rows 5.18-5.85 -> 4.29-4.84 ms (one
 * row 2.3-2.8 ms); with the 2 KiB prefetch now in dot_rows_pairs too, 5 rows 6.1-6.9 -> 5.1-6.1 ms, 6 rows
 * 7.3-8.4 -> 5.8-6.5 ms (it prefetched four blocks, ~100 bytes, ahead). */
static inline __attribute__((always_inline)) void dot_rows_two(int qt, const uint8_t *row0, const uint8_t *row1,
                                                               int64_t bb, const float *x, int64_t ldx,
                                                               const int MM, int64_t nb, float *out0,
                                                               float *out1) {
    __m512 acc[2][4][2];
    for (int m = 0; m < MM; m++) acc[0][m][0] = acc[0][m][1] = acc[1][m][0] = acc[1][m][1] = _mm512_setzero_ps();
    block_pairs_t d0 = block_pairs(qt, row0), d1 = block_pairs(qt, row1);
    __m512 w00 = block_pair(qt, &d0, 0), w01 = block_pair(qt, &d0, 1);
    __m512 w10 = block_pair(qt, &d1, 0), w11 = block_pair(qt, &d1, 1);
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch((const char *)(row0 + b * bb + GEMV_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(row1 + b * bb + GEMV_PREFETCH), _MM_HINT_T0);
        __m512 n00 = w00, n01 = w01, n10 = w10, n11 = w11;
        if (b + 1 < nb) {  /* block b+1 decoded before block b's FMAs (dot_rows_pairs' pipelining) */
            d0 = block_pairs(qt, row0 + (b + 1) * bb);
            d1 = block_pairs(qt, row1 + (b + 1) * bb);
            n00 = block_pair(qt, &d0, 0);
            n01 = block_pair(qt, &d0, 1);
            n10 = block_pair(qt, &d1, 0);
            n11 = block_pair(qt, &d1, 1);
        }
        for (int m = 0; m < MM; m++) {
            const __m512 x0 = _mm512_loadu_ps(x + m * ldx + b * 32), x1 = _mm512_loadu_ps(x + m * ldx + b * 32 + 16);
            acc[0][m][0] = _mm512_fmadd_ps(x0, w00, acc[0][m][0]);
            acc[0][m][1] = _mm512_fmadd_ps(x1, w01, acc[0][m][1]);
            acc[1][m][0] = _mm512_fmadd_ps(x0, w10, acc[1][m][0]);
            acc[1][m][1] = _mm512_fmadd_ps(x1, w11, acc[1][m][1]);
        }
        w00 = n00;
        w01 = n01;
        w10 = n10;
        w11 = n11;
    }
    for (int m = 0; m < MM; m++) {
        out0[m] = hsum_pairs(acc[0][m][0], acc[0][m][1]);
        out1[m] = hsum_pairs(acc[1][m][0], acc[1][m][1]);
    }
}

/* dot_rows_two for 1 <= M <= QROWS_MAX rows, more than four in two calls (the caller sends those here for
 * long rows only: 1 thread, hot, 5-8 rows over 128 x 4608 Q4_1 84-136 -> 62-83 us, where M rows of
 * activations leave L1; over 1024 x 576 and 384 x 1536 the one weight row of dot_rows_pairs is as fast or
 * faster, 60 against 64 us at 5 rows of 576) */
static void dot_rows_two_any(int qt, const uint8_t *row0, const uint8_t *row1, const float *x, int64_t ldx, int M,
                             int64_t K, float *out0, float *out1) {
    const int64_t bb = quant_block_bytes(qt), nb = K / 32;
#define TWO(QT, MM) dot_rows_two(QT, row0, row1, bb, x, ldx, MM, nb, out0, out1)
#define TWO2(QT, MM, F) dot_rows_two(QT, row0, row1, bb, x + (F) * ldx, ldx, MM, nb, out0 + (F), out1 + (F))
#define TWO_FORMAT(QT)                  \
    switch (M) {                        \
    case 1: TWO(QT, 1); return;         \
    case 2: TWO(QT, 2); return;         \
    case 3: TWO(QT, 3); return;         \
    case 4: TWO(QT, 4); return;         \
    case 5: TWO(QT, 3); TWO2(QT, 2, 3); return; \
    case 6: TWO(QT, 3); TWO2(QT, 3, 3); return; \
    case 7: TWO(QT, 4); TWO2(QT, 3, 4); return; \
    default: TWO(QT, 4); TWO2(QT, 4, 4); return; \
    }
    if (qt == QT_Q4_1) TWO_FORMAT(QT_Q4_1)  /* the format a constant too: no branch on it in the loop */
    if (qt == QT_Q4_0) TWO_FORMAT(QT_Q4_0)
    TWO_FORMAT(QT_Q8_0)
#undef TWO_FORMAT
#undef TWO2
#undef TWO
}
#endif

/* x [K] in the order nibble_group gives a 4-bit block's values */
static void permute_x(const float *x, int64_t K, float *xp) {
    for (int64_t b = 0; b < K; b += 32)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 8; l++) xp[b + 8 * g + l] = x[b + (g / 2) * 16 + 4 * (l % 4) + 2 * (g % 2) + l / 4];
}
#endif

/* x . (row n of W) for K values.  One fixed order per format and build (the thread count never changes it). */
static float dot_row(int qt, const uint8_t *row, const float *x, int64_t K) {
    const int64_t qk = quant_block_elems(qt), bb = quant_block_bytes(qt), nb = K / qk;
#ifdef QUANT_AVX2
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {
#ifdef QUANT_AVX512
        float out;
        dot_rows_pairs(qt, row, bb, x, 0, 1, nb, &out);
        return out;
#else  /* its own loop: routed through dot_rows_group it measured 3-6% slower */
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            const float *xb = x + b * 32;  /* 4-bit formats: x comes permuted (permute_x) */
            if (b + 4 < nb) _mm_prefetch((const char *)(blk + 4 * bb), _MM_HINT_T0);
            const block_decoder_t dec = block_decoder(qt, blk);
            for (int g = 0; g < 4; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * g), block_group(qt, &dec, g), acc[g]);
        }
        return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
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

#ifdef QUANT_AVX512
/* dot_row for two weight rows at once (Q4_0, Q4_1, Q8_0), each with its own accumulators in dot_row's
 * order, so each value is dot_row's bit for bit: one row's sum is a chain of dependent FMAs, one per
 * block per accumulator, and two independent chains keep the FMA units busy while a lone chain waits
 * on its latency; the activations are loaded once for both.  (The AVX-512 build: 10-14% faster per
 * GEMV here; with AVX2's sixteen registers the two rows spill and it was 5-10% slower.) */
static void dot_row_pair(int qt, const uint8_t *row0, const uint8_t *row1, const float *x, int64_t K, float *out) {
    const int64_t bb = quant_block_bytes(qt), nb = K / 32;
    __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch((const char *)(row0 + 2 * b * bb + GEMV_PREFETCH), _MM_HINT_T0);
        const block_pairs_t d0 = block_pairs(qt, row0 + b * bb), d1 = block_pairs(qt, row1 + b * bb);
        for (int h = 0; h < 2; h++) {
            const __m512 xv = _mm512_loadu_ps(x + b * 32 + 16 * h);
            acc[0][h] = _mm512_fmadd_ps(xv, block_pair(qt, &d0, h), acc[0][h]);
            acc[1][h] = _mm512_fmadd_ps(xv, block_pair(qt, &d1, h), acc[1][h]);
        }
    }
    out[0] = hsum_pairs(acc[0][0], acc[0][1]);
    out[1] = hsum_pairs(acc[1][0], acc[1][1]);
}
#endif

static void quant_gemv(int qt, const float *x, const uint8_t *w, int64_t row_bytes, const float *bias, float *y,
                       int64_t K, int64_t N, int nthreads) {
    float *xp = 0;
#ifdef QUANT_AVX2
    if (qt == QT_Q4_0 || qt == QT_Q4_1) {
        xp = (float *)kernel_scratch((size_t)K * sizeof(float));
        permute_x(x, K, xp);
        x = xp;
    }
#endif
#ifdef QUANT_AVX512
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {  /* weight rows two at a time (dot_row_pair) */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
        for (int64_t p = 0; p < (N + 1) / 2; p++) {
            const int64_t n = 2 * p;
            float s[2];
            if (n + 1 < N) dot_row_pair(qt, w + n * row_bytes, w + (n + 1) * row_bytes, x, K, s);
            else s[0] = dot_row(qt, w + n * row_bytes, x, K);
            for (int64_t i = n; i < n + 2 && i < N; i++) y[i] = bias ? s[i - n] + bias[i] : s[i - n];
        }
        free(xp);
        return;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
    for (int64_t n = 0; n < N; n++) {
        const float s = dot_row(qt, w + n * row_bytes, x, K);
        y[n] = bias ? s + bias[n] : s;
    }
    free(xp);
}

/* ---- a few rows: each weight row decoded once for all of them --------------------------------- */

/* Up to this many rows (a decode verifying drafts, a few decodes): quant_gemv_rows.  More rows expand
 * panels for the packed GEMM.  (The AVX-512 build once took Q4_0/Q4_1/Q8_0 up to 32 rows here, eight at a
 * time, which measured faster on a Zen 4; with the two-panel GEMM tile and the gathered expansion the
 * panels won from 9-16 rows up on a Cascade Lake Xeon -- 2 threads, 576 x 1536 Q4_1: 16 rows 495 -> 305
 * us, 32 rows 973 -> 429 us -- so every build now switches at 8.) */
#define QROWS_MAX 8

#ifdef QUANT_AVX2
/* dot_rows for MM rows over the weight groups G0 .. G0 + GG - 1 of every block (MM, G0, GG constants,
 * inlined into a switch, so that every accumulator stays in a register: with a run-time row count the
 * compiler keeps them in memory and every FMA waits on a store and a load).  acc[m][g] is dot_row's
 * accumulator g for row m, a chain over the blocks in order; the groups are independent chains, so rows
 * that do not fit the registers with all four groups (MM x 4 of 16 ymm) take the groups in passes over the
 * row -- each weight still decoded once for every row, the row's bytes read again from L1. */
static inline __attribute__((always_inline)) void dot_rows_span(int qt, const uint8_t *row, int64_t bb,
                                                                const float *x, int64_t ldx, const int MM,
                                                                const int G0, const int GG, int64_t nb,
                                                                __m256 (*acc_out)[4]) {
    __m256 acc[QROWS_MAX][4];
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 4
        for (int g = G0; g < G0 + GG; g++) acc[m][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        if (G0 == 0 && b + 4 < nb) _mm_prefetch((const char *)(blk + 4 * bb), _MM_HINT_T0);
        const block_decoder_t dec = block_decoder(qt, blk);
#pragma GCC unroll 4
        for (int g = G0; g < G0 + GG; g++) {  /* a group's weights used up before the next: fewer registers live */
            const __m256 w = block_group(qt, &dec, g);
#pragma GCC unroll 8
            for (int m = 0; m < MM; m++)
                acc[m][g] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + b * 32 + 8 * g), w, acc[m][g]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MM; m++)
#pragma GCC unroll 4
        for (int g = G0; g < G0 + GG; g++) acc_out[m][g] = acc[m][g];
    /* the pass's sums go to memory: without this barrier the compiler keeps them in registers through the
     * next pass, whose own accumulators then spill */
    __asm__ __volatile__("" ::: "memory");
}

/* MM rows in 4 / GG passes of GG groups each (MM x GG accumulators live) */
static inline __attribute__((always_inline)) void dot_rows_group(int qt, const uint8_t *row, int64_t bb,
                                                                 const float *x, int64_t ldx, const int MM,
                                                                 const int GG, int64_t nb, float *out) {
    __m256 acc[QROWS_MAX][4];
#pragma GCC unroll 4
    for (int g0 = 0; g0 < 4; g0 += GG) dot_rows_span(qt, row, bb, x, ldx, MM, g0, GG, nb, acc);
    for (int m = 0; m < MM; m++)
        out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
}
#endif

/* out[m] = x_m . row for M <= QROWS_MAX rows x_m = x + m * ldx: for every m exactly dot_row(row, x_m)
 * -- the same products in the same order -- with each block's weights expanded once per group of rows
 * (groups as even as the group size allows: 4 rows go 2 + 2, not 3 + 1) */
static void dot_rows(int qt, const uint8_t *row, const float *x, int64_t ldx, int M, int64_t K, float *out) {
    const int64_t qk = quant_block_elems(qt), bb = quant_block_bytes(qt), nb = K / qk;
#ifdef QUANT_AVX2
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {
#ifdef QUANT_AVX512
        switch (M) {  /* every row in one pass */
        case 1: dot_rows_pairs(qt, row, bb, x, ldx, 1, nb, out); return;
        case 2: dot_rows_pairs(qt, row, bb, x, ldx, 2, nb, out); return;
        case 3: dot_rows_pairs(qt, row, bb, x, ldx, 3, nb, out); return;
        case 4: dot_rows_pairs(qt, row, bb, x, ldx, 4, nb, out); return;
        case 5: dot_rows_pairs(qt, row, bb, x, ldx, 5, nb, out); return;
        case 6: dot_rows_pairs(qt, row, bb, x, ldx, 6, nb, out); return;
        case 7: dot_rows_pairs(qt, row, bb, x, ldx, 7, nb, out); return;
        default: dot_rows_pairs(qt, row, bb, x, ldx, QROWS_MAX, nb, out); return;
        }
#endif
        /* 1-3 rows take all four groups in one pass, 4-6 two groups per pass; 7-8 rows go as 4 + the rest
         * (their activations, 8 x K floats, left L1 at K = 1536: in one set of passes they ran 25% slower
         * there).  The format is a constant too: no branch on it in the loop.  2 threads, Zen 3 (AVX2),
         * 576 x 1536 + 1536 x 576 Q8_0, 6 rows: 2.3-3.0x one row's time in groups of three, 1.6-2.3x so. */
#define DOT_ROWS_FORMAT(QT)                                                              \
        switch (M) {                                                                     \
        case 1: dot_rows_group(QT, row, bb, x, ldx, 1, 4, nb, out); return;              \
        case 2: dot_rows_group(QT, row, bb, x, ldx, 2, 4, nb, out); return;              \
        case 3: dot_rows_group(QT, row, bb, x, ldx, 3, 4, nb, out); return;              \
        case 4: dot_rows_group(QT, row, bb, x, ldx, 4, 2, nb, out); return;              \
        case 5: dot_rows_group(QT, row, bb, x, ldx, 5, 2, nb, out); return;              \
        case 6: dot_rows_group(QT, row, bb, x, ldx, 6, 2, nb, out); return;              \
        case 7: dot_rows_group(QT, row, bb, x, ldx, 4, 2, nb, out);                      \
                dot_rows_group(QT, row, bb, x + 4 * ldx, ldx, 3, 4, nb, out + 4); return; \
        default: dot_rows_group(QT, row, bb, x, ldx, 4, 2, nb, out);                     \
                dot_rows_group(QT, row, bb, x + 4 * ldx, ldx, 4, 2, nb, out + 4); return; \
        }
        if (qt == QT_Q8_0) DOT_ROWS_FORMAT(QT_Q8_0)
        if (qt == QT_Q4_0) DOT_ROWS_FORMAT(QT_Q4_0)
        DOT_ROWS_FORMAT(QT_Q4_1)
#undef DOT_ROWS_FORMAT
    }
#endif
    float vals[256], s[QROWS_MAX];
    for (int m = 0; m < M; m++) s[m] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        deq_block(qt, row + b * bb, vals);
        for (int m = 0; m < M; m++) {
            const float *xb = x + m * ldx + b * qk;
            float p = 0.f;
#pragma omp simd reduction(+ : p)
            for (int64_t i = 0; i < qk; i++) p += xb[i] * vals[i];
            s[m] += p;
        }
    }
    for (int m = 0; m < M; m++) out[m] = s[m];
}

/* C [M x N] for 2 <= M <= QROWS_MAX: every row's values are the one-row GEMV's, bit for bit */
static void quant_gemv_rows(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes,
                            const float *bias, float *c, int64_t ldc, int M, int64_t K, int64_t N, int nthreads) {
    float *xp = 0;
    for (int m0 = 0; m0 < M; m0 += QROWS_MAX) {  /* QROWS_MAX rows at a time: their activations stay in L1 */
        const int mm = M - m0 < QROWS_MAX ? M - m0 : QROWS_MAX;
        const float *x = a + m0 * lda;
        int64_t ldx = lda;
#ifdef QUANT_AVX2
        if (qt == QT_Q4_0 || qt == QT_Q4_1) {  /* one small buffer, reused (a large one per call costs page faults) */
            if (!xp) xp = (float *)kernel_scratch((size_t)(QROWS_MAX * K) * sizeof(float));
            for (int m = 0; m < mm; m++) permute_x(x + m * lda, K, xp + m * K);
            x = xp;
            ldx = K;
        }
#endif
#ifdef QUANT_AVX512
        /* weight rows in pairs (dot_rows_two) up to four rows, or for long rows */
        if ((qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) && (mm <= 4 || K >= 2048)) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
            for (int64_t p = 0; p < (N + 1) / 2; p++) {
                const int64_t n = 2 * p;
                float s[2][QROWS_MAX];
                if (n + 1 < N) dot_rows_two_any(qt, w + n * row_bytes, w + (n + 1) * row_bytes, x, ldx, mm, K, s[0], s[1]);
                else dot_rows(qt, w + n * row_bytes, x, ldx, mm, K, s[0]);
                for (int64_t i = n; i < n + 2 && i < N; i++)
                    for (int m = 0; m < mm; m++) c[(m0 + m) * ldc + i] = bias ? s[i - n][m] + bias[i] : s[i - n][m];
            }
            continue;
        }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
        for (int64_t n = 0; n < N; n++) {
            float s[QROWS_MAX];
            dot_rows(qt, w + n * row_bytes, x, ldx, mm, K, s);
            for (int m = 0; m < mm; m++) c[(m0 + m) * ldc + n] = bias ? s[m] + bias[n] : s[m];
        }
    }
    free(xp);
}

/* ---- activation-quantized mode (QT_ACT_Q8): integer dot products -------------------------------
 * For Q4_0, Q4_1 and Q8_0 weights, the kernels can quantize each activation row to 8 bits per
 * 32-value block, as llama.cpp does (its Q8_1: d = max|x| / 127, q = round(x * (1 / d)) ties to even,
 * s = d * sum(q)), and take each block's dot product in integers.  Per row and block, with qx the
 * activation's 8-bit values and i = sum(q * qx) the block's exact integer sum:
 *     Q4_1  w = dw * q + mw        acc = fma(dw * dx, i, acc)   side = fma(mw, s, side)
 *     Q4_0  w = dw * (q - 8)       acc = fma(dw * dx, i - 8 * sum(qx), acc)
 *     Q8_0  w = dw * q             acc = fma(dw * dx, i, acc)
 * and the value is acc + side, the blocks taken in order: one fp32 sum per row whatever the build, the
 * number of rows or the rows beside it (the integer sums are exact in every build).  The weights are used
 * exactly; the activations are rounded to ~2.5 significant digits, so results are close to, not equal
 * to, the fp32 path's (tests bound the error against a float64 emulation).  (The rounding amplifies what
 * other kernels change: attention for one query and for several sums in other orders, so a speculative
 * verify or a prefill chunk can move a rounding, and rarely a token.)
 *
 * Weights in this mode are interleaved sixteen rows at a time (gguf_quant.QuantizedTensor repacks them
 * in place when the mode is set; the same bytes, reordered), so that one 16-lane register holds four
 * values of each of sixteen rows and one vpdpbusd takes 64 products.  Group g (rows 16g..16g+15)
 * occupies those rows' bytes; its block b (16 x the format's block bytes, in order of b) holds:
 *     d[16] fp16, then (Q4_1) m[16] fp16, then the values in chunks of 64 bytes, 4 per row:
 *     Q4_0, Q4_1  chunk j < 4: row n's bytes qs[4j..4j+3] (low nibbles its values 4j.., high 16+4j..)
 *     Q8_0        chunk j < 8: row n's values 4j..4j+3, plus 128 (unsigned bytes; 128 * sum(qx) taken off)
 * Rows past the last whole group keep the file's layout. */

#define X16 16  /* weight rows interleaved together */

typedef struct {
    int8_t *q;  /* [M x K] */
    float *d, *s;  /* [M x K / 32] */
    int32_t *n;  /* [M x K / 32]: sum(q) per block */
} act_q8_t;

static void quantize_rows_q8(const float *a, int64_t lda, int M, int64_t K, act_q8_t *out) {
    const int64_t nb = K / 32;
    for (int m = 0; m < M; m++) {
        const float *x = a + m * lda;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * 32;
            int8_t *q = out->q + m * K + b * 32;
            float amax = 0.f;
#ifdef QUANT_AVX2
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int g = 0; g < 4; g++) {
                v[g] = _mm256_loadu_ps(xb + 8 * g);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[g]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            amax = _mm_cvtss_f32(h);
#else
            for (int i = 0; i < 32; i++) {
                const float av = xb[i] < 0 ? -xb[i] : xb[i];
                amax = av > amax ? av : amax;
            }
#endif
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            int sum = 0;
#ifdef QUANT_AVX2
            const __m256 vid = _mm256_set1_ps(id);
            __m256i qi[4];
            for (int g = 0; g < 4; g++)  /* x * id rounded to nearest, ties to even (as nearbyintf) */
                qi[g] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[g], vid),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* int32 -> int8 in order: packs interleave the 128-bit lanes, the permute puts them back */
            const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)q, p8);
            const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            sum = _mm_cvtsi128_si32(s4);
#else
            for (int i = 0; i < 32; i++) {
                const float r = nearbyintf(xb[i] * id);  /* the current rounding mode: to nearest, ties to even */
                q[i] = (int8_t)r;
                sum += q[i];
            }
#endif
            out->d[m * nb + b] = d;
            out->s[m * nb + b] = d * (float)sum;
            out->n[m * nb + b] = sum;
        }
    }
}

static inline int takes_act_q8(int qt) { return qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0; }

/* what the interleaved layout adds to every weight value (Q4_0's q - 8 and Q8_0's signed q, unsigned) */
static inline int x16_offset(int qt) { return qt == QT_Q4_0 ? 8 : qt == QT_Q8_0 ? 128 : 0; }
static inline int64_t x16_values_at(int qt) { return qt == QT_Q4_1 ? 64 : 32; }

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef QUANT_AVX2
#define X16_PREFETCH 4096  /* bytes ahead the group's stream is prefetched (2 threads, 1 row: 13-18% faster) */
/* the cache lines of one interleaved block (gb bytes at blk), X16_PREFETCH bytes ahead */
static inline void x16_prefetch(const uint8_t *blk, int64_t gb) {
    for (int64_t o = 0; o < gb; o += 64) _mm_prefetch((const char *)(blk + X16_PREFETCH + o), _MM_HINT_T0);
}
#endif

/* One group of X16 interleaved weight rows against R quantized rows: out[r * X16 + n] (module comment) */
#if defined(QUANT_AVX512)
/* The AVX-512 build needs VNNI (ops.py), but only these functions are compiled for it: GCC 12.2 turns a
 * plain loop's signed byte dot product into vpdpbusd, which takes one side unsigned (wrong values). */
#define X16_VNNI __attribute__((target("avx512vnni")))
static inline __attribute__((always_inline)) X16_VNNI void x16_group(int qt, const uint8_t *grp, const act_q8_t *x,
                                                            const int R, int64_t K, float *out) {
    const int64_t gb = X16 * quant_block_bytes(qt), nb = K / 32;
    const int off = x16_offset(qt);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[QROWS_MAX], side[QROWS_MAX];
    for (int r = 0; r < R; r++) acc[r] = side[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * gb, *vals = blk + x16_values_at(qt);
        x16_prefetch(blk, gb);
        __m512i isum[QROWS_MAX];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        if (qt == QT_Q8_0) {
            for (int j = 0; j < 8; j++) {
                const __m512i w = _mm512_loadu_si512((const void *)(vals + 64 * j));
                for (int r = 0; r < R; r++)
                    isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(load_i32(x->q + r * K + b * 32 + 4 * j)));
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(vals + 64 * j));
                const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                for (int r = 0; r < R; r++) {
                    const int8_t *xq = x->q + r * K + b * 32 + 4 * j;
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(load_i32(xq)));
                    isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(load_i32(xq + 16)));
                }
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mw = qt == QT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                        : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            if (off) isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(off * x->n[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(x->d[r * nb + b])), _mm512_cvtepi32_ps(isum[r]), acc[r]);
            if (qt == QT_Q4_1) side[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->s[r * nb + b]), side[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * X16, _mm512_add_ps(acc[r], side[r]));
}
#define X16_ROWS QROWS_MAX  /* quantized rows a pass takes */
#elif defined(QUANT_AVX2)
#define X16_VNNI
/* a + sum of four u8 x s8 products per int32 lane (vpdpbusd's sum; no pair of the 4-bit formats' products
 * can saturate vpmaddubsw's int16: 15 * 127 * 2) */
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* the AVX-512 build's x16_group, eight lanes at a time: half h takes rows 8h..8h+7 */
static inline __attribute__((always_inline)) void x16_group(int qt, const uint8_t *grp, const act_q8_t *x,
                                                            const int R, int64_t K, float *out) {
    const int64_t gb = X16 * quant_block_bytes(qt), nb = K / 32;
    const int off = x16_offset(qt);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256 acc[4], side[4];
        for (int r = 0; r < R; r++) acc[r] = side[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = grp + b * gb, *vals = blk + x16_values_at(qt) + 32 * h;
            if (h == 0) x16_prefetch(blk, gb);  /* the first half's pass streams the group */
            __m256i isum[4];
            for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
            if (qt == QT_Q8_0) {  /* 0..255 by nibbles: 16 * hi + lo, each free of saturation */
                __m256i ihi[4];
                for (int r = 0; r < R; r++) ihi[r] = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(vals + 64 * j));
                    const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                    for (int r = 0; r < R; r++) {
                        const __m256i xv = _mm256_set1_epi32(load_i32(x->q + r * K + b * 32 + 4 * j));
                        isum[r] = dpbusd8(isum[r], lo, xv);
                        ihi[r] = dpbusd8(ihi[r], hi, xv);
                    }
                }
                for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_slli_epi32(ihi[r], 4));
            } else {
                for (int j = 0; j < 4; j++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(vals + 64 * j));
                    const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                    for (int r = 0; r < R; r++) {
                        const int8_t *xq = x->q + r * K + b * 32 + 4 * j;
                        isum[r] = dpbusd8(isum[r], lo, _mm256_set1_epi32(load_i32(xq)));
                        isum[r] = dpbusd8(isum[r], hi, _mm256_set1_epi32(load_i32(xq + 16)));
                    }
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            const __m256 mw = qt == QT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
                                            : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                if (off) isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(off * x->n[r * nb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x->d[r * nb + b])), _mm256_cvtepi32_ps(isum[r]), acc[r]);
                if (qt == QT_Q4_1) side[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->s[r * nb + b]), side[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * X16 + 8 * h, _mm256_add_ps(acc[r], side[r]));
    }
}
#define X16_ROWS 4
#else
static void x16_group(int qt, const uint8_t *grp, const act_q8_t *x, const int R, int64_t K, float *out) {
    const int64_t gb = X16 * quant_block_bytes(qt), nb = K / 32;
    const int off = x16_offset(qt);
    for (int r = 0; r < R; r++)
        for (int n = 0; n < X16; n++) {
            float acc = 0.f, side = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = grp + b * gb, *vals = blk + x16_values_at(qt);
                const int8_t *xq = x->q + r * K + b * 32;
                int32_t isum = 0;
                if (qt == QT_Q8_0) {
                    for (int j = 0; j < 8; j++)
                        for (int t = 0; t < 4; t++) isum += vals[64 * j + 4 * n + t] * xq[4 * j + t];
                } else {
                    for (int j = 0; j < 4; j++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t v = vals[64 * j + 4 * n + t];
                            isum += (v & 15) * xq[4 * j + t] + (v >> 4) * xq[16 + 4 * j + t];
                        }
                }
                isum -= off * x->n[r * nb + b];
                acc = fmaf(half_to_float(blk + 2 * n) * x->d[r * nb + b], (float)isum, acc);
                if (qt == QT_Q4_1) side = fmaf(half_to_float(blk + 32 + 2 * n), x->s[r * nb + b], side);
            }
            out[r * X16 + n] = acc + side;
        }
}
#define X16_ROWS QROWS_MAX
#define X16_VNNI
#endif

/* x16_group for R = mm rows, R constant in each case so the accumulators stay in registers */
static X16_VNNI void x16_group_rows(int qt, const uint8_t *grp, const act_q8_t *x, int mm, int64_t K, float *out) {
    switch (mm) {
    case 1: x16_group(qt, grp, x, 1, K, out); return;
    case 2: x16_group(qt, grp, x, 2, K, out); return;
    case 3: x16_group(qt, grp, x, 3, K, out); return;
#if X16_ROWS > 4
    case 4: x16_group(qt, grp, x, 4, K, out); return;
    case 5: x16_group(qt, grp, x, 5, K, out); return;
    case 6: x16_group(qt, grp, x, 6, K, out); return;
    case 7: x16_group(qt, grp, x, 7, K, out); return;
#endif
    default: x16_group(qt, grp, x, X16_ROWS, K, out); return;
    }
}

/* the same sums for one row past the last whole group, in the file's layout (the same integers: the
 * signed values directly) */
static float q8_tail_row(int qt, const uint8_t *row, const act_q8_t *x, int r, int64_t K) {
    const int64_t bb = quant_block_bytes(qt), nb = K / 32;
    float acc = 0.f, side = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const int8_t *xq = x->q + r * K + b * 32;
        int32_t isum = 0;
        if (qt == QT_Q8_0) {
            for (int i = 0; i < 32; i++) isum += (int8_t)blk[2 + i] * xq[i];
        } else {
            const uint8_t *qs = blk + (qt == QT_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * xq[i] + (qs[i] >> 4) * xq[i + 16];
            if (qt == QT_Q4_0) isum -= 8 * x->n[r * nb + b];
        }
        acc = fmaf(half_to_float(blk) * x->d[r * nb + b], (float)isum, acc);
        if (qt == QT_Q4_1) side = fmaf(half_to_float(blk + 2), x->s[r * nb + b], side);
    }
    return acc + side;
}

#define X16_TILE 2  /* groups a thread takes at a time, kept in cache while every pass of rows goes over them */

/* C [M x N] in the activation-quantized mode, any M: the rows are quantized once, then each thread takes
 * tiles of X16_TILE weight groups and runs every pass of X16_ROWS rows over them (a row's values never
 * depend on M or on the rows beside it) */
static void quant_linear_q8(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes,
                            const float *bias, float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads) {
    const int64_t nb = K / 32, groups = N / X16, gtiles = (groups + X16_TILE - 1) / X16_TILE;
    const int64_t ntiles = gtiles + (groups * X16 < N);
    act_q8_t x;
    x.q = (int8_t *)kernel_scratch((size_t)(M * K));
    x.d = (float *)kernel_scratch((size_t)(M * nb) * sizeof(float));
    x.s = (float *)kernel_scratch((size_t)(M * nb) * sizeof(float));
    x.n = (int32_t *)kernel_scratch((size_t)(M * nb) * sizeof(int32_t));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 32768)
    for (int64_t m0 = 0; m0 < M; m0 += X16_ROWS) {
        act_q8_t part = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * nb, x.n + m0 * nb};
        quantize_rows_q8(a + m0 * lda, lda, (int)(M - m0 < X16_ROWS ? M - m0 : X16_ROWS), K, &part);
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
    for (int64_t t = 0; t < ntiles; t++) {
        if (t == gtiles) {  /* the rows past the last whole group */
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = groups * X16; n < N; n++) {
                    const float s = q8_tail_row(qt, w + n * row_bytes, &x, (int)m, K);
                    c[m * ldc + n] = bias ? s + bias[n] : s;
                }
            continue;
        }
        const int64_t g1 = (t + 1) * X16_TILE < groups ? (t + 1) * X16_TILE : groups;
        for (int64_t m0 = 0; m0 < M; m0 += X16_ROWS) {
            const int mm = (int)(M - m0 < X16_ROWS ? M - m0 : X16_ROWS);
            const act_q8_t part = {x.q + m0 * K, x.d + m0 * nb, x.s + m0 * nb, x.n + m0 * nb};
            for (int64_t g = t * X16_TILE; g < g1; g++) {
                float s[X16_ROWS * X16];
                x16_group_rows(qt, w + g * X16 * row_bytes, &part, mm, K, s);
                for (int r = 0; r < mm; r++)
                    for (int n = 0; n < X16; n++) {
                        const int64_t col = g * X16 + n;
                        c[(m0 + r) * ldc + col] = bias ? s[r * X16 + n] + bias[col] : s[r * X16 + n];
                    }
            }
        }
    }
    free(x.q);
    free(x.d);
    free(x.s);
    free(x.n);
}

/* ---- more rows: weight rows expanded into packed panels ------------------------------------- */

#ifdef QUANT_AVX2
/* The AVX2 build's counterpart of expand_panel_x16 (below), eight rows at a time: lane j of a register is row
 * j, so one shift, mask, conversion and FMA give eight rows' value k (half a panel row) at once.  rows_x8
 * gathers 16 bytes of each of eight rows (rows past nn give 0) as four registers, g[c] holding bytes 4c..4c+3:
 * two rows per 256-bit register and a 4x4 dword transpose in each lane.  Replaces a per-row expansion and
 * 8x8 float transposes that cost ~2.4 cycles a value on a Zen 3, where the panel route then lost to fp32
 * weights (16 rows: 2.6 ms against 1.8 ms per SmolLM2 layer). */
static inline void rows_x8(const uint8_t *p, int64_t row_bytes, int64_t nn, __m256i g[4]) {
    __m256i v[4];
    for (int j = 0; j < 4; j++) {
#define ROW8(r) ((r) < nn ? _mm_loadu_si128((const __m128i *)(p + (r) * row_bytes)) : _mm_setzero_si128())
        v[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(ROW8(j)), ROW8(j + 4), 1);
#undef ROW8
    }
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    g[0] = _mm256_unpacklo_epi64(t0, t2);
    g[1] = _mm256_unpackhi_epi64(t0, t2);
    g[2] = _mm256_unpacklo_epi64(t1, t3);
    g[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* eight rows' fp16 pair at p (row r's at p + r * row_bytes, 0 past nn): the first half in *lo, the second in *hi */
static inline void halves_x8(const uint8_t *p, int64_t row_bytes, int64_t nn, __m256 *lo, __m256 *hi) {
    int32_t w[8];
    for (int r = 0; r < 8; r++) {
        w[r] = 0;
        if (r < nn) memcpy(&w[r], p + r * row_bytes, 4);
    }
    const __m256i x = _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
    const __m256i low = _mm256_and_si256(x, _mm256_set1_epi32(0xffff)), high = _mm256_srli_epi32(x, 16);
    *lo = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
    *hi = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}

/* rows 0 .. nn of w (nn <= 16) into one panel [K x 16]: deq_block's values (fma(d, q, m): d * q is exact, so
 * the sum rounds once as there; Q4_0's m = -8d; d * q for Q8_0), columns past nn 0 */
static void expand_panel_x8(int qt, const uint8_t *w, int64_t row_bytes, int64_t nn, int64_t K, float *panel) {
    const __m256i nib = _mm256_set1_epi32(15);
    const int64_t bb = quant_block_bytes(qt);
    for (int half = 0; half < 2; half++) {
        const uint8_t *rows = w + half * 8 * row_bytes;
        const int64_t live = nn - half * 8 < 0 ? 0 : nn - half * 8;
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t *blk = rows + b * bb;
            float *out = panel + b * 32 * QPANEL + half * 8;
            __m256 d, m;
            halves_x8(blk, row_bytes, live, &d, &m);
            __m256i g[8];
            if (qt == QT_Q8_0) {
                rows_x8(blk + 2, row_bytes, live, g);
                rows_x8(blk + 18, row_bytes, live, g + 4);
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++) {
                        const __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(g[c], 24 - 8 * i), 24);
                        _mm256_storeu_ps(out + (4 * c + i) * QPANEL, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                    }
                continue;
            }
            if (qt != QT_Q4_1) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
            rows_x8(blk + (qt == QT_Q4_1 ? 4 : 2), row_bytes, live, g);
            for (int c = 0; c < 4; c++)  /* bytes 4c..4c+3: values 4c+i (low nibbles) and 16+4c+i (high) */
                for (int i = 0; i < 4; i++) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(g[c], 8 * i), nib);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(g[c], 8 * i + 4), nib);
                    _mm256_storeu_ps(out + (4 * c + i) * QPANEL, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m));
                    _mm256_storeu_ps(out + (16 + 4 * c + i) * QPANEL, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m));
                }
        }
    }
}
#endif

#ifdef QUANT_AVX512
/* Sixteen rows' 16 bytes (row r's at p + r * row_bytes; rows past nn read nothing and give 0) as four registers
 * with lane r = row r: g[c] holds its bytes 4c..4c+3.  Four 128-bit loads per register and a dword transpose
 * (two rounds of vpermt2d) -- on this build's CPUs a masked 16-lane gather, which the same work took before,
 * costs several times as much (the gather-data-sampling microcode of Intel's AVX-512 parts). */
static inline void rows_x16(const uint8_t *p, int64_t row_bytes, int64_t nn, __m512i g[4]) {
    __m512i z[4];
    for (int i = 0; i < 4; i++) {  /* z[i]: rows 4i..4i+3 in its four 128-bit lanes */
#define ROW(l) _mm_maskz_loadu_epi32(4 * i + (l) < nn ? 0xf : 0, p + (4 * i + (l) < nn ? 4 * i + (l) : 0) * row_bytes)
        z[i] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(ROW(0)), ROW(1), 1),
                                                     ROW(2), 2), ROW(3), 3);
#undef ROW
    }
    /* t01: rows 0-7's dword 0, then their dword 1; t23: dwords 2 and 3; u01, u23: rows 8-15 */
    const __m512i even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
    const __m512i t01 = _mm512_permutex2var_epi32(z[0], even, z[1]), t23 = _mm512_permutex2var_epi32(z[0], odd, z[1]);
    const __m512i u01 = _mm512_permutex2var_epi32(z[2], even, z[3]), u23 = _mm512_permutex2var_epi32(z[2], odd, z[3]);
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    g[0] = _mm512_permutex2var_epi32(t01, lo, u01);
    g[1] = _mm512_permutex2var_epi32(t01, hi, u01);
    g[2] = _mm512_permutex2var_epi32(t23, lo, u23);
    g[3] = _mm512_permutex2var_epi32(t23, hi, u23);
}

/* The AVX-512 build expands a panel with lane j of a register as row j: rows_x16 gives 4 bytes of each of the
 * 16 rows per register, so one shift, mask, conversion and FMA give 16 rows' value k -- panel row k -- at once
 * (no per-row expansion, no 8x8 float transposes).  d and m come by one gather per block.  The values are
 * deq_block's: fma(d, q, m) (Q4_0: m = -8d), d * q (Q8_0); lanes past nn give 0. */
static void expand_panel_x16(int qt, const uint8_t *w, int64_t row_bytes, int64_t nn, int64_t K, float *panel) {
    const __mmask16 live = (__mmask16)((1u << nn) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int32_t)row_bytes));
    const __m512i nib = _mm512_set1_epi32(15);
    const int64_t bb = quant_block_bytes(qt);
    for (int64_t b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + b * bb;
        float *out = panel + b * 32 * QPANEL;
        const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, blk, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        __m512i g[8];
        if (qt == QT_Q8_0) {
            rows_x16(blk + 2, row_bytes, nn, g);
            rows_x16(blk + 18, row_bytes, nn, g + 4);
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < 4; i++) {
                    const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(g[c], 24 - 8 * i), 24);
                    _mm512_storeu_ps(out + (4 * c + i) * QPANEL, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
                }
            continue;
        }
        const __m512 m = qt == QT_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                                       : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        rows_x16(blk + (qt == QT_Q4_1 ? 4 : 2), row_bytes, nn, g);
        for (int c = 0; c < 4; c++)  /* bytes 4c..4c+3: values 4c+i (low nibbles) and 16+4c+i (high) */
            for (int i = 0; i < 4; i++) {
                const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(g[c], 8 * i), nib);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(g[c], 8 * i + 4), nib);
                _mm512_storeu_ps(out + (4 * c + i) * QPANEL, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m));
                _mm512_storeu_ps(out + (16 + 4 * c + i) * QPANEL, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m));
            }
    }
}
#endif

/* rows n0 .. n0+nn of W expanded into one panel [K x 16] (zero past nn), the layout of pack_panels_f32;
 * rowbuf holds K floats */
void quant_expand_panel(int qt, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nn, int64_t K,
                        float *panel, float *rowbuf) {
#ifdef QUANT_AVX512
    if ((qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) && 15 * row_bytes <= INT32_MAX) {  /* the gathers' row offsets are int32 */
        expand_panel_x16(qt, w + n0 * row_bytes, row_bytes, nn, K, panel);
        return;
    }
#endif
#ifdef QUANT_AVX2
    if (qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0) {  /* eight rows to a register */
        expand_panel_x8(qt, w + n0 * row_bytes, row_bytes, nn, K, panel);
        return;
    }
#endif
    for (int64_t j = 0; j < QPANEL; j++) {
        if (j < nn) {
            deq_row(qt, w + (n0 + j) * row_bytes, K, rowbuf);
            for (int64_t k = 0; k < K; k++) panel[k * QPANEL + j] = rowbuf[k];
        } else {
            for (int64_t k = 0; k < K; k++) panel[k * QPANEL + j] = 0.f;
        }
    }
}

/* Which route quant_linear_f32 (cpu_kernels.c) takes for M rows of type qt (with QT_ACT_Q8): 1 for this
 * file's rows routes (quant_rows_f32), 0 for the packed GEMM over expanded panels (quant_expand_panel). */
int quant_rows_route(int qt, int64_t M) {
    const int base = qt & ~QT_ACT_Q8;
    return ((qt & QT_ACT_Q8) && takes_act_q8(base)) || M <= QROWS_MAX;
}

/* C [M x N] = A [M x K] W^T (+ bias) by the rows routes: activation-quantized (QT_ACT_Q8), one-row GEMV,
 * or the multi-row GEMV -- for the M quant_rows_route accepts */
void quant_rows_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                    float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads) {
    const int act_q8 = qt & QT_ACT_Q8;
    qt &= ~QT_ACT_Q8;
    if (act_q8 && takes_act_q8(qt)) quant_linear_q8(qt, a, lda, w, row_bytes, bias, c, ldc, M, K, N, nthreads);
    else if (M == 1) quant_gemv(qt, a, w, row_bytes, bias, c, K, N, nthreads);
    else quant_gemv_rows(qt, a, lda, w, row_bytes, bias, c, ldc, (int)M, K, N, nthreads);
}
