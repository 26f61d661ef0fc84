/* Native CPU kernels for the hot path (fp32: projections, attention, norms), called through ctypes by cpu_ops.py.
 *
 * Plain C, no torch headers: it compiles in well under a second on first use.  Parallel loops use
 * OpenMP; loaded into a process that already holds torch's libgomp.so.1, the loader reuses that
 * runtime, so torch and these kernels share one thread pool.  Every kernel takes the thread count
 * from the caller (torch.get_num_threads()).
 *
 * Built with -ffp-contract=off so products and sums round like torch's separate mul/add kernels.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void *kernel_scratch(size_t bytes);  /* quant_kernels.c: 64-byte aligned scratch, freed with free() */

/* One row of RMSNorm: o = w * (x (+ r) / rms);  with r: ro = x + r (ro may be r, o may be x).  Not
 * inlined, so every caller (rms_norm_f32, the layer stack's per-head q/k norm) runs the one compiled
 * body and gets the same bits. */
static __attribute__((noinline)) void rms_row(const float *xr, const float *rr, const float *w, float *o, float *ro,
                                              int64_t hidden, float eps) {
    const float *src = xr;
    if (rr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) ro[i] = xr[i] + rr[i];
        src = ro;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < hidden; i++) ss += src[i] * src[i];
    float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) o[i] = w[i] * (src[i] * inv);
}

/* out[r] = w * (x[r] (+ res[r]) / rms);  with res: res_out[r] = x[r] + res[r]. */
void rms_norm_f32(const float *x, const float *res, const float *w, float *out, float *res_out,
                  int64_t rows, int64_t hidden, int64_t x_stride, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++)
        rms_row(x + r * x_stride, res ? res + r * hidden : 0, w, out + r * hidden, res ? res_out + r * hidden : 0,
                hidden, eps);
}

/* Rotate-half rope, in place, on the first rot dims of heads [0, nheads) of each row; cos/sin rows
 * [rot] per token (both halves stored). */
static void rope_rows(float *x, int64_t rows, int64_t row_stride, int64_t nheads, int64_t head_stride,
                      int64_t rot, const float *cos, const float *sin, int nthreads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * rot, *s = sin + r * rot;
        for (int64_t h = 0; h < nheads; h++) {
            float *v = x + r * row_stride + h * head_stride;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                float a = x1 * c[i], b = (-x2) * s[i];
                float d = x2 * c[i + half], e = x1 * s[i + half];
                v[i] = a + b;
                v[i + half] = d + e;
            }
        }
    }
}

void rotary_f32(float *q, int64_t q_row_stride, int64_t nq, float *k, int64_t k_row_stride, int64_t nk,
                int64_t head_dim, int64_t rot, int64_t rows, const float *cos, const float *sin, int nthreads) {
    rope_rows(q, rows, q_row_stride, nq, head_dim, rot, cos, sin, nthreads);
    rope_rows(k, rows, k_row_stride, nk, head_dim, rot, cos, sin, nthreads);
}

/* kv_cache[0][slot] = k[r], kv_cache[1][slot] = v[r]; width = H_kv * D floats per token. */
void write_kv_f32(const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride, float *key_cache,
                  float *value_cache, const int64_t *slots, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t s = slots[r];
        memcpy(key_cache + s * width, k + r * k_row_stride, (size_t)width * sizeof(float));
        memcpy(value_cache + s * width, v + r * v_row_stride, (size_t)width * sizeof(float));
    }
}

/* exp(x), x clamped to [-87, 88] (softmax numerators, SiLU): Cephes' expf polynomial on
 * x = n ln2 + r, |r| <= ln2/2, times 2^n built in the exponent bits; within 2 ulp of expf. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_C1;
    r = r - n * EXP_C2;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    const float y = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return y * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)));
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P5));
    __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
/* exp256's sixteen-lane twin: the same operations in the same order, so the same bits per lane */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C1)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C2)));
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P5));
    __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The query heads of one GQA group share their KV head's K and V rows: a tile of up to 3 of them
 * reads each row once.  Scores: 4 tokens x GT heads give 4*GT independent FMA chains (one head alone
 * had 4, half the FMA rate for the 4-cycle FMA latency). */
#ifdef HAVE_AVX2
static inline __attribute__((always_inline)) void scores_tile(const int GT, const float *q, int64_t D,
        const float *k, int64_t tok_stride, int64_t nt, __m128 sc, float *s, int64_t S, float *mx) {
    float m[3];
    for (int g = 0; g < GT; g++) m[g] = mx[g];
    int64_t j = 0;
    for (; j + 4 <= nt; j += 4) {
        const float *k0 = k + j * tok_stride, *k1 = k0 + tok_stride, *k2 = k1 + tok_stride, *k3 = k2 + tok_stride;
        __m256 acc[3][4];
#pragma GCC unroll 3
        for (int g = 0; g < GT; g++)
            for (int t = 0; t < 4; t++) acc[g][t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 kv0 = _mm256_loadu_ps(k0 + i), kv1 = _mm256_loadu_ps(k1 + i), kv2 = _mm256_loadu_ps(k2 + i),
                         kv3 = _mm256_loadu_ps(k3 + i);
#pragma GCC unroll 3
            for (int g = 0; g < GT; g++) {
                const __m256 qv = _mm256_loadu_ps(q + g * D + i);
                acc[g][0] = _mm256_fmadd_ps(qv, kv0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(qv, kv1, acc[g][1]);
                acc[g][2] = _mm256_fmadd_ps(qv, kv2, acc[g][2]);
                acc[g][3] = _mm256_fmadd_ps(qv, kv3, acc[g][3]);
            }
        }
#pragma GCC unroll 3
        for (int g = 0; g < GT; g++) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
            const __m128 d4 = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), sc);
            _mm_storeu_ps(s + g * S + j, d4);
            __m128 mv = _mm_max_ps(d4, _mm_movehl_ps(d4, d4));
            mv = _mm_max_ss(mv, _mm_movehdup_ps(mv));
            const float m4 = _mm_cvtss_f32(mv);
            m[g] = m4 > m[g] ? m4 : m[g];
        }
    }
    for (; j < nt; j++) {
        const float *kp = k + j * tok_stride;
        for (int g = 0; g < GT; g++) {
            __m256 a0 = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), _mm256_loadu_ps(kp + i), a0);
            const float dot = hsum256(a0) * _mm_cvtss_f32(sc);
            s[g * S + j] = dot;
            m[g] = dot > m[g] ? dot : m[g];
        }
    }
    for (int g = 0; g < GT; g++) mx[g] = m[g];
}
#endif

/* The block a pass reads next, fetched ahead of its loads a slice at a time.  Decode attention reads
 * each 12 KB block (default model) once and computes on it for about as long as the read takes; left
 * to the hardware, the two took turns (the kernel streamed ~15 GB/s where a plain read of the same
 * blocks gets ~25).  Each head tile of a block now first issues its share of prefetches for the next
 * block (the first V block after the last K block), so the next read overlaps this compute (64 x 200
 * tokens x 30 layers, 2 threads, reference machine: ~35 -> ~27 ms).  Prefetch changes no value. */
typedef struct {
    const char *at, *end;
    int64_t per_call;  /* lines per prefetch call */
    const char *row;   /* the row being fetched; rows are `width` bytes, `stride` apart */
    int64_t width, stride;
} ahead_t;

static const ahead_t NOTHING_AHEAD = {0, 0, 0, 0, 0, 0};

/* Block b of a sequence of S tokens in `cache` (token rows of tok_stride floats), the `width` floats from
 * `offset` of each row (an item's KV heads; width == tok_stride: whole rows), its lines spread over `calls`
 * prefetch calls; nothing past the sequence's last block. */
static inline ahead_t block_ahead(const float *cache, const int32_t *bt, int64_t b, int64_t S, int64_t block_size,
                                  int64_t tok_stride, int64_t offset, int64_t width, int64_t calls) {
    const int64_t left = S - b * block_size;
    if (left <= 0) return NOTHING_AHEAD;
    const int64_t rows = left < block_size ? left : block_size;
    const float *first = cache + (int64_t)bt[b] * block_size * tok_stride + offset;
    const int64_t row_bytes = width * (int64_t)sizeof(float), lines = rows * ((row_bytes + 63) / 64);
    ahead_t a = {(const char *)first, (const char *)(first + (rows - 1) * tok_stride + width),
                 (lines + calls - 1) / calls, (const char *)first, row_bytes, tok_stride * (int64_t)sizeof(float)};
    return a;
}

static inline void fetch_ahead(ahead_t *a) {
#ifdef HAVE_AVX2
    for (int64_t i = 0; i < a->per_call && a->at < a->end; i++) {
        _mm_prefetch(a->at, _MM_HINT_T0);
        a->at += 64;
        if (a->at >= a->row + a->width) a->at = a->row += a->stride;
    }
#else
    (void)a;
#endif
}

/* scores[g * S + t] = scale * q_g . k_t for query heads g < nh (kv head g / G) and the nt tokens of
 * one block; tracks each head's max in mx; prefetches `next` over its head tiles. */
static inline void block_scores(const float *qs, const float *kb, int64_t tok_stride, int64_t nt, int64_t nh,
                                int64_t G, int64_t D, float scale, float *scores, int64_t S, int64_t t0, float *mx,
                                ahead_t *next) {
#ifdef HAVE_AVX2
    if ((D & 7) == 0) {
        const __m128 sc = _mm_set1_ps(scale);
        for (int64_t g = 0; g < nh;) {  /* tiles of up to 3 heads within one GQA group */
            const int64_t left = G - g % G, gt = left < 3 ? left : 3;
            const float *kg = kb + (g / G) * D;
            fetch_ahead(next);
            if (gt == 3) scores_tile(3, qs + g * D, D, kg, tok_stride, nt, sc, scores + g * S + t0, S, mx + g);
            else if (gt == 2) scores_tile(2, qs + g * D, D, kg, tok_stride, nt, sc, scores + g * S + t0, S, mx + g);
            else scores_tile(1, qs + g * D, D, kg, tok_stride, nt, sc, scores + g * S + t0, S, mx + g);
            g += gt;
        }
        return;
    }
#endif
    (void)next;
    for (int64_t j = 0; j < nt; j++) {
        const float *row = kb + j * tok_stride;
        for (int64_t g = 0; g < nh; g++) {
            const float *qg = qs + g * D, *kp = row + (g / G) * D;
            float dot = 0.f;
            for (int64_t i = 0; i < D; i++) dot += qg[i] * kp[i];
            dot *= scale;
            scores[g * S + t0 + j] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
        }
    }
}

/* sg[t] = exp(sg[t] - m) for t < S; returns their sum. */
static inline float softmax_numerators(float *sg, int64_t S, float m) {
    float s = 0.f;
    int64_t t = 0;
#ifdef HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= S; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
        _mm256_storeu_ps(sg + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    s = hsum256(acc);
#endif
    for (; t < S; t++) {
        const float e = exp_clamped(sg[t] - m);
        sg[t] = e;
        s += e;
    }
    return s;
}

#ifdef HAVE_AVX2
/* acc[g] += sum_t p[g][t] v_t for a tile of GT heads of one GQA group over a 32-wide slice of D:
 * each V row slice is loaded once for the tile; 4*GT accumulators stay in registers over the block. */
static inline __attribute__((always_inline)) void values_tile(const int GT, const float *p, int64_t S,
        const float *v, int64_t tok_stride, int64_t nt, float *acc, int64_t D, int64_t i) {
    __m256 r[3][4];
#pragma GCC unroll 3
    for (int g = 0; g < GT; g++)
        for (int c = 0; c < 4; c++) r[g][c] = _mm256_loadu_ps(acc + g * D + i + 8 * c);
    for (int64_t j = 0; j < nt; j++) {
        const float *vp = v + j * tok_stride + i;
        const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8), v2 = _mm256_loadu_ps(vp + 16),
                     v3 = _mm256_loadu_ps(vp + 24);
#pragma GCC unroll 3
        for (int g = 0; g < GT; g++) {
            const __m256 pg = _mm256_set1_ps(p[g * S + j]);
            r[g][0] = _mm256_fmadd_ps(pg, v0, r[g][0]);
            r[g][1] = _mm256_fmadd_ps(pg, v1, r[g][1]);
            r[g][2] = _mm256_fmadd_ps(pg, v2, r[g][2]);
            r[g][3] = _mm256_fmadd_ps(pg, v3, r[g][3]);
        }
    }
#pragma GCC unroll 3
    for (int g = 0; g < GT; g++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + g * D + i + 8 * c, r[g][c]);
}
#endif

/* acc_g += p_{g,t} v_t for query heads g < nh (kv head g / G) and the nt tokens of one block;
 * prefetches `next` over its head tiles and slices. */
static inline void block_values(const float *scores, const float *vb, int64_t tok_stride, int64_t nt, int64_t nh,
                                int64_t G, int64_t D, int64_t S, int64_t t0, float *acc, ahead_t *next) {
#ifdef HAVE_AVX2
    if ((D & 7) == 0) {
        for (int64_t g = 0; g < nh;) {  /* tiles of up to 3 heads within one GQA group */
            const int64_t left = G - g % G, gt = left < 3 ? left : 3;
            const float *vg = vb + (g / G) * D, *pg = scores + g * S + t0;
            int64_t i = 0;
            for (; i + 32 <= D; i += 32) {
                fetch_ahead(next);
                if (gt == 3) values_tile(3, pg, S, vg, tok_stride, nt, acc + g * D, D, i);
                else if (gt == 2) values_tile(2, pg, S, vg, tok_stride, nt, acc + g * D, D, i);
                else values_tile(1, pg, S, vg, tok_stride, nt, acc + g * D, D, i);
            }
            if (i < D) fetch_ahead(next);
            for (; i < D; i += 8)  /* a head size that is not a multiple of 32: 8 wide */
                for (int64_t h = 0; h < gt; h++) {
                    float *a = acc + (g + h) * D + i;
                    __m256 r = _mm256_loadu_ps(a);
                    for (int64_t j = 0; j < nt; j++)
                        r = _mm256_fmadd_ps(_mm256_set1_ps(pg[h * S + j]), _mm256_loadu_ps(vg + j * tok_stride + i), r);
                    _mm256_storeu_ps(a, r);
                }
            g += gt;
        }
        return;
    }
#endif
    (void)next;
    for (int64_t j = 0; j < nt; j++) {
        const float *row = vb + j * tok_stride;
        for (int64_t g = 0; g < nh; g++) {
            const float *vp = row + (g / G) * D;
            const float p = scores[g * S + t0 + j];
            float *a = acc + g * D;
            for (int64_t i = 0; i < D; i++) a[i] += p * vp[i];
        }
    }
}

/* Decode attention over the paged cache: one query row per sequence, every head.
 *   q    [num_seqs] rows of [H, D] (row stride q_row_stride);  out [num_seqs, H, D] contiguous
 *   key_cache / value_cache [num_blocks, block_size, H_kv, D];  block_tables [num_seqs, bt_stride]
 *   seq_lens [num_seqs]: keys 0 .. seq_len-1 are attended.
 * One work item = a sequence and a span of its KV heads with their GQA groups of query heads: K and
 * V are read straight from the cache, block by block, each token row once per item (no gather, no
 * GQA expansion).  With enough sequences a span is all KV heads (whole contiguous token rows);
 * otherwise one KV head, so a few long sequences still spread over the threads; either way the next
 * block's lines of the item's heads are prefetched while a block is read (an item of one KV head reads
 * slices of its token rows, which the hardware prefetcher left to memory latency: one stream, 30 layers
 * of 660 tokens, 3 KV heads of 64, 2 threads, Zen 4: 3.6 -> 2.4 ms).  Exact softmax in
 * two passes over a score buffer [heads, S].  Query heads of one GQA group go through K and V in tiles
 * of up to 3 (scores_tile, values_tile), so each row is loaded once per tile, not once per head
 * (64 sequences x 200 tokens, 30 layers, 2 threads: 33 -> 30 ms on the reference machine). */
static float row_max(const float *s, int64_t n) {
    float m = -INFINITY;
    int64_t t = 0;
#ifdef HAVE_AVX2
    if (n >= 8) {
        __m256 mv = _mm256_loadu_ps(s);
        for (t = 8; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* A layer's departures from plain causal attention (attention/backend.py's AttentionOptions); NULL = none.
 *   window   > 0: a query at position p sees keys p - window + 1 .. p only (blocks wholly before are not read)
 *   softcap  > 0: scaled scores s -> softcap * tanh(s / softcap), before the softmax
 *   sinks    [num_heads] or NULL: one extra logit per query head in the softmax's denominator */
typedef struct {
    int64_t window;
    float softcap;
    const float *sinks;
} attn_opts_t;

/* the first key a query at position `pos` sees */
static inline int64_t window_start(const attn_opts_t *o, int64_t pos) {
    return o && o->window > 0 && pos + 1 > o->window ? pos + 1 - o->window : 0;
}

/* s[t] = softcap * tanh(s[t] / softcap) for t < n; returns their maximum */
static float softcap_scores(float *s, int64_t n, float cap) {
    float m = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        s[t] = cap * tanhf(s[t] / cap);
        m = s[t] > m ? s[t] : m;
    }
    return m;
}

/* The softmax of one row's scores s[lo .. S) with the options' cap and sink (head h): s[lo ..) become the
 * numerators, s[base .. lo) zero (keys the window drops inside a block still read); returns the denominator. */
static float options_softmax(float *s, int64_t base, int64_t lo, int64_t S, float m, const attn_opts_t *o, int64_t h) {
    if (o->softcap > 0) m = softcap_scores(s + lo, S - lo, o->softcap);
    const float sink = o->sinks ? o->sinks[h] : -INFINITY;
    m = sink > m ? sink : m;
    float sum = softmax_numerators(s + lo, S - lo, m);
    if (o->sinks) sum += expf(sink - m);
    for (int64_t t = base; t < lo; t++) s[t] = 0.f;
    return sum;
}

static void decode_attention(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                             const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                             const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, const attn_opts_t *opts,
                             int nthreads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t tok_stride = num_kv_heads * D;
    const int64_t span = num_seqs >= 2 * (int64_t)nthreads ? num_kv_heads : 1;  /* KV heads per item */
    const int64_t spans = num_kv_heads / span;
    const int64_t items = num_seqs * spans;
    const int64_t nh = span * G;  /* query heads per item */
    /* prefetching the next block's lines of the item's KV heads (fetch_ahead), spread over the calls a
     * block's head tiles (and 32-wide value slices) make */
    const int64_t width = span * D;  /* of each token row, the floats an item reads */
    const int64_t tiles = span * ((G + 2) / 3);
    const int64_t score_calls = tiles, value_calls = tiles * ((D + 31) / 32);
#pragma omp parallel num_threads(nthreads) if (items > 1)
    {
        int64_t cap = 0;
        float *scores = NULL;
        float *acc = (float *)kernel_scratch((size_t)(nh * D) * sizeof(float));
        float *mx = (float *)kernel_scratch((size_t)nh * sizeof(float));
        float *sum = (float *)kernel_scratch((size_t)nh * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t sq = it / spans, kv0 = (it % spans) * span;
            const int64_t S = seq_lens[sq];
            if (S * nh > cap) {
                cap = S * nh;
                free(scores);
                scores = (float *)kernel_scratch((size_t)cap * sizeof(float));
            }
            const int32_t *bt = block_tables + sq * bt_stride;
            const float *qs = q + sq * q_row_stride + kv0 * G * D;
            const int64_t lo = window_start(opts, S - 1), b0 = lo / block_size;  /* the window's first key, block */
            for (int64_t g = 0; g < nh; g++) mx[g] = -INFINITY;
            for (int64_t b = b0, t0 = b0 * block_size; t0 < S; b++, t0 += block_size) {  /* pass 1: scores */
                const int64_t nt = S - t0 < block_size ? S - t0 : block_size;
                const float *kb = key_cache + (int64_t)bt[b] * block_size * tok_stride + kv0 * D;
                /* next: K block b + 1, after the last one the window's first V block */
                ahead_t next = t0 + block_size < S
                                   ? block_ahead(key_cache, bt, b + 1, S, block_size, tok_stride, kv0 * D, width, score_calls)
                                   : block_ahead(value_cache, bt, b0, S, block_size, tok_stride, kv0 * D, width, score_calls);
                block_scores(qs, kb, tok_stride, nt, nh, G, D, scale, scores, S, t0, mx, &next);
            }
            if (opts) {  /* pass 2 */
                for (int64_t g = 0; g < nh; g++) {
                    float *sg = scores + g * S;
                    const float m = lo > b0 * block_size ? row_max(sg + lo, S - lo) : mx[g];
                    sum[g] = options_softmax(sg, b0 * block_size, lo, S, m, opts, kv0 * G + g);
                }
            } else {
                for (int64_t g = 0; g < nh; g++) sum[g] = softmax_numerators(scores + g * S, S, mx[g]);
            }
            memset(acc, 0, (size_t)(nh * D) * sizeof(float));
            for (int64_t b = b0, t0 = b0 * block_size; t0 < S; b++, t0 += block_size) {  /* pass 3: weighted values */
                const int64_t nt = S - t0 < block_size ? S - t0 : block_size;
                const float *vb = value_cache + (int64_t)bt[b] * block_size * tok_stride + kv0 * D;
                ahead_t next = block_ahead(value_cache, bt, b + 1, S, block_size, tok_stride, kv0 * D, width,
                                                 value_calls);
                block_values(scores, vb, tok_stride, nt, nh, G, D, S, t0, acc, &next);
            }
            for (int64_t g = 0; g < nh; g++) {
                float *o = out + (sq * num_heads + kv0 * G + g) * D;
                const float inv = 1.0f / sum[g];
                const float *a = acc + g * D;
                for (int64_t i = 0; i < D; i++) o[i] = a[i] * inv;
            }
        }
        free(scores);
        free(acc);
        free(mx);
        free(sum);
    }
}

void paged_decode_attention_f32(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                                const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                                const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale, int nthreads) {
    decode_attention(q, q_row_stride, out, key_cache, value_cache, block_tables, bt_stride, seq_lens, num_seqs,
                     num_heads, num_kv_heads, head_dim, block_size, scale, NULL, nthreads);
}

/* The same with AttentionOptions: window (0 = none), softcap (0 = none), sinks (NULL = none). */
void paged_decode_attention_opts_f32(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                                     const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                                     const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                     int64_t window, float softcap, const float *sinks, int nthreads) {
    const attn_opts_t o = {window, softcap, sinks};
    decode_attention(q, q_row_stride, out, key_cache, value_cache, block_tables, bt_stride, seq_lens, num_seqs,
                     num_heads, num_kv_heads, head_dim, block_size, scale, &o, nthreads);
}

/* The gated activations on a merged [gate | up] row pair: out[r, i] = act(x[r, i]) * x[r, d + i], both
 * act(g) = g / (1 + exp(z)), in the lanes and the tail with the same operations (exp256 / exp_clamped, whose
 * clamp keeps large |g| finite):
 *   SiLU (SwiGLU)        z = -g
 *   tanh-GELU (GeGLU)    z = -2 sqrt(2 / pi) (g + 0.044715 g^3): gelu_tanh(g) = g (1 + tanh(y)) / 2 with
 *                        y = sqrt(2 / pi) (g + 0.044715 g^3), and (1 + tanh y) / 2 is sigmoid(2 y) */
#define GELU_CUBE 0.044715f
#define GELU_MINUS_2K -1.5957691216057308f /* -2 sqrt(2 / pi) */
static inline __attribute__((always_inline)) void gated_and_mul(const float *x, float *out, int64_t rows, int64_t d,
                                                                int gelu, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * d > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * d, *u = g + d;
        float *o = out + r * d;
        int64_t i = 0;
#ifdef HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        const __m256 cube = _mm256_set1_ps(GELU_CUBE), k2 = _mm256_set1_ps(GELU_MINUS_2K);
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 z = gelu ? _mm256_mul_ps(k2, _mm256_add_ps(gv, _mm256_mul_ps(cube, _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv))))
                                  : _mm256_sub_ps(zero, gv);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(z)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < d; i++) {
            const float z = gelu ? GELU_MINUS_2K * (g[i] + GELU_CUBE * (g[i] * g[i] * g[i])) : -g[i];
            const float s = g[i] / (1.0f + exp_clamped(z));
            o[i] = s * u[i];
        }
    }
}

void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads) {
    gated_and_mul(x, out, rows, d, 0, nthreads);
}

void gelu_tanh_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads) {
    gated_and_mul(x, out, rows, d, 1, nthreads);
}

/* acc[0..n) = x[k0..k1) W[k0..k1, 0..n) for W stored [in x out]-major (row k at w + k * ldw): four
 * weight rows per sweep of the accumulators */
static void gemv_rows(const float *x, const float *w, int64_t ldw, int64_t k0, int64_t k1, int64_t n, float *acc) {
    for (int64_t j = 0; j < n; j++) acc[j] = 0.f;
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
        const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
        const float *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) acc[j] = (((acc[j] + x0 * w0[j]) + x1 * w1[j]) + x2 * w2[j]) + x3 * w3[j];
    }
    for (; k < k1; k++) {
        const float xk = x[k];
        const float *wr = w + k * ldw;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) acc[j] += xk * wr[j];
    }
}

/* How many runs of weight rows a GEMV of K inputs cuts among nthreads threads (at least 16 rows a run). */
static int64_t gemv_runs(int64_t K, int nthreads) {
    const int64_t T = K / 16 < nthreads ? K / 16 : nthreads;
    return T < 1 ? 1 : T;
}

/* y[N] = x[K] W (+ bias) for one row x and a weight stored [in x out]-major (row k of W at w + k * ldw):
 * a single-stream decode step's projections, bound by reading W.  The weight rows are cut into
 * T = gemv_runs(K, nthreads) runs, each streamed by one thread into its own partial sums (in L1/L2),
 * then each thread adds up a slice of the columns over the partials (in run order: the result depends
 * on T alone, not on timing nor on how many threads OpenMP grants; gemv_column is the same sum for one
 * column).  Cutting the columns instead made every thread read short strided pieces of each row, which
 * the hardware prefetcher follows worse (the default model's 121 projections of a step, 2 threads:
 * ~19-20 -> ~17-18.5 ms).  (MKL's GEMV runs on one thread whatever the count.) */
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t K, int64_t N, int64_t ldw,
              int nthreads) {
    const int64_t T = gemv_runs(K, nthreads);
    float *part = (float *)kernel_scratch((size_t)(T * N) * sizeof(float));
#pragma omp parallel num_threads((int)T) if (T > 1)
    {
        const int64_t t0 = omp_get_thread_num(), nt = omp_get_num_threads();  /* nt <= T */
        for (int64_t t = t0; t < T; t += nt) gemv_rows(x, w, ldw, K * t / T, K * (t + 1) / T, N, part + t * N);
#pragma omp barrier
        for (int64_t j = N * t0 / nt; j < N * (t0 + 1) / nt; j++) {
            float s = part[j];
            for (int64_t u = 1; u < T; u++) s += part[u * N + j];
            y[j] = bias ? s + bias[j] : s;
        }
    }
    free(part);
}

/* Column j of gemv_f32 without bias: the same runs, the same order of products and sums (gemv_rows
 * for one column), so the same bits. */
static float gemv_column(const float *x, const float *w, int64_t ldw, int64_t K, int64_t j, int64_t T) {
    float s = 0.f;
    for (int64_t t = 0; t < T; t++) {
        const int64_t k1 = K * (t + 1) / T;
        int64_t k = K * t / T;
        float acc = 0.f;
        for (; k + 4 <= k1; k += 4)
            acc = (((acc + x[k] * w[k * ldw + j]) + x[k + 1] * w[(k + 1) * ldw + j]) + x[k + 2] * w[(k + 2) * ldw + j])
                  + x[k + 3] * w[(k + 3) * ldw + j];
        for (; k < k1; k++) acc += x[k] * w[k * ldw + j];
        s = t ? s + acc : acc;
    }
    return s;
}

/* ---- GEMM over a weight packed into column panels ------------------------------------------------
 * C[M x N] = A[M x K] W (+ bias), W stored as panels of 16 output columns: panel p holds W[k][16p..16p+15]
 * for k = 0..K-1 contiguously (zero padded past N), so a panel streams from memory in one sequential
 * run.  Each panel is multiplied with tiles of up to 6 rows (6 x 16 accumulators: 12 AVX2 registers, the
 * two weight vectors of one k and one broadcast input keep 15 of 16 busy).  Rows are spread evenly over
 * the tiles (37 rows: 5,5,5,5,5,6,6, never a 1-row tail) so every tile has enough independent FMAs.
 * The AVX-512 build takes two adjacent panels per tile (gemm_tile_pair: 12 zmm accumulators).
 * The first row block prefetches the panel after the current one while it works (the weights come from
 * DRAM at decode batch sizes); later row blocks find it in L2.  Work items are (group of panels, block of
 * up to 96 rows), so big batches keep their input rows and a panel group in cache.  At decode batch sizes
 * this runs at ~150-190 GFLOP/s on the 2-core reference machine where MKL (which re-packs the weight on
 * every call) and oneDNN with a pre-packed weight reach ~55-145. */
#define GEMM_NR 16
#define GEMM_MR 6
#define GEMM_MB 96

void pack_panels_f32(const float *w, int64_t K, int64_t N, int64_t ldw, float *out) {
    const int64_t np = (N + GEMM_NR - 1) / GEMM_NR;
    for (int64_t p = 0; p < np; p++) {
        const int64_t n0 = p * GEMM_NR, nn = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
        float *dst = out + p * K * GEMM_NR;
        for (int64_t k = 0; k < K; k++) {
            const float *src = w + k * ldw + n0;
            int64_t j = 0;
            for (; j < nn; j++) dst[k * GEMM_NR + j] = src[j];
            for (; j < GEMM_NR; j++) dst[k * GEMM_NR + j] = 0.f;
        }
    }
}

#ifdef HAVE_AVX2
/* a tile's sums (two 8-lane halves per row) -> c: + bias, or SiLU-and-mul with the gate tile, or only
 * the valid columns of the zero-padded last panel */
static inline __attribute__((always_inline)) void tile_epilogue(const int MR, __m256 acc[][2], float *c, int64_t ldc,
                                                                const float *bias, int64_t nn, const float *gate) {
    __m256 bb0 = _mm256_setzero_ps(), bb1 = _mm256_setzero_ps();
    if (bias && nn == GEMM_NR) {
        bb0 = _mm256_loadu_ps(bias);
        bb1 = _mm256_loadu_ps(bias + 8);
    }
    if (gate) {  /* SiLU-and-mul epilogue: c = silu(gate) * (a . b), gate a full MR x 16 tile (row stride 16) */
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++)
            for (int h = 0; h < 2; h++) {
                const __m256 gv = _mm256_loadu_ps(gate + i * GEMM_NR + 8 * h);
                const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
                _mm256_storeu_ps(c + i * ldc + 8 * h, _mm256_mul_ps(sv, acc[i][h]));
            }
        return;
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        if (nn == GEMM_NR) {  /* the common case: straight to C */
            _mm256_storeu_ps(c + i * ldc, _mm256_add_ps(acc[i][0], bb0));
            _mm256_storeu_ps(c + i * ldc + 8, _mm256_add_ps(acc[i][1], bb1));
        } else {  /* the zero-padded last panel: only its valid columns */
            float row[GEMM_NR];
            _mm256_storeu_ps(row, acc[i][0]);
            _mm256_storeu_ps(row + 8, acc[i][1]);
            for (int64_t j = 0; j < nn; j++) c[i * ldc + j] = row[j] + (bias ? bias[j] : 0.f);
        }
    }
}
#endif

/* one tile: rows a[0..MR) (row stride lda) times one panel b -> c (row stride ldc), nn valid columns;
 * meanwhile prefetches pfn rows of the next panel from pf */
static inline __attribute__((always_inline)) void gemm_tile(const int MR, const float *a, int64_t lda,
        const float *b, int64_t K, float *c, int64_t ldc, const float *bias, int64_t nn, const float *pf,
        int64_t pfn, const float *gate, const float *cin) {
#ifdef HAVE_AVX2
    __m256 acc[GEMM_MR][2];
#if defined(__AVX512F__)
    /* the AVX-512 build: a row's 16 columns in one register, so one FMA instruction where AVX2 takes
     * two (on CPUs with full-width AVX-512 units, e.g. Intel's, twice the FLOPs per cycle; each
     * column's chain of FMAs over k is the same, so the values are the AVX2 build's bit for bit); the
     * epilogue below takes the two halves */
    __m512 acc16[GEMM_MR];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) acc16[i] = cin ? _mm512_loadu_ps(cin + i * GEMM_NR) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        if (k < pfn) _mm_prefetch((const char *)(pf + k * GEMM_NR), _MM_HINT_T0);
        const __m512 bk = _mm512_loadu_ps(b + k * GEMM_NR);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) acc16[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), bk, acc16[i]);
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = _mm512_castps512_ps256(acc16[i]);
        acc[i][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc16[i]), 1));
    }
#else
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = cin ? _mm256_loadu_ps(cin + i * GEMM_NR) : _mm256_setzero_ps();
        acc[i][1] = cin ? _mm256_loadu_ps(cin + i * GEMM_NR + 8) : _mm256_setzero_ps();
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        if (k < pfn) _mm_prefetch((const char *)(pf + k * GEMM_NR), _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(b + k * GEMM_NR), b1 = _mm256_loadu_ps(b + k * GEMM_NR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            const __m256 ai = _mm256_broadcast_ss(a + i * lda + k);
            acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
#endif
    tile_epilogue(MR, acc, c, ldc, bias, nn, gate);
#else
    (void)pf; (void)pfn;
    float acc[GEMM_MR][GEMM_NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < GEMM_NR; j++) acc[i][j] = cin ? cin[i * GEMM_NR + j] : 0.f;
    for (int64_t k = 0; k < K; k++) {
        const float *bk = b + k * GEMM_NR;
        for (int i = 0; i < MR; i++) {
            const float ai = a[i * lda + k];
#pragma omp simd
            for (int j = 0; j < GEMM_NR; j++) acc[i][j] += ai * bk[j];
        }
    }
    if (gate) {
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < GEMM_NR; j++) {
                const float g = gate[i * GEMM_NR + j];
                c[i * ldc + j] = g / (1.0f + exp_clamped(-g)) * acc[i][j];
            }
        return;
    }
    for (int i = 0; i < MR; i++)
        for (int64_t j = 0; j < nn; j++) c[i * ldc + j] = acc[i][j] + (bias ? bias[j] : 0.f);
#endif
}

static void gemm_tile_rows(int rows, const float *a, int64_t lda, const float *b, int64_t K, float *c,
                           int64_t ldc, const float *bias, int64_t nn, const float *pf, int64_t pfn, const float *gate,
                           const float *cin) {
    switch (rows) {  /* a constant MR per case: the accumulators stay in registers */
    case 1: gemm_tile(1, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    case 2: gemm_tile(2, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    case 3: gemm_tile(3, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    case 4: gemm_tile(4, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    case 5: gemm_tile(5, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    default: gemm_tile(6, a, lda, b, K, c, ldc, bias, nn, pf, pfn, gate, cin); break;
    }
}

#if defined(__AVX512F__)
/* The AVX-512 build's tile over two adjacent panels (32 columns; the second panel bstride floats after
 * the first): 12 accumulators, and per k two weight loads and MR broadcasts for 2 x MR FMAs, where one
 * panel's tile takes one load and MR broadcasts for MR FMAs (load-bound, and MR = 6 independent FMA
 * chains cannot cover the FMA latency of two units).  Each column's FMA chain over k is gemm_tile's, and
 * each panel then takes gemm_tile's epilogue, so the values are the same bit for bit.  Panel q's output
 * is at c + q * cstep, its gate and running sums at gate / cin + q * pstep. */
#define PAIR_TILES 1
static inline __attribute__((always_inline)) void gemm_tile_pair(const int MR, const float *a, int64_t lda,
        const float *b, int64_t bstride, int64_t K, float *c, int64_t ldc, int64_t cstep, const float *bias,
        int64_t nn0, int64_t nn1, const float *pf, int64_t pfn, const float *gate, const float *cin, int64_t pstep) {
    __m512 acc16[2][GEMM_MR];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++)
        for (int q = 0; q < 2; q++)
            acc16[q][i] = cin ? _mm512_loadu_ps(cin + q * pstep + i * GEMM_NR) : _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; k++) {
        if (k < pfn) {
            _mm_prefetch((const char *)(pf + k * GEMM_NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + bstride + k * GEMM_NR), _MM_HINT_T0);
        }
        const __m512 b0 = _mm512_loadu_ps(b + k * GEMM_NR), b1 = _mm512_loadu_ps(b + bstride + k * GEMM_NR);
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            const __m512 ai = _mm512_set1_ps(a[i * lda + k]);
            acc16[0][i] = _mm512_fmadd_ps(ai, b0, acc16[0][i]);
            acc16[1][i] = _mm512_fmadd_ps(ai, b1, acc16[1][i]);
        }
    }
    for (int q = 0; q < 2; q++) {
        __m256 acc[GEMM_MR][2];
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            acc[i][0] = _mm512_castps512_ps256(acc16[q][i]);
            acc[i][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc16[q][i]), 1));
        }
        tile_epilogue(MR, acc, c + q * cstep, ldc, bias ? bias + q * GEMM_NR : 0, q ? nn1 : nn0,
                      gate ? gate + q * pstep : 0);
    }
}

static void gemm_tile_pair_rows(int rows, const float *a, int64_t lda, const float *b, int64_t bstride, int64_t K,
                                float *c, int64_t ldc, int64_t cstep, const float *bias, int64_t nn0, int64_t nn1,
                                const float *pf, int64_t pfn, const float *gate, const float *cin, int64_t pstep) {
    switch (rows) {
    case 1: gemm_tile_pair(1, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    case 2: gemm_tile_pair(2, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    case 3: gemm_tile_pair(3, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    case 4: gemm_tile_pair(4, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    case 5: gemm_tile_pair(5, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    default: gemm_tile_pair(6, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep); break;
    }
}
#else
#define PAIR_TILES 0
#endif

/* the tiles of one or (two, where the build has PAIR_TILES) two adjacent panels: the second panel's
 * operands at bstride / cstep / pstep past the first's (see gemm_tile_pair) */
static void tiles_rows(int two, int rows, const float *a, int64_t lda, const float *b, int64_t bstride, int64_t K,
                       float *c, int64_t ldc, int64_t cstep, const float *bias, int64_t nn0, int64_t nn1,
                       const float *pf, int64_t pfn, const float *gate, const float *cin, int64_t pstep) {
#if PAIR_TILES
    if (two) {
        gemm_tile_pair_rows(rows, a, lda, b, bstride, K, c, ldc, cstep, bias, nn0, nn1, pf, pfn, gate, cin, pstep);
        return;
    }
#endif
    (void)two; (void)bstride; (void)cstep; (void)nn1; (void)pstep;
    gemm_tile_rows(rows, a, lda, b, K, c, ldc, bias, nn0, pf, pfn, gate, cin);
}

/* K chunks per panel for one row block of several tiles (decode batch sizes): every tile runs over a
 * chunk of the panel (GEMM_KC_PER_TILE x tiles values of k, a few KB, from L1) before the next chunk,
 * with partial sums kept between chunks.  Without chunks the first tile pulled the whole panel from
 * DRAM while the others then computed from cache with the memory idle; chunked, the weight streams
 * at the pace of all tiles' compute (30 layers of the default model, weights cold, 2 threads: 8 rows
 * 22 -> 18 ms, 16 rows 27.5 -> 24, 37 rows 50 -> 47).  Sums are accumulated in the same order:
 * results are bit-identical.  Prefill-sized batches (several row blocks) keep whole panels. */
#define GEMM_KC_PER_TILE 24
static inline int64_t k_chunks(int64_t row_blocks, int64_t tiles, int64_t K) {
    return row_blocks == 1 && tiles > 1 ? (K + GEMM_KC_PER_TILE * tiles - 1) / (GEMM_KC_PER_TILE * tiles) : 1;
}

/* Panel groups of a packed GEMM with np output panels: groups of at most 8 weight panels (4 gate/up
 * pairs with silu), as many as a multiple of the thread count when there are enough; group gi holds
 * panels [gi * np / ng, (gi + 1) * np / ng), sizes differing by at most one. */
static int64_t panel_groups(int64_t np, int silu, int nthreads) {
    const int64_t gmax = silu ? 4 : 8;
    int64_t ng = (np + gmax - 1) / gmax;
    ng = (ng + nthreads - 1) / nthreads * nthreads;
    return ng > np ? np : ng;
}

/* One work item of a packed GEMM: panel group gi (of ng) times row block mi (of nmb). */
static void packed_gemm_item(const float *a, int64_t lda, const float *panels, const float *bias, float *c,
                             int64_t ldc, int64_t M, int64_t K, int64_t N, int silu, int64_t ng, int64_t nmb,
                             int64_t gi, int64_t mi) {
    const int64_t np = (N + GEMM_NR - 1) / GEMM_NR;
    /* partial sums between K chunks (panel q of a pair at + q * PART) */
    float part[2 * GEMM_MB * GEMM_NR], part_g[2 * GEMM_MB * GEMM_NR];
    const int64_t PART = GEMM_MB * GEMM_NR;
    const int64_t m_lo = mi * GEMM_MB, m_hi = M < m_lo + GEMM_MB ? M : m_lo + GEMM_MB;
    const int64_t tiles = (m_hi - m_lo + GEMM_MR - 1) / GEMM_MR;
    const int64_t nkc = k_chunks(nmb, tiles, K);
    const int64_t p_hi = (gi + 1) * np / ng;
    for (int64_t p = gi * np / ng, two; p < p_hi; p += 1 + two) {
        two = PAIR_TILES && p + 1 < p_hi;  /* two panels at a time (the AVX-512 build) */
        const float *bg = panels + p * K * GEMM_NR, *b = silu ? panels + (p + np) * K * GEMM_NR : bg;
        const int nxt = mi == 0 && p + 1 + two < p_hi;  /* the first row block prefetches the next panel(s) */
        const int64_t n0 = p * GEMM_NR, nn = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
        const int64_t step = (1 + two) * K * GEMM_NR;  /* from a panel to the next one this loop takes */
        for (int64_t kc = 0; kc < nkc; kc++) {
            const int64_t c0 = kc * K / nkc, c1 = (kc + 1) * K / nkc, last = kc == nkc - 1;
            int64_t m0 = m_lo;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t rows = (m_hi - m0 + (tiles - t) - 1) / (tiles - t);
                /* this tile's share of the prefetch of the next panel's chunk */
                const int64_t k0 = c0 + t * (c1 - c0) / tiles, k1 = c0 + (t + 1) * (c1 - c0) / tiles;
                const float *ak = a + m0 * lda + c0;
                float *pt = part + (m0 - m_lo) * GEMM_NR, *pg = part_g + (m0 - m_lo) * GEMM_NR;
                const int64_t nn1 = two ? (N - n0 - GEMM_NR < GEMM_NR ? N - n0 - GEMM_NR : GEMM_NR) : 0;
                if (silu)  /* the gate tile's sums stay in part_g for the up tile's last chunk */
                    tiles_rows(two, (int)rows, ak, lda, bg + c0 * GEMM_NR, K * GEMM_NR, c1 - c0, pg, GEMM_NR, PART, 0,
                               GEMM_NR, GEMM_NR, nxt ? bg + k0 * GEMM_NR + step : 0, nxt ? k1 - k0 : 0, 0,
                               kc ? pg : 0, PART);
                tiles_rows(two, (int)rows, ak, lda, b + c0 * GEMM_NR, K * GEMM_NR, c1 - c0,
                           last ? c + m0 * ldc + n0 : pt, last ? ldc : GEMM_NR, last ? GEMM_NR : PART,
                           last && bias ? bias + n0 : 0, last ? nn : GEMM_NR, last ? nn1 : GEMM_NR,
                           nxt ? b + k0 * GEMM_NR + step : 0, nxt ? k1 - k0 : 0, silu && last ? pg : 0,
                           kc ? pt : 0, PART);
                m0 += rows;
            }
        }
    }
}

/* The driver of both packed GEMMs.  silu == 0: c [M x N] = a W^T (+ bias).  silu == 1: W holds
 * [W_g; W_u] (2N columns, N a multiple of 16) and c [M x N] = silu(a W_g^T) * (a W_u^T): gate panel p
 * pairs with up panel p + N/16, the gate tile's sums stay in a scratch in L1 and the up tile's
 * epilogue combines them, so the [M x 2N] intermediate is never written (2048 rows of the default
 * model: 25 MB a layer); values are those of the plain GEMM followed by silu_and_mul_f32. */
static void packed_gemm(const float *a, int64_t lda, const float *panels, const float *bias, float *c, int64_t ldc,
                        int64_t M, int64_t K, int64_t N, int silu, int nthreads) {
    const int64_t np = (N + GEMM_NR - 1) / GEMM_NR;  /* output panels (gate panels with silu) */
    const int64_t nmb = (M + GEMM_MB - 1) / GEMM_MB;
    const int64_t ng = panel_groups(np, silu, nthreads);
    const int64_t items = ng * nmb;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (items > 1)
    for (int64_t it = 0; it < items; it++)
        packed_gemm_item(a, lda, panels, bias, c, ldc, M, K, N, silu, ng, nmb, it / nmb, it % nmb);
}

void gemm_packed_f32(const float *a, int64_t lda, const float *panels, const float *bias, float *c, int64_t ldc,
                     int64_t M, int64_t K, int64_t N, int nthreads) {
    packed_gemm(a, lda, panels, bias, c, ldc, M, K, N, 0, nthreads);
}

/* The MLP's gate/up projection with SiLU-and-mul fused in (see packed_gemm): d a multiple of 16. */
void gemm_packed_silu_mul_f32(const float *a, int64_t lda, const float *panels, float *c, int64_t ldc,
                              int64_t M, int64_t K, int64_t d, int nthreads) {
    packed_gemm(a, lda, panels, 0, c, ldc, M, K, d, 1, nthreads);
}

/* ---- MoE experts --------------------------------------------------------------------------------
 * A MoE layer's routed-expert compute in one call: one OpenMP team for the whole layer instead of two
 * native calls (two team wake-ups, each too small to keep both cores streaming) per active expert.
 * The N*k (token, slot) pairs are R rows sorted by expert: sorted row r belongs to token row_token[r],
 * expert e owns sorted rows offsets[e] .. offsets[e+1]; (token t, slot j) sits at sorted row
 * slot_row[t*k + j] with routing weight slot_weight[t*k + j].  Phases, split by the team's barriers:
 *   gather   xs[r] = x[row_token[r]]
 *   gate/up  hs[rows of e] = silu(xs W_g,e^T) * (xs W_u,e^T)   (expert e's packed [2I x H] panels)
 *   down     ys[rows of e] = hs W_2,e^T                        (expert e's packed [H x I] panels)
 *   combine  out[t] = sum over j in slot order of slot_weight[t*k + j] * ys[slot_row[t*k + j]]
 * The GEMM work items -- (expert, block of up to 96 rows, panel group) over every active expert -- are
 * dealt dynamically, so at decode, where each expert has a few rows, all experts' panels stream
 * through both cores back to back.  Each item computes exactly what packed_gemm's item does for that
 * expert alone, so rows get the bits of the per-expert calls.  On that route (plain SiLU) I must be a multiple of 16.
 *
 * Options, for gpt-oss's experts: biases (b13 [E, 2I] on the gate/up projection, b2 [E, H] on
 * the down projection, before the routing weight; NULL: none) and the activation act (MOE_ACT_SILU, or
 * MOE_ACT_CLAMPED_SWIGLU: gate g = min(g, limit), up u clamped to [-limit, limit], (u + 1) g sigmoid(alpha g),
 * in the order of HF's GptOssExperts).  Unless the experts are plain SiLU without b13 (the fused route
 * above), the gate/up phase writes the whole [rows x 2I] projection with its bias into gu, an activation
 * phase leaves act(gate, up) in each row's first I floats, and the down GEMM reads them at stride 2I; I then
 * need not be a multiple of 16.  hs is unused there (NULL allowed), gu unused on the fused route. */
#define MOE_ACT_SILU 0
#define MOE_ACT_CLAMPED_SWIGLU 1
typedef struct { int64_t e, mi, gi; } moe_item_t;

static int64_t moe_items(const int64_t *offsets, int64_t E, int64_t ng, moe_item_t *items) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t nmb = (offsets[e + 1] - offsets[e] + GEMM_MB - 1) / GEMM_MB;
        for (int64_t mi = 0; mi < nmb; mi++)
            for (int64_t gi = 0; gi < ng; gi++) {
                if (items) items[n] = (moe_item_t){e, mi, gi};
                n++;
            }
    }
    return n;
}

/* One row's clamped SwiGLU over [gate | up] (2I floats at gu) into out[0..I) (out may be gu itself: each lane
 * reads its gate and up before writing where the gate was). */
static void clamped_swiglu_row(const float *gu, float *out, int64_t I, float alpha, float limit) {
    const float *g = gu, *u = gu + I;
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), nalpha = _mm256_set1_ps(-alpha);
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_min_ps(_mm256_loadu_ps(g + i), lim);
        const __m256 uv = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(u + i), lim), nlim);
        const __m256 glu = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_mul_ps(nalpha, gv))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_add_ps(uv, one), glu));
    }
#endif
    for (; i < I; i++) {
        const float gi = g[i] < limit ? g[i] : limit;
        const float ui = u[i] < limit ? (u[i] > -limit ? u[i] : -limit) : limit;
        out[i] = (ui + 1.0f) * (gi / (1.0f + exp_clamped(-alpha * gi)));
    }
}

void moe_experts_f32(const float *x, int64_t ldx, int64_t N, int64_t k, const int64_t *row_token,
                     const int64_t *slot_row, const float *slot_weight, const int64_t *offsets, int64_t E,
                     const float *w13, const float *w2, const float *b13, const float *b2, int act, float alpha,
                     float limit, int64_t H, int64_t I, float *xs, float *hs, float *gu, float *ys, float *out,
                     int nthreads) {
    const int64_t R = N * k, np2 = (H + GEMM_NR - 1) / GEMM_NR, np1 = (2 * I + GEMM_NR - 1) / GEMM_NR;
    const int fused = act == MOE_ACT_SILU && !b13;  /* SiLU-and-mul in the gate/up GEMM's epilogue */
    const int64_t w13_size = np1 * GEMM_NR * H, w2_size = np2 * GEMM_NR * I;  /* floats per expert */
    const int64_t ng1 = fused ? panel_groups(I / GEMM_NR, 1, nthreads) : panel_groups(np1, 0, nthreads);
    const int64_t ng2 = panel_groups(np2, 0, nthreads);
    const int64_t n1 = moe_items(offsets, E, ng1, 0), n2 = moe_items(offsets, E, ng2, 0);
    /* the down GEMM's input: hs [R x I], or the activations left in gu's rows (stride 2I) */
    float *h_in = fused ? hs : gu;
    const int64_t ldh = fused ? I : 2 * I;
    moe_item_t *items1 = malloc((size_t)(n1 + n2 + 1) * sizeof(moe_item_t)), *items2 = items1 + n1;
    if (!items1) return;
    moe_items(offsets, E, ng1, items1);
    moe_items(offsets, E, ng2, items2);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) memcpy(xs + r * H, x + row_token[r] * ldx, (size_t)H * sizeof(float));
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < n1; it++) {
            const moe_item_t m = items1[it];
            const int64_t o = offsets[m.e], M = offsets[m.e + 1] - o, nmb = (M + GEMM_MB - 1) / GEMM_MB;
            if (fused)
                packed_gemm_item(xs + o * H, H, w13 + m.e * w13_size, 0, hs + o * I, I, M, H, I, 1, ng1, nmb, m.gi, m.mi);
            else
                packed_gemm_item(xs + o * H, H, w13 + m.e * w13_size, b13 ? b13 + m.e * 2 * I : 0, gu + o * 2 * I,
                                 2 * I, M, H, 2 * I, 0, ng1, nmb, m.gi, m.mi);
        }
        if (!fused) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                float *row = gu + r * 2 * I;
                if (act == MOE_ACT_SILU)
                    gated_and_mul(row, row, 1, I, 0, 1);
                else
                    clamped_swiglu_row(row, row, I, alpha, limit);
            }
        }
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < n2; it++) {
            const moe_item_t m = items2[it];
            const int64_t o = offsets[m.e], M = offsets[m.e + 1] - o;
            packed_gemm_item(h_in + o * ldh, ldh, w2 + m.e * w2_size, b2 ? b2 + m.e * H : 0, ys + o * H, H, M, I, H,
                             0, ng2, (M + GEMM_MB - 1) / GEMM_MB, m.gi, m.mi);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N; t++) {
            float *o = out + t * H;
            for (int64_t j = 0; j < k; j++) {
                const float w = slot_weight[t * k + j], *yr = ys + slot_row[t * k + j] * H;
                if (j == 0) {
#pragma omp simd
                    for (int64_t h = 0; h < H; h++) o[h] = w * yr[h];
                } else {
#pragma omp simd
                    for (int64_t h = 0; h < H; h++) o[h] += w * yr[h];
                }
            }
        }
    }
    free(items1);
}

/* ---- prefill attention ------------------------------------------------------------------------
 * Prefill chunks over the paged cache: request r's query rows qsl[r] .. qsl[r+1] sit at positions
 * seq_lens[r] - C_r + i and attend causally to keys 0 .. seq_lens[r] - C_r + i, read through
 * block_tables[r] (the chunk's own K/V are in the cache already).  A work item is one request, one
 * KV head and a tile of up to PF_ROWS query rows (positions x the query heads of the GQA group, so
 * each K/V row serves all of them).  The scores are kept transposed, one row per key and one column
 * per query row, so that the keys are read in place from the cache blocks (nothing is transposed:
 * the cost of a chunk no longer grows with its prefix beyond the FLOPs themselves -- a 32-token chunk
 * over a 2k-token prefix once spent as long packing K^T panels of every prefix key as multiplying them):
 *   S^T [keys x rows] = K [keys x D] . Q^T, Q^T (scaled) packed into 16-column panels like a weight,
 *       6 keys x 16 (the AVX-512 build: 32) columns per register tile, each score's FMA chain over d;
 *   exact softmax per column over its causal span (window, soft-cap, sink), 8 columns per vector;
 *   out [rows x D] = P . V, V read straight from the cache blocks, 6 rows x 16 (AVX-512: 32) dims. */
#define PF_ROWS 48
#define PV_KEYS 64  /* keys per pass of P . V: 64 V rows of a 64..128-dim head, 16-32 KB, sit in L1 */

#ifdef HAVE_AVX2
/* o[i][0..W) (+)= sum_{t0 <= t < t1} p[i * ldi + t * ldt] v_t[0..W) for i < MR, V through the block table
 * (t0 a multiple of block_size; acc: add to o's sums so far, else start from zero): the AVX2 build 16 dims
 * (two registers a row), the AVX-512 build W = 32 (two zmm a row) where the caller has 32.  Every output's
 * FMA chain over t is the same whatever the width and however [0, T) is cut, so both builds give the same
 * bits. */
static inline __attribute__((always_inline)) void pv_tile(const int MR, const int W, const float *p, int64_t ldi,
        int64_t ldt, const float *v, const int32_t *bt, int64_t block_size, int64_t tok_stride, int64_t t0,
        int64_t t1, float *o, int64_t ldo, int acc_in) {
#if defined(__AVX512F__)
    __m512 acc[GEMM_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = acc_in ? _mm512_loadu_ps(o + i * ldo) : _mm512_setzero_ps();
        acc[i][1] = acc_in && W == 32 ? _mm512_loadu_ps(o + i * ldo + 16) : _mm512_setzero_ps();
    }
    for (int64_t tb = t0; tb < t1; tb += block_size) {
        const float *vb = v + (int64_t)bt[tb / block_size] * block_size * tok_stride;
        const int64_t nt = t1 - tb < block_size ? t1 - tb : block_size;
        const float *pt = p + tb * ldt;
        for (int64_t j = 0; j < nt; j++) {
            const float *vp = vb + j * tok_stride;
            const __m512 v0 = _mm512_loadu_ps(vp);
            const __m512 v1 = W == 32 ? _mm512_loadu_ps(vp + 16) : v0;
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++) {
                const __m512 pi = _mm512_set1_ps(pt[i * ldi + j * ldt]);
                acc[i][0] = _mm512_fmadd_ps(pi, v0, acc[i][0]);
                if (W == 32) acc[i][1] = _mm512_fmadd_ps(pi, v1, acc[i][1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(o + i * ldo, acc[i][0]);
        if (W == 32) _mm512_storeu_ps(o + i * ldo + 16, acc[i][1]);
    }
#else
    (void)W;
    __m256 acc[GEMM_MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        acc[i][0] = acc_in ? _mm256_loadu_ps(o + i * ldo) : _mm256_setzero_ps();
        acc[i][1] = acc_in ? _mm256_loadu_ps(o + i * ldo + 8) : _mm256_setzero_ps();
    }
    for (int64_t tb = t0; tb < t1; tb += block_size) {
        const float *vb = v + (int64_t)bt[tb / block_size] * block_size * tok_stride;
        const int64_t nt = t1 - tb < block_size ? t1 - tb : block_size;
        const float *pt = p + tb * ldt;
        for (int64_t j = 0; j < nt; j++) {
            const float *vp = vb + j * tok_stride;
            const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8);
#pragma GCC unroll 6
            for (int i = 0; i < MR; i++) {
                const __m256 pi = _mm256_broadcast_ss(pt + i * ldi + j * ldt);
                acc[i][0] = _mm256_fmadd_ps(pi, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(pi, v1, acc[i][1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(o + i * ldo, acc[i][0]);
        _mm256_storeu_ps(o + i * ldo + 8, acc[i][1]);
    }
#endif
}
#endif

/* The dims a pv_rows call covers: 32 in the AVX-512 build where 32 are left, else 16. */
static inline int64_t pv_width(int64_t left) {
#if defined(__AVX512F__)
    return left >= 32 ? 32 : 16;
#else
    (void)left;
    return 16;
#endif
}

/* o[i][0..w) (+)= sum_{t0 <= t < t1} p[i * ldi + t * ldt] v_t[0..w) for rows i < rows (w = pv_width), V
 * through the block table, as pv_tile */
static void pv_rows(int rows, int64_t w, const float *p, int64_t ldi, int64_t ldt, const float *v, const int32_t *bt,
                    int64_t block_size, int64_t tok_stride, int64_t t0, int64_t t1, float *o, int64_t ldo,
                    int acc_in) {
#ifdef HAVE_AVX2
#define PV_CASE(MR) \
    if (w == 32) pv_tile(MR, 32, p, ldi, ldt, v, bt, block_size, tok_stride, t0, t1, o, ldo, acc_in); \
    else pv_tile(MR, 16, p, ldi, ldt, v, bt, block_size, tok_stride, t0, t1, o, ldo, acc_in); \
    return;
    switch (rows) {
    case 1: PV_CASE(1)
    case 2: PV_CASE(2)
    case 3: PV_CASE(3)
    case 4: PV_CASE(4)
    case 5: PV_CASE(5)
    default: PV_CASE(6)
    }
#undef PV_CASE
#else
    if (!acc_in)
        for (int i = 0; i < rows; i++)
            for (int64_t c = 0; c < w; c++) o[i * ldo + c] = 0.f;
    for (int64_t t = t0; t < t1; t++) {
        const float *vp = v + ((int64_t)bt[t / block_size] * block_size + t % block_size) * tok_stride;
        for (int i = 0; i < rows; i++) {
            const float pi = p[i * ldi + t * ldt];
            for (int64_t c = 0; c < w; c++) o[i * ldo + c] += pi * vp[c];
        }
    }
#endif
}

/* The softmax of 8 query columns of transposed scores st[t * ld + c] (t < T, column c's keys lo[c] ..
 * hi[c] - 1, its sink logit sink[c] or -inf): with a soft-cap the scores are capped first; entries outside a
 * column's span become 0, the others its numerators; sum[c] gets the denominators.  Sums run over t in
 * order (one accumulator per column). */
static void softmax_columns8(float *st, int64_t ld, int64_t T, const int32_t *lo, const int32_t *hi,
                             const float *sink, float softcap, float *sum) {
    if (softcap > 0)
        for (int64_t t = 0; t < T; t++)
            for (int c = 0; c < 8; c++) st[t * ld + c] = softcap * tanhf(st[t * ld + c] / softcap);
#ifdef HAVE_AVX2
    const __m256i lov = _mm256_loadu_si256((const __m256i *)lo), hiv = _mm256_loadu_si256((const __m256i *)hi);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 m = _mm256_loadu_ps(sink);
    for (int64_t t = 0; t < T; t++) {  /* in span: lo <= t < hi */
        const __m256i tv = _mm256_set1_epi32((int32_t)t);
        const __m256 in = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lov, tv), _mm256_cmpgt_epi32(hiv, tv)));
        m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_loadu_ps(st + t * ld), in));
    }
    __m256 s = _mm256_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        const __m256i tv = _mm256_set1_epi32((int32_t)t);
        const __m256 in = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lov, tv), _mm256_cmpgt_epi32(hiv, tv)));
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(st + t * ld), m)), in);
        _mm256_storeu_ps(st + t * ld, e);
        s = _mm256_add_ps(s, e);
    }
    float mv[8];
    _mm256_storeu_ps(mv, m);
    _mm256_storeu_ps(sum, s);
    for (int c = 0; c < 8; c++)
        if (sink[c] > -INFINITY) sum[c] += exp_clamped(sink[c] - mv[c]);
#else
    for (int c = 0; c < 8; c++) {
        float m = sink[c];
        for (int64_t t = lo[c]; t < hi[c] && t < T; t++) m = st[t * ld + c] > m ? st[t * ld + c] : m;
        float s = 0.f;
        for (int64_t t = 0; t < T; t++) {
            const float e = t >= lo[c] && t < hi[c] ? exp_clamped(st[t * ld + c] - m) : 0.f;
            st[t * ld + c] = e;
            s += e;
        }
        sum[c] = sink[c] > -INFINITY ? s + exp_clamped(sink[c] - m) : s;
    }
#endif
}

#if defined(__AVX512F__)
/* softmax_columns8 over 16 columns at once (the AVX-512 build): each column's operations are the same, in
 * the same order, so the same bits */
static void softmax_columns16(float *st, int64_t ld, int64_t T, const int32_t *lo, const int32_t *hi,
                              const float *sink, float softcap, float *sum) {
    if (softcap > 0)
        for (int64_t t = 0; t < T; t++)
            for (int c = 0; c < 16; c++) st[t * ld + c] = softcap * tanhf(st[t * ld + c] / softcap);
    const __m512i lov = _mm512_loadu_si512(lo), hiv = _mm512_loadu_si512(hi);
    __m512 m = _mm512_loadu_ps(sink);
    for (int64_t t = 0; t < T; t++) {  /* in span: lo <= t < hi */
        const __m512i tv = _mm512_set1_epi32((int32_t)t);
        const __mmask16 in = _mm512_cmpgt_epi32_mask(hiv, tv) & ~_mm512_cmpgt_epi32_mask(lov, tv);
        m = _mm512_mask_max_ps(m, in, m, _mm512_loadu_ps(st + t * ld));
    }
    __m512 s = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        const __m512i tv = _mm512_set1_epi32((int32_t)t);
        const __mmask16 in = _mm512_cmpgt_epi32_mask(hiv, tv) & ~_mm512_cmpgt_epi32_mask(lov, tv);
        const __m512 e = _mm512_maskz_mov_ps(in, exp512(_mm512_sub_ps(_mm512_loadu_ps(st + t * ld), m)));
        _mm512_storeu_ps(st + t * ld, e);
        s = _mm512_add_ps(s, e);
    }
    float mv[16];
    _mm512_storeu_ps(mv, m);
    _mm512_storeu_ps(sum, s);
    for (int c = 0; c < 16; c++)
        if (sink[c] > -INFINITY) sum[c] += exp_clamped(sink[c] - mv[c]);
}
#endif

static void prefill_attention_tiles(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                                    const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                                    const int32_t *qsl, const int32_t *seq_lens, int64_t num_reqs,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                    float scale, const attn_opts_t *opts, int nthreads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, tok_stride = num_kv_heads * D;
    const int64_t P = G >= PF_ROWS ? 1 : PF_ROWS / G;  /* positions per item */
    const int64_t max_rows = P * G, npan_max = (max_rows + GEMM_NR - 1) / GEMM_NR, ld_max = npan_max * GEMM_NR;
    int64_t *first = (int64_t *)malloc((size_t)(num_reqs + 1) * sizeof(int64_t));  /* per request: its first item */
    int64_t tmax = 0;
    first[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t c = qsl[r + 1] - qsl[r];
        first[r + 1] = first[r] + num_kv_heads * ((c + P - 1) / P);
        tmax = seq_lens[r] > tmax ? seq_lens[r] : tmax;
    }
    const int64_t items = first[num_reqs];
    const float softcap = opts ? opts->softcap : 0.f;
    const int64_t pv_keys = block_size >= PV_KEYS ? block_size : PV_KEYS / block_size * block_size;
#pragma omp parallel num_threads(nthreads) if (items > 1)
    {
        float *qt = (float *)kernel_scratch((size_t)(npan_max * D * GEMM_NR) * sizeof(float));  /* Q^T panels */
        float *st = (float *)kernel_scratch((size_t)((tmax + GEMM_MR) * ld_max) * sizeof(float));  /* S^T */
        float *ot = (float *)kernel_scratch((size_t)(ld_max * D) * sizeof(float));
        float *sum = (float *)kernel_scratch((size_t)ld_max * sizeof(float));
        int32_t *lo = (int32_t *)kernel_scratch((size_t)ld_max * sizeof(int32_t));
        int32_t *hi = (int32_t *)kernel_scratch((size_t)ld_max * sizeof(int32_t));
        float *sink = (float *)kernel_scratch((size_t)ld_max * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t r = 0;
            while (first[r + 1] <= it) r++;
            const int64_t local = it - first[r], tiles = (first[r + 1] - first[r]) / num_kv_heads;
            const int64_t h = local / tiles, p0 = (local % tiles) * P;
            const int64_t c = qsl[r + 1] - qsl[r], S = seq_lens[r], start = S - c;
            const int64_t np = c - p0 < P ? c - p0 : P, rows = np * G;
            const int64_t npan = (rows + GEMM_NR - 1) / GEMM_NR, ld = npan * GEMM_NR;
            const int32_t *bt = block_tables + r * bt_stride;
            /* Q^T panels: column i = position p0 + i / G, query head h * G + i % G, scaled (the scores come
             * out scaled); padding columns zero, and no keys in their span */
            for (int64_t i = 0; i < ld; i++) {
                float *dst = qt + (i / GEMM_NR) * D * GEMM_NR + i % GEMM_NR;
                const int64_t pos = start + p0 + i / G;
                if (i < rows) {
                    const float *src = q + (qsl[r] + p0 + i / G) * q_row_stride + (h * G + i % G) * D;
                    for (int64_t d = 0; d < D; d++) dst[d * GEMM_NR] = src[d] * scale;
                    lo[i] = (int32_t)window_start(opts, pos);
                    hi[i] = (int32_t)(pos + 1);
                    sink[i] = opts && opts->sinks ? opts->sinks[h * G + i % G] : -INFINITY;
                } else {
                    for (int64_t d = 0; d < D; d++) dst[d * GEMM_NR] = 0.f;
                    lo[i] = hi[i] = 0;
                    sink[i] = -INFINITY;
                }
            }
            /* the keys the tile reads: from the block of its first row's window to its last row */
            const int64_t tr = start + p0 + np, b0 = window_start(opts, start + p0) / block_size;
            const int64_t t_lo = b0 * block_size, T = tr - t_lo;
            for (int64_t i = 0; i < ld; i++) {
                lo[i] = lo[i] > t_lo ? lo[i] - (int32_t)t_lo : 0;
                hi[i] = hi[i] > t_lo ? hi[i] - (int32_t)t_lo : 0;
            }
            /* S^T = K . Q^T, 6 keys of one block at a time, keys read in place */
            for (int64_t b = b0, t0 = t_lo; t0 < tr; b++, t0 += block_size) {
                const float *kb = key_cache + (int64_t)bt[b] * block_size * tok_stride + h * D;
                const int64_t nt = tr - t0 < block_size ? tr - t0 : block_size;
                for (int64_t j0 = 0; j0 < nt; j0 += GEMM_MR) {
                    const int mr = (int)(nt - j0 < GEMM_MR ? nt - j0 : GEMM_MR);
                    float *cst = st + (t0 - t_lo + j0) * ld;
                    for (int64_t pn = 0; pn < npan;) {
                        const int two = PAIR_TILES && pn + 1 < npan;
                        tiles_rows(two, mr, kb + j0 * tok_stride, tok_stride, qt + pn * D * GEMM_NR, D * GEMM_NR, D,
                                   cst + pn * GEMM_NR, ld, GEMM_NR, 0, GEMM_NR, GEMM_NR, 0, 0, 0, 0, 0);
                        pn += two ? 2 : 1;
                    }
                }
            }
#if defined(__AVX512F__)
            for (int64_t c16 = 0; c16 < ld; c16 += 16)  /* ld: whole panels of 16 */
                softmax_columns16(st + c16, ld, T, lo + c16, hi + c16, sink + c16, softcap, sum + c16);
#else
            for (int64_t c8 = 0; c8 < ld; c8 += 8)
                softmax_columns8(st + c8, ld, T, lo + c8, hi + c8, sink + c8, softcap, sum + c8);
#endif
            /* out = P . V (P^T's column i is row i's probabilities), PV_KEYS keys at a time for every row and
             * dim, so that those keys' V rows stay in L1 while all the rows' tiles use them */
            for (int64_t k0 = 0; k0 < T; k0 += pv_keys) {
                const int64_t k1 = T - k0 < pv_keys ? T : k0 + pv_keys;
                for (int64_t r0 = 0; r0 < rows; r0 += GEMM_MR) {
                    const int mr = (int)(rows - r0 < GEMM_MR ? rows - r0 : GEMM_MR);
                    for (int64_t c0 = 0; c0 < D;) {
                        const int64_t w = pv_width(D - c0);
                        pv_rows(mr, w, st + r0, 1, ld, value_cache + h * D + c0, bt + b0, block_size, tok_stride,
                                k0, k1, ot + r0 * D + c0, D, k0 > 0);
                        c0 += w;
                    }
                }
            }
            for (int64_t i = 0; i < rows; i++) {
                float *o = out + ((qsl[r] + p0 + i / G) * num_heads + h * G + i % G) * D;
                const float inv = 1.0f / sum[i];
                for (int64_t d = 0; d < D; d++) o[d] = ot[i * D + d] * inv;
            }
        }
        free(qt);
        free(st);
        free(ot);
        free(sum);
        free(lo);
        free(hi);
        free(sink);
    }
    free(first);
}

#define DECODE_LIKE_ROWS 8  /* requests of up to this many rows attend as decodes */

/* Attention of short requests (a decode with its speculative drafts: request r's rows are its last
 * qsl[r+1] - qsl[r] <= DECODE_LIKE_ROWS tokens, row i attending causally to the keys before and at it),
 * each row exactly decode_attention's at its own causal length, bit for bit, with the request's K and V
 * read once for all its rows rather than once per row.  One work item = a request and one KV head: its
 * rows' query heads of that group (rows x G of them) go through every block that all the rows see in
 * full as one group of heads (scores_tile and values_tile give a head the same value whatever tile it
 * shares); the last blocks, which rows see in part, go row by row with each row's own token count (a
 * block's last tokens past a multiple of 4 take scores_tile's one-token route, so the split follows the
 * row's length, as a decode's does).  Where requests x KV heads are fewer than two items a thread (a
 * single stream verifying its drafts: 3 KV heads on 2 threads left one thread idle a third of the time),
 * an item is a request, a KV head and a part of the request's rows: each part reads that head's K and V
 * once, and a row's value is the same in whatever part it falls.  No AttentionOptions here (those
 * requests attend as decodes). */
static void rows_attention(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                           const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *qsl, const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int nthreads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, tok_stride = num_kv_heads * D;
    const int64_t pairs = num_reqs * num_kv_heads, want = 2 * (int64_t)nthreads;  /* (request, KV head) */
    const int64_t parts = pairs < want ? (want + pairs - 1) / pairs : 1;  /* row parts per pair (empty ones skipped) */
    const int64_t items = pairs * parts;
#pragma omp parallel num_threads(nthreads) if (items > 1)
    {
        int64_t cap = 0;
        float *scores = NULL;
        float *qb = (float *)kernel_scratch((size_t)(DECODE_LIKE_ROWS * G * D) * sizeof(float));
        float *acc = (float *)kernel_scratch((size_t)(DECODE_LIKE_ROWS * G * D) * sizeof(float));
        float *mx = (float *)kernel_scratch((size_t)(DECODE_LIKE_ROWS * G) * sizeof(float));
        float *sum = (float *)kernel_scratch((size_t)(DECODE_LIKE_ROWS * G) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r = it / (num_kv_heads * parts), h = it / parts % num_kv_heads, p = it % parts;
            const int64_t all = qsl[r + 1] - qsl[r], i0 = p * all / parts, i1 = (p + 1) * all / parts;
            const int64_t first = qsl[r] + i0, R = i1 - i0, nh = R * G;  /* this part: the request's rows i0 .. i1 */
            const int64_t S = seq_lens[r] - (all - i1), S0 = S - R + 1;  /* the part's last row's causal length; its first's */
            if (R <= 0) continue;
            if (S * nh > cap) {
                cap = S * nh;
                free(scores);
                scores = (float *)kernel_scratch((size_t)cap * sizeof(float));
            }
            const int32_t *bt = block_tables + r * bt_stride;
            for (int64_t i = 0; i < R; i++)  /* head i * G + g: row i's query head h * G + g */
                memcpy(qb + i * G * D, q + (first + i) * q_row_stride + h * G * D, (size_t)(G * D) * sizeof(float));
            const int64_t shared = S0 / block_size;  /* blocks every row sees in full */
            ahead_t none = NOTHING_AHEAD;  /* the blocks rows see in part prefetch nothing */
            /* the shared blocks prefetch the next block's lines of head h over their tiles' calls: K block b + 1,
             * after the last one V block 0; then V block b + 1 */
            const int64_t tiles = (nh + 2) / 3, value_calls = tiles * ((D + 31) / 32);
            for (int64_t g = 0; g < nh; g++) mx[g] = -INFINITY;
            for (int64_t b = 0; b < shared; b++) {  /* pass 1: scores */
                const float *kb = key_cache + (int64_t)bt[b] * block_size * tok_stride + h * D;
                ahead_t next = (b + 1) * block_size < S
                                   ? block_ahead(key_cache, bt, b + 1, S, block_size, tok_stride, h * D, D, tiles)
                                   : block_ahead(value_cache, bt, 0, S, block_size, tok_stride, h * D, D, tiles);
                block_scores(qb, kb, tok_stride, block_size, nh, nh, D, scale, scores, S, b * block_size, mx, &next);
            }
            for (int64_t i = 0; i < R; i++) {
                const int64_t Si = S0 + i;
                for (int64_t b = shared, t0 = shared * block_size; t0 < Si; b++, t0 += block_size) {
                    const int64_t nt = Si - t0 < block_size ? Si - t0 : block_size;
                    const float *kb = key_cache + (int64_t)bt[b] * block_size * tok_stride + h * D;
                    block_scores(qb + i * G * D, kb, tok_stride, nt, G, G, D, scale, scores + i * G * S, S, t0,
                                 mx + i * G, &none);
                }
                for (int64_t g = i * G; g < (i + 1) * G; g++) sum[g] = softmax_numerators(scores + g * S, Si, mx[g]);
            }
            memset(acc, 0, (size_t)(nh * D) * sizeof(float));
            for (int64_t b = 0; b < shared; b++) {  /* pass 3: weighted values */
                const float *vb = value_cache + (int64_t)bt[b] * block_size * tok_stride + h * D;
                ahead_t next = block_ahead(value_cache, bt, b + 1, S, block_size, tok_stride, h * D, D, value_calls);
                block_values(scores, vb, tok_stride, block_size, nh, nh, D, S, b * block_size, acc, &next);
            }
            for (int64_t i = 0; i < R; i++) {
                const int64_t Si = S0 + i;
                for (int64_t b = shared, t0 = shared * block_size; t0 < Si; b++, t0 += block_size) {
                    const int64_t nt = Si - t0 < block_size ? Si - t0 : block_size;
                    const float *vb = value_cache + (int64_t)bt[b] * block_size * tok_stride + h * D;
                    block_values(scores + i * G * S, vb, tok_stride, nt, G, G, D, S, t0, acc + i * G * D, &none);
                }
                for (int64_t g = 0; g < G; g++) {
                    float *o = out + ((first + i) * num_heads + h * G + g) * D;
                    const float inv = 1.0f / sum[i * G + g];
                    const float *a = acc + (i * G + g) * D;
                    for (int64_t e = 0; e < D; e++) o[e] = a[e] * inv;
                }
            }
        }
        free(scores);
        free(qb);
        free(acc);
        free(mx);
        free(sum);
    }
}


/* Causal attention of requests' query rows (prefill chunks, or a decode with its speculative drafts):
 * request r's rows qsl[r] .. qsl[r+1] are the last of its seq_lens[r] cached tokens.  A request of at
 * most DECODE_LIKE_ROWS rows attends as that many decodes, row i with its own causal length (the decode
 * kernels read K and V in place where the tiles would transpose every key first; a verified draft's
 * attention is then a plain decode's, bit for bit): rows_attention, which reads the request's K and V once
 * for all its rows, or with AttentionOptions decode_attention over one table row per query row.  Longer
 * requests go by the tiles above.  Consecutive
 * requests of one kind go in one call. */
static void prefill_attention(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                              const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                              const int32_t *qsl, const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              const attn_opts_t *opts, int nthreads) {
    int32_t *vt = 0, *vl = 0;
    for (int64_t r0 = 0; r0 < num_reqs;) {
        const int short_run = qsl[r0 + 1] - qsl[r0] <= DECODE_LIKE_ROWS;
        int64_t r1 = r0 + 1;
        while (r1 < num_reqs && (qsl[r1 + 1] - qsl[r1] <= DECODE_LIKE_ROWS) == short_run) r1++;
        if (!short_run) {
            prefill_attention_tiles(q, q_row_stride, out, key_cache, value_cache, block_tables + r0 * bt_stride,
                                    bt_stride, qsl + r0, seq_lens + r0, r1 - r0, num_heads, num_kv_heads,
                                    head_dim, block_size, scale, opts, nthreads);
        } else if (!opts) {  /* each request's K and V read once for all its rows */
            rows_attention(q, q_row_stride, out, key_cache, value_cache, block_tables + r0 * bt_stride, bt_stride,
                           qsl + r0, seq_lens + r0, r1 - r0, num_heads, num_kv_heads, head_dim, block_size, scale,
                           nthreads);
        } else {  /* one table row and causal length per query row */
            const int64_t first = qsl[r0], rows = qsl[r1] - first;
            vt = (int32_t *)realloc(vt, (size_t)(rows * bt_stride) * sizeof(int32_t));
            vl = (int32_t *)realloc(vl, (size_t)rows * sizeof(int32_t));
            for (int64_t r = r0; r < r1; r++)
                for (int64_t i = qsl[r]; i < qsl[r + 1]; i++) {
                    memcpy(vt + (i - first) * bt_stride, block_tables + r * bt_stride, (size_t)bt_stride * sizeof(int32_t));
                    vl[i - first] = seq_lens[r] - (qsl[r + 1] - i) + 1;
                }
            decode_attention(q + first * q_row_stride, q_row_stride, out + first * num_heads * head_dim, key_cache,
                             value_cache, vt, bt_stride, vl, rows, num_heads, num_kv_heads, head_dim, block_size,
                             scale, opts, nthreads);
        }
        r0 = r1;
    }
    free(vt);
    free(vl);
}

void paged_prefill_attention_f32(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                                 const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *qsl, const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                 int nthreads) {
    prefill_attention(q, q_row_stride, out, key_cache, value_cache, block_tables, bt_stride, qsl, seq_lens, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, NULL, nthreads);
}

/* The same with AttentionOptions: window (0 = none), softcap (0 = none), sinks (NULL = none). */
void paged_prefill_attention_opts_f32(const float *q, int64_t q_row_stride, float *out, const float *key_cache,
                                      const float *value_cache, const int32_t *block_tables, int64_t bt_stride,
                                      const int32_t *qsl, const int32_t *seq_lens, int64_t num_reqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                      float scale, int64_t window, float softcap, const float *sinks, int nthreads) {
    const attn_opts_t o = {window, softcap, sinks};
    prefill_attention(q, q_row_stride, out, key_cache, value_cache, block_tables, bt_stride, qsl, seq_lens, num_reqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, &o, nthreads);
}

/* out[r] = the index of the first maximum of row r (x[r * ld + 0 .. n)); a NaN counts as the maximum
 * (the first NaN wins), as in torch.argmax.  Rows are shared by the threads. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0, j = 0;
#ifdef HAVE_AVX2
    if (n >= 16) {
        __m256 mv = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(mv, mv, _CMP_UNORD_Q);
        __m256i iv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = iv;
        const __m256i eight = _mm256_set1_epi32(8);
        for (j = 8; j + 8 <= n; j += 8) {
            cur = _mm256_add_epi32(cur, eight);
            const __m256 v = _mm256_loadu_ps(x + j);
            const __m256 gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);  /* strict: each lane keeps its first maximum */
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mv = _mm256_blendv_ps(mv, v, gt);
            iv = _mm256_blendv_epi8(iv, cur, _mm256_castps_si256(gt));
        }
        if (_mm256_movemask_ps(nan)) {  /* rare: find the first NaN */
            for (int64_t t = 0; t < n; t++)
                if (x[t] != x[t]) return t;
        }
        float m[8];
        int32_t idx[8];
        _mm256_storeu_ps(m, mv);
        _mm256_storeu_si256((__m256i *)idx, iv);
        best = idx[0];
        float bm = m[0];
        for (int l = 1; l < 8; l++)
            if (m[l] > bm || (m[l] == bm && idx[l] < best)) {
                bm = m[l];
                best = idx[l];
            }
        for (; j < n; j++) {
            if (x[j] != x[j]) return j;
            if (x[j] > bm) {
                bm = x[j];
                best = j;
            }
        }
        return best;
    }
#endif
    float bm = x[0];
    if (bm != bm) return 0;
    for (j = 1; j < n; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > bm) {
            bm = x[j];
            best = j;
        }
    }
    return best;
}

void argmax_rows_f32(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * ld, n);
}

/* ---- greedy decoding without the full fp32 logits ------------------------------------------------
 * For rows that only need argmax_v(h . W_v) (greedy, no logprobs or penalties) the LM head runs as an
 * int8 screen plus an exact rescoring of the few tokens that could be the maximum (greedy_head.py builds
 * the screen and holds the bound's derivation):
 *   1. h is quantized per row to int16: h ~ t hq (|hq| <= 32767);
 *   2. A_v = t sum_b s_vb (hq_b . Wq_vb) for every v, from int8 weights Wq with a scale per token and
 *      block of GQ_BLOCK inputs, in panels of 16 tokens (vpmaddwd on int16 pairs, exact int32 sums per
 *      block: 4x fewer weight bytes than fp32; weights dequantized from GGUF Q8_0 are held exactly);
 *   3. |F_v - A_v| <= B_v = |h| bw_v + |dh| bq_v + 1e-5 |A_v|, where F_v is the logit the fp32 route would
 *      compute (bw_v bounds |W_v - What_v| and both routes' rounding, bq_v = |What_v|, dh = h - t hq);
 *   4. every v with A_v + B_v >= max_u (A_u - B_u) is rescored exactly as the fp32 route computes it
 *      (route 0: the packed GEMM's FMA chain over the panel; route T > 0: gemv_f32's T runs) and the
 *      first maximum wins, as in argmax_rows_f32.  Any token it misses has F_v < some F_u.
 * Returns 0, or 1 when a row is not finite or its logits could overflow (the caller takes the full path). */
#define GQ_PAIR 32  /* int8 bytes per panel and input pair: 16 tokens x 2 inputs */
#define GQ_BLOCK 32  /* inputs per scale */
#define GQ_MR 3  /* rows per tile: 6 int32 + 6 float accumulators, 2 weight vectors, 1 broadcast */

/* rows hp[0..MR) (KP int16 pairs each) times one int8 panel (nb blocks of GQ_BLOCK/2 pairs, scales
 * [nb x 16]) -> c[MR x 16] = sum_b s_b (hq_b . Wq_b) (without the row scale t) */
#ifdef __AVX512F__
/* The AVX-512 build (which requires VNNI): a panel's 32 bytes for one input pair widened to 32 words in
 * one register, whose lane j is token j's pair, so one vpdpwssd takes the pair for all 16 tokens (the
 * AVX2 code's two widenings, two vpmaddwd and two adds).  The same exact int32 block sums, then the same
 * float products and sums lane for lane: the AVX2 build's values bit for bit. */
#define SCREEN_TARGET __attribute__((target("avx512vnni")))
#define SCREEN_PREFETCH 2048
#else
#define SCREEN_TARGET
#endif
static inline __attribute__((always_inline)) SCREEN_TARGET void screen_tile(const int MR, const int32_t *hp,
                                                                            int64_t KP, const int8_t *b,
                                                                            const float *scales, float *c) {
    const int64_t nb = (2 * KP + GQ_BLOCK - 1) / GQ_BLOCK;
#if defined(__AVX512F__)
    __m512 acc[GQ_MR];
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t k0 = blk * (GQ_BLOCK / 2), k1 = KP < k0 + GQ_BLOCK / 2 ? KP : k0 + GQ_BLOCK / 2;
        for (int l = 0; l < GQ_BLOCK / 2 * GQ_PAIR; l += 64)  /* the block SCREEN_PREFETCH bytes ahead */
            _mm_prefetch((const char *)(b + GQ_PAIR * k0 + SCREEN_PREFETCH + l), _MM_HINT_T0);
        __m512i iacc[GQ_MR];
#pragma GCC unroll 3
        for (int i = 0; i < MR; i++) iacc[i] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k++) {
            const __m512i bk = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + GQ_PAIR * k)));
#pragma GCC unroll 3
            for (int i = 0; i < MR; i++) iacc[i] = _mm512_dpwssd_epi32(iacc[i], _mm512_set1_epi32(hp[i * KP + k]), bk);
        }
        const __m512 sc = _mm512_loadu_ps(scales + blk * GEMM_NR);
#pragma GCC unroll 3
        for (int i = 0; i < MR; i++) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[i]), sc));
    }
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(c + i * GEMM_NR, acc[i]);
#elif defined(HAVE_AVX2)
    __m256 acc[GQ_MR][2];
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t k0 = blk * (GQ_BLOCK / 2), k1 = KP < k0 + GQ_BLOCK / 2 ? KP : k0 + GQ_BLOCK / 2;
        __m256i iacc[GQ_MR][2];
#pragma GCC unroll 3
        for (int i = 0; i < MR; i++) iacc[i][0] = iacc[i][1] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k++) {
            const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + GQ_PAIR * k)));
            const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + GQ_PAIR * k + 16)));
#pragma GCC unroll 3
            for (int i = 0; i < MR; i++) {
                const __m256i a = _mm256_set1_epi32(hp[i * KP + k]);
                iacc[i][0] = _mm256_add_epi32(iacc[i][0], _mm256_madd_epi16(a, b0));
                iacc[i][1] = _mm256_add_epi32(iacc[i][1], _mm256_madd_epi16(a, b1));
            }
        }
        const __m256 s0 = _mm256_loadu_ps(scales + blk * GEMM_NR), s1 = _mm256_loadu_ps(scales + blk * GEMM_NR + 8);
#pragma GCC unroll 3
        for (int i = 0; i < MR; i++) {
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(_mm256_cvtepi32_ps(iacc[i][0]), s0));
            acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(_mm256_cvtepi32_ps(iacc[i][1]), s1));
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(c + i * GEMM_NR, acc[i][0]);
        _mm256_storeu_ps(c + i * GEMM_NR + 8, acc[i][1]);
    }
#else
    for (int i = 0; i < MR; i++) {
        float acc[GEMM_NR] = {0};
        for (int64_t blk = 0; blk < nb; blk++) {
            const int64_t k0 = blk * (GQ_BLOCK / 2), k1 = KP < k0 + GQ_BLOCK / 2 ? KP : k0 + GQ_BLOCK / 2;
            int32_t iacc[GEMM_NR] = {0};
            for (int64_t k = k0; k < k1; k++) {
                const int32_t pair = hp[i * KP + k];
                const int32_t h0 = (int16_t)(pair & 0xffff), h1 = (int16_t)((uint32_t)pair >> 16);
                const int8_t *bk = b + GQ_PAIR * k;
                for (int j = 0; j < GEMM_NR; j++) {
                    const int8_t *q = bk + (j / 8) * 16 + (j % 8) * 2;
                    iacc[j] += h0 * q[0] + h1 * q[1];
                }
            }
            for (int j = 0; j < GEMM_NR; j++) acc[j] += (float)iacc[j] * scales[blk * GEMM_NR + j];
        }
        memcpy(c + i * GEMM_NR, acc, sizeof(acc));
    }
#endif
}

static SCREEN_TARGET void screen_tile_rows(int rows, const int32_t *hp, int64_t KP, const int8_t *b, const float *scales,
                             float *c) {
    switch (rows) {
    case 1: screen_tile(1, hp, KP, b, scales, c); break;
    case 2: screen_tile(2, hp, KP, b, scales, c); break;
    default: screen_tile(3, hp, KP, b, scales, c); break;
    }
}

/* the screen's bound B_v = |h| bw_v + |dh| bq_v + 1e-5 |A_v| (separate roundings, no FMA, in both builds) */
static inline float screen_bound(float a, float bwv, float bqv, float hn, float dn) {
    return hn * bwv + dn * bqv + 1e-5f * fabsf(a);
}

#ifdef HAVE_AVX2
/* screen_bound for 8 tokens: the same operations in the same order */
static inline __m256 screen_bound8(__m256 a, const float *bw, const float *bq, __m256 hn, __m256 dn) {
    const __m256 abs_a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
    return _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(hn, _mm256_loadu_ps(bw)), _mm256_mul_ps(dn, _mm256_loadu_ps(bq))),
                         _mm256_mul_ps(_mm256_set1_ps(1e-5f), abs_a));
}
#endif

/* max_v (A_v - B_v) over one row */
static float screen_lower_bound(const float *a, const float *bw, const float *bq, float hn, float dn, int64_t N) {
    float lo = -INFINITY;
    int64_t v = 0;
#ifdef HAVE_AVX2
    const __m256 h8 = _mm256_set1_ps(hn), d8 = _mm256_set1_ps(dn);
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; v + 8 <= N; v += 8) {
        const __m256 av = _mm256_loadu_ps(a + v);
        m8 = _mm256_max_ps(m8, _mm256_sub_ps(av, screen_bound8(av, bw + v, bq + v, h8, d8)));
    }
    float m[8];
    _mm256_storeu_ps(m, m8);
    for (int l = 0; l < 8; l++) lo = m[l] > lo ? m[l] : lo;
#endif
    for (; v < N; v++) {
        const float l = a[v] - screen_bound(a[v], bw[v], bq[v], hn, dn);
        lo = l > lo ? l : lo;
    }
    return lo;
}

/* bit i set: token v0 + i (i < n <= 64) has A + B >= lo, so it may be the maximum */
static uint64_t screen_reach(const float *a, const float *bw, const float *bq, float hn, float dn, float lo,
                             int64_t v0, int64_t n) {
    uint64_t hits = 0;
    int64_t i = 0;
#ifdef HAVE_AVX2
    const __m256 h8 = _mm256_set1_ps(hn), d8 = _mm256_set1_ps(dn), lo8 = _mm256_set1_ps(lo);
    for (; i + 8 <= n; i += 8) {
        const int64_t v = v0 + i;
        const __m256 av = _mm256_loadu_ps(a + v);
        const __m256 up = _mm256_add_ps(av, screen_bound8(av, bw + v, bq + v, h8, d8));
        hits |= (uint64_t)_mm256_movemask_ps(_mm256_cmp_ps(up, lo8, _CMP_GE_OQ)) << i;
    }
#endif
    for (; i < n; i++) {
        const int64_t v = v0 + i;
        if (a[v] + screen_bound(a[v], bw[v], bq[v], hn, dn) >= lo) hits |= 1ull << i;
    }
    return hits;
}

/* the fp32 route's logit of token v (no bias): route 0 = the packed GEMM tile's chain, T > 0 = gemv_f32 */
static float route_logit(const float *h, int64_t K, int64_t v, const float *panels, const float *dense, int64_t ldw,
                         int64_t T) {
    if (T > 0) return gemv_column(h, dense, ldw, K, v, T);
    const float *b = panels + (v / GEMM_NR) * K * GEMM_NR + v % GEMM_NR;
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++)
#ifdef HAVE_AVX2
        acc = fmaf(h[k], b[k * GEMM_NR], acc);
#else
        acc += h[k] * b[k * GEMM_NR];
#endif
    return acc + 0.f;  /* the tile's store adds a zero bias vector */
}

/* out[i] = the fp32 route's logit of token ids[i] for row h (route_logit): what greedy_head_f32 rescores */
void route_logits_f32(const float *h, int64_t K, const int64_t *ids, int64_t n, const float *panels, const float *dense,
                      int64_t ldw, int64_t route_T, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = route_logit(h, K, ids[i], panels, dense, ldw, route_T);
}

int64_t greedy_head_f32(const float *h, int64_t ldh, int64_t R, int64_t K, int64_t N, const int8_t *qpanels,
                        const float *qscales, const float *bw, const float *bq, float wnorm_max, int32_t hq_max,
                        const float *panels, const float *dense, int64_t ldw, int64_t route_T, float *approx,
                        int64_t *tokens, int64_t *candidates, int nthreads) {
    const int64_t KP = (K + 1) / 2, np = (N + GEMM_NR - 1) / GEMM_NR;
    int32_t *hp = (int32_t *)kernel_scratch((size_t)(R * KP) * sizeof(int32_t));
    float *t = (float *)kernel_scratch((size_t)R * 3 * sizeof(float)), *hn = t + R, *dn = t + 2 * R;
    int bad = 0;
    for (int64_t r = 0; r < R && !bad; r++) {  /* 1. quantize the rows (|h|, |dh| in double, rounded up) */
        const float *x = h + r * ldh;
        float amax = 0.f;
        double ss = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const float a = fabsf(x[k]);
            if (!(a <= 3.0e38f)) bad = 1;  /* NaN or inf */
            amax = a > amax ? a : amax;
            ss += (double)x[k] * x[k];
        }
        const double norm = sqrt(ss);
        if (bad || norm * wnorm_max > 1.0e30) {
            bad = 1;
            break;
        }
        t[r] = amax / (float)hq_max;
        if (!(t[r] > 0.f)) t[r] = 1.f;  /* a zero row, or one so small its scale underflows: hq = 0, dh = h */
        double dd = 0.0;
        int16_t q[2];
        for (int64_t k = 0; k < 2 * KP; k++) {
            int32_t v = 0;
            if (k < K) {
                v = (int32_t)lrintf(x[k] / t[r]);
                v = v > hq_max ? hq_max : (v < -hq_max ? -hq_max : v);
                const double e = (double)x[k] - (double)t[r] * v;
                dd += e * e;
            }
            q[k & 1] = (int16_t)v;
            if (k & 1) hp[r * KP + k / 2] = (int32_t)(((uint32_t)(uint16_t)q[1] << 16) | (uint16_t)q[0]);
        }
        hn[r] = (float)(norm * (1.0 + 1e-5));
        dn[r] = (float)(sqrt(dd) * (1.0 + 1e-5));
    }
    if (bad) {
        free(hp);
        free(t);
        return 1;
    }
    /* 2. A: panels shared by the threads, every row tile per panel (the panel stays in L1) */
    const int64_t tiles = (R + GQ_MR - 1) / GQ_MR, nb = (2 * KP + GQ_BLOCK - 1) / GQ_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (np > 1)
    for (int64_t p = 0; p < np; p++) {
        float c[GQ_MR * GEMM_NR];
        const int64_t n0 = p * GEMM_NR, nn = N - n0 < GEMM_NR ? N - n0 : GEMM_NR;
        int64_t m0 = 0;
        for (int64_t ti = 0; ti < tiles; ti++) {
            const int64_t rows = (R - m0 + (tiles - ti) - 1) / (tiles - ti);
            screen_tile_rows((int)rows, hp + m0 * KP, KP, qpanels + p * KP * GQ_PAIR, qscales + p * nb * GEMM_NR, c);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < nn; j++) approx[(m0 + i) * N + n0 + j] = c[i * GEMM_NR + j] * t[m0 + i];
            m0 += rows;
        }
    }
    /* 3-4. per row: the best lower bound, then the exact logits of the tokens that can reach it */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *a = approx + r * N;
        const float lo = screen_lower_bound(a, bw, bq, hn[r], dn[r], N);
        int64_t best = -1, n = 0;
        float bestv = 0.f;
        for (int64_t v0 = 0; v0 < N; v0 += 64) {
            uint64_t hits = screen_reach(a, bw, bq, hn[r], dn[r], lo, v0, N - v0 < 64 ? N - v0 : 64);
            while (hits) {
                const int64_t v = v0 + __builtin_ctzll(hits);
                hits &= hits - 1;
                const float f = route_logit(h + r * ldh, K, v, panels, dense, ldw, route_T);
                n++;
                if (best < 0 || f > bestv) {  /* increasing v: the first maximum wins */
                    best = v;
                    bestv = f;
                }
            }
        }
        tokens[r] = best;
        if (candidates) candidates[r] = n;
    }
    free(hp);
    free(t);
    return 0;
}

/* ---- the decoder stack of a Llama-family model in one call --------------------------------------
 * Every layer of a step, with the kernels above called in the order the torch modules call them
 * (llama.py), so the result is bit-identical to the module path; what goes is the Python between
 * them (~8-10 ms a decode step of the default model: ~400 calls, their tensor allocations and views).
 *   x [N x d]: the embedded tokens (read only);  out [nkeep x d]: the final RMSNorm of the residual stream
 *   at rows keep[0..nkeep) (strictly increasing), or out [N x d] for every row when keep is NULL.  The
 *   last layer drops the other rows once its attention has run (their K/V are in the cache by then):
 *   O projection, MLP and final norm run on the kept rows only, so a prefill chunk whose hidden states
 *   matter only at its last row skips ~5/6 of a layer for the rest (every row's value is unchanged).
 *   layers: STACK_FIELDS addresses per layer (see the enum; 0 = absent: no bias, no q/k norm): the
 *   projections' packed panels, and their dense [in x out]-major weights for a single row (see project;
 *   a single row's gate/up runs as GEMV then silu_and_mul_f32, as in the modules)
 *   dims: d, H, H_kv, D, I (intermediate), rot (rotary dims), block_size
 *   cos/sin [N x rot];  slots [N] (int64);  requests: the first nd are decodes (one row each), the
 *   rest prefill chunks (query_start_loc qsl [R+1], seq_lens [R], block tables [R x bt_stride]).
 *   LoRA adapters (roofline/lora), in a step with adapter rows: lora [nlayers x 4 x STACK_LORA_FIELDS] int64,
 *   per projection (qkv, o, gate/up, down) its LoRALayer's slot tensors (a, bt, slice count, slice offsets,
 *   sizes, slice_on; a = 0: no adapter weights there), lora_rank the slots' rank, groups [ngroups x 4] the
 *   step's (slot, rank, first row, end row) and kept_groups the same over the kept rows (the last layer's
 *   O projection and MLP).  Each delta is added right after its projection by lora_shrink_expand_f32, as
 *   LoRALayer.apply does after LinearBase's product, and a gate/up projection with an adapter runs unfused
 *   (projection, delta, silu_and_mul_f32) as the modules run it in such a step.  lora = NULL: no adapters.
 * Scratch (residual, normed rows, qkv, attention output, MLP rows) is allocated here per call.
 * Returns 0, or -1 when the LoRA kernel refuses its arguments. */
enum { L_IN_NORM, L_QKV, L_QKV_BIAS, L_Q_NORM, L_K_NORM, L_O, L_O_BIAS, L_POST_NORM, L_GATE_UP, L_DOWN,
       L_DOWN_BIAS, L_QKV_DENSE, L_O_DENSE, L_GATE_UP_DENSE, L_DOWN_DENSE, L_K_CACHE, L_V_CACHE,
       L_QKV_QUANT, L_O_QUANT, L_GATE_UP_QUANT, L_DOWN_QUANT, L_QUANT_TYPES, STACK_FIELDS };
/* L_*_QUANT: a projection kept in GGUF blocks (quant_kernels.c; its packed/dense slots are then 0);
 * L_QUANT_TYPES: not an address but their ggml types, 8 bits each: qkv | o << 8 | gate_up << 16 | down << 24 */

enum { LORA_A, LORA_BT, LORA_SLICES, LORA_OFF, LORA_SIZE, LORA_ON, STACK_LORA_FIELDS };

/* lora_kernels.c (the same library) */
int lora_shrink_expand_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t in, int64_t out,
                           const float *a, const float *bt, int64_t nslices, int64_t max_rank,
                           const int64_t *slice_off, const int64_t *slice_size, const uint8_t *slice_on,
                           const int64_t *groups, int64_t ngroups, int nthreads);

/* quant_kernels.c (the same library): the GGUF block formats */
int64_t quant_block_elems(int qt);
int64_t quant_block_bytes(int qt);
int quant_rows_route(int qt, int64_t M);
void quant_rows_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                    float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads);
void quant_expand_panel(int qt, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t nn, int64_t K,
                        float *panel, float *rowbuf);

/* The panel route of the quantized GEMMs (GGUF blocks here, FP8 blocks in fp8_kernels.c): rows n0 .. n0+nn of
 * W expanded by `expand` into packed panels in a thread's own buffer (in L2), and every row of A run over them
 * by packed_gemm.  silu == 0: c [M x N] = a W^T (+ bias).
 * silu == 1: W holds [W_g; W_u] (2N rows, N a multiple of 16: packed_gemm's silu); a unit expands its gate panels and then the
 * up panels N rows further, in packed_gemm's silu layout, so c [M x N] = silu(a W_g^T) * (a W_u^T) comes out
 * of the up tiles' epilogue and the [M x 2N] projection is never written.
 * Units of panels a thread expands and multiplies at a time: pairs where the build has the two-panel tile
 * (gate/up pairs of pairs with silu); packed_gemm's panel groups (at most eight panels, as many groups as a
 * multiple of the thread count) when the rows fill more than one row block, so each block of input rows is
 * read from cache once per group rather than once per one or two panels (prefill-sized batches: the input
 * rows are megabytes).  Unit u holds output panels [u np / units, (u + 1) np / units).
 * expand(ctx, n0, nn, K, panel, rowbuf): rows n0 .. n0+nn (nn <= 16) of W into one panel [K x 16], zero past
 * nn (pack_panels_f32's layout); rowbuf holds K floats of scratch. */
typedef void (*panel_expander_t)(const void *ctx, int64_t n0, int64_t nn, int64_t K, float *panel, float *rowbuf);

void expanded_panels_gemm(panel_expander_t expand, const void *ctx, const float *a, int64_t lda, const float *bias,
                          float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int silu, int nthreads) {
    const int64_t np = (N + GEMM_NR - 1) / GEMM_NR;
    const int64_t units = M > GEMM_MB ? panel_groups(np, silu, nthreads) : (np + PAIR_TILES) / (1 + PAIR_TILES);
    const int64_t per = (np + units - 1) / units;
#pragma omp parallel num_threads(nthreads) if (units > 1)
    {
        float *panel = (float *)kernel_scratch((size_t)((1 + silu) * per * K * GEMM_NR) * sizeof(float));
        float *rowbuf = (float *)kernel_scratch((size_t)K * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int64_t p_lo = u * np / units, p_hi = (u + 1) * np / units, cnt = p_hi - p_lo;
            const int64_t n0 = p_lo * GEMM_NR, nu = (N < p_hi * GEMM_NR ? N : p_hi * GEMM_NR) - n0;
            for (int half = 0; half <= silu; half++)  /* the gate panels, then (silu) the up panels */
                for (int64_t q = 0; q < cnt; q++) {
                    const int64_t nq = nu - q * GEMM_NR < GEMM_NR ? nu - q * GEMM_NR : GEMM_NR;
                    expand(ctx, half * N + n0 + q * GEMM_NR, nq, K, panel + (half * cnt + q) * K * GEMM_NR, rowbuf);
                }
            /* packed_gemm's items for one group of these panels, called here: a nested one-thread
             * parallel region per unit cost ~0.1 ms a 3072 x 576 weight (192 units, 2 threads) */
            const int64_t nmb = (M + GEMM_MB - 1) / GEMM_MB;
            for (int64_t mi = 0; mi < nmb; mi++)
                packed_gemm_item(a, lda, panel, bias ? bias + n0 : 0, c + n0, ldc, M, K, nu, silu, 1, nmb, 0, mi);
        }
        free(panel);
        free(rowbuf);
    }
}

typedef struct { int qt; const uint8_t *w; int64_t row_bytes; } gguf_panels_t;

static void gguf_expand(const void *ctx, int64_t n0, int64_t nn, int64_t K, float *panel, float *rowbuf) {
    const gguf_panels_t *g = (const gguf_panels_t *)ctx;
    quant_expand_panel(g->qt, g->w, g->row_bytes, n0, nn, K, panel, rowbuf);
}

static void quant_panels_gemm(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes,
                              const float *bias, float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int silu,
                              int nthreads) {
    const gguf_panels_t ctx = {qt, w, row_bytes};
    expanded_panels_gemm(gguf_expand, &ctx, a, lda, bias, c, ldc, M, K, N, silu, nthreads);
}

/* C [M x N] = A [M x K] (row stride lda) W^T (+ bias), W [N x K] in GGUF blocks of type qt (rows row_bytes
 * apart; QT_ACT_Q8 or-ed in for the activation-quantized mode); C's rows ldc apart.  K a multiple of the
 * format's block.  Few rows (or the q8 mode) take quant_kernels.c's rows routes; more rows the panel route
 * (quant_panels_gemm): a row's values are then gemm_packed_f32's over the dequantized weight, bit for bit. */
void quant_linear_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, const float *bias,
                      float *c, int64_t ldc, int64_t M, int64_t K, int64_t N, int nthreads) {
    if (quant_rows_route(qt, M)) quant_rows_f32(qt, a, lda, w, row_bytes, bias, c, ldc, M, K, N, nthreads);
    else quant_panels_gemm(qt, a, lda, w, row_bytes, bias, c, ldc, M, K, N, 0, nthreads);
}

/* The MLP's gate/up projection over [W_g; W_u] (2d rows in GGUF blocks) with SiLU-and-mul: c [M x d] (row
 * stride ldc) = silu(a W_g^T) * (a W_u^T), the values of quant_linear_f32 followed by silu_and_mul_f32.  The
 * panel route fuses it where d is a multiple of 16 (the fused epilogue stores whole panels); otherwise the
 * projection goes through a [M x 2d] scratch. */
void quant_linear_silu_mul_f32(int qt, const float *a, int64_t lda, const uint8_t *w, int64_t row_bytes, float *c,
                               int64_t ldc, int64_t M, int64_t K, int64_t d, int nthreads) {
    if (!quant_rows_route(qt, M) && d % GEMM_NR == 0) {
        quant_panels_gemm(qt, a, lda, w, row_bytes, 0, c, ldc, M, K, d, 1, nthreads);
        return;
    }
    float *gate_up = (float *)kernel_scratch((size_t)(M * 2 * d) * sizeof(float));
    quant_linear_f32(qt, a, lda, w, row_bytes, 0, gate_up, 2 * d, M, K, 2 * d, nthreads);
    if (ldc == d) {
        silu_and_mul_f32(gate_up, c, M, d, nthreads);
    } else {
        for (int64_t r = 0; r < M; r++) silu_and_mul_f32(gate_up + r * 2 * d, c + r * ldc, 1, d, 1);
    }
    free(gate_up);
}

/* c = a W^T (+ bias) for rows a [N x K] (row stride lda) -> c [N x Nout] (row stride ldc): the route
 * cpu_gemm.linear takes for the same rows, so values match the modules' bit for bit.  Batches of 2+
 * rows multiply the packed panels; a single row runs the threaded GEMV over the dense weight stored
 * [in x out]-major (`dense`, 0 where the caller takes no single rows). */
static void project(const float *a, int64_t lda, const float *packed, const float *dense, const float *bias,
                    float *c, int64_t ldc, int64_t N, int64_t K, int64_t Nout, const uint8_t *quant, int qt,
                    int nthreads) {
    if (quant) quant_linear_f32(qt, a, lda, quant, K / quant_block_elems(qt & 0x7f) * quant_block_bytes(qt & 0x7f), bias, c, ldc, N,
                                K, Nout, nthreads);
    else if (N == 1 && dense) gemv_f32(a, dense, bias, c, K, Nout, Nout, nthreads);
    else packed_gemm(a, lda, packed, bias, c, ldc, N, K, Nout, 0, nthreads);
}

static void qk_head_norm(float *qkv, int64_t W, int64_t rows, int64_t nheads, int64_t D, const float *w, float eps,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < nheads; h++) {
            float *v = qkv + r * W + h * D;
            rms_row(v, 0, w, v, 0, D, eps);
        }
}

/* rows keep[i] of m [* x w] moved to rows i (keep strictly increasing, so no row is overwritten unread) */
static void keep_rows(float *m, int64_t w, const int32_t *keep, int64_t nkeep) {
    for (int64_t i = 0; i < nkeep; i++)
        if (keep[i] != i) memcpy(m + i * w, m + (int64_t)keep[i] * w, (size_t)w * sizeof(float));
}

int64_t llama_stack_fields(void) { return STACK_FIELDS; }
int64_t llama_stack_lora_fields(void) { return STACK_LORA_FIELDS; }

/* y [rows x out] += the groups' LoRA deltas of x [rows x in] through one projection's slots lo (0 or lo[LORA_A]
 * == 0: none); returns the kernel's status */
static int stack_lora(const int64_t *lo, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t in, int64_t out,
                      int64_t rank, const int64_t *groups, int64_t ngroups, int nthreads) {
    if (!lo || !lo[LORA_A] || ngroups == 0) return 0;
    return lora_shrink_expand_f32(x, ldx, y, ldy, in, out, (const float *)(intptr_t)lo[LORA_A],
                                  (const float *)(intptr_t)lo[LORA_BT], lo[LORA_SLICES], rank,
                                  (const int64_t *)(intptr_t)lo[LORA_OFF], (const int64_t *)(intptr_t)lo[LORA_SIZE],
                                  (const uint8_t *)(intptr_t)lo[LORA_ON], groups, ngroups, nthreads);
}

int llama_stack_f32(const float *x, float *out, int64_t N, const int64_t *layers, int64_t nlayers,
                    const int64_t *dims, float eps, float scale, const float *final_norm, const float *cos,
                    const float *sin, const int64_t *slots, int64_t nd, int64_t nreq, const int32_t *qsl,
                    const int32_t *seq_lens, const int32_t *tables, int64_t bt_stride, const int32_t *keep,
                    int64_t nkeep, const int64_t *lora, int64_t lora_rank, const int64_t *groups, int64_t ngroups,
                    const int64_t *kept_groups, int64_t nkept_groups, int nthreads) {
    const int64_t d = dims[0], H = dims[1], Hk = dims[2], D = dims[3], I = dims[4], rot = dims[5], bs = dims[6];
    const int64_t W = (H + 2 * Hk) * D, QD = H * D, KD = Hk * D;
    float *res = (float *)kernel_scratch((size_t)(N * d) * sizeof(float));   /* the residual stream */
    float *h = (float *)kernel_scratch((size_t)(N * d) * sizeof(float));     /* normed rows */
    float *y = (float *)kernel_scratch((size_t)(N * d) * sizeof(float));     /* a sublayer's output */
    float *qkv = (float *)kernel_scratch((size_t)(N * W) * sizeof(float));
    float *att = (float *)kernel_scratch((size_t)(N * QD) * sizeof(float));
    float *mid = (float *)kernel_scratch((size_t)(N * I) * sizeof(float));
    /* [gate; up] of a lone row, or of every row in a step with LoRA adapter rows */
    if (!lora || ngroups == 0) lora = 0;
    float *gate_up = (float *)kernel_scratch((size_t)((lora ? N : 1) * 2 * I) * sizeof(float));
    int rc = 0;
    memcpy(res, x, (size_t)(N * d) * sizeof(float));
    if (keep && nlayers == 0) {
        keep_rows(res, d, keep, nkeep);
        N = nkeep;
    }
#define F(l, f) ((const float *)(intptr_t)layers[(l) * STACK_FIELDS + (f)])
#define Q(l, f) ((const uint8_t *)(intptr_t)layers[(l) * STACK_FIELDS + (f)])
#define QT(l, i) ((int)((layers[(l) * STACK_FIELDS + L_QUANT_TYPES] >> (8 * (i))) & 0xff))
#define LO(l, i) (lora ? lora + ((l) * 4 + (i)) * STACK_LORA_FIELDS : 0)
    for (int64_t l = 0; l < nlayers && rc == 0; l++) {
        float *kc = (float *)(intptr_t)layers[l * STACK_FIELDS + L_K_CACHE];
        float *vc = (float *)(intptr_t)layers[l * STACK_FIELDS + L_V_CACHE];
        /* h = norm(res + y), res = res + y  (layer 0: h = norm(x), res = x) */
        if (l == 0) rms_norm_f32(res, 0, F(l, L_IN_NORM), h, 0, N, d, d, eps, nthreads);
        else rms_norm_f32(y, res, F(l, L_IN_NORM), h, res, N, d, d, eps, nthreads);
        /* attention: qkv = h W_qkv^T (+ b);  q, k normed per head (Qwen3);  rope;  cache write */
        project(h, d, F(l, L_QKV), F(l, L_QKV_DENSE), F(l, L_QKV_BIAS), qkv, W, N, d, W, Q(l, L_QKV_QUANT), QT(l, 0),
                nthreads);
        rc |= stack_lora(LO(l, 0), h, d, qkv, W, d, W, lora_rank, groups, ngroups, nthreads);
        if (F(l, L_Q_NORM)) {
            qk_head_norm(qkv, W, N, H, D, F(l, L_Q_NORM), eps, nthreads);
            qk_head_norm(qkv + QD, W, N, Hk, D, F(l, L_K_NORM), eps, nthreads);
        }
        rotary_f32(qkv, W, H, qkv + QD, W, Hk, D, rot, N, cos, sin, nthreads);
        write_kv_f32(qkv + QD, W, qkv + QD + KD, W, kc, vc, slots, N, KD);
        if (nd > 0)
            paged_decode_attention_f32(qkv, W, att, kc, vc, tables, bt_stride, seq_lens, nd, H, Hk, D, bs, scale,
                                       nthreads);
        if (nreq > nd)
            paged_prefill_attention_f32(qkv, W, att, kc, vc, tables + nd * bt_stride, bt_stride, qsl + nd,
                                        seq_lens + nd, nreq - nd, H, Hk, D, bs, scale, nthreads);
        if (keep && l == nlayers - 1) {  /* from here on only the rows whose hidden states are wanted */
            keep_rows(att, QD, keep, nkeep);
            keep_rows(res, d, keep, nkeep);
            N = nkeep;
            groups = kept_groups;
            ngroups = nkept_groups;
        }
        project(att, QD, F(l, L_O), F(l, L_O_DENSE), F(l, L_O_BIAS), y, d, N, QD, d, Q(l, L_O_QUANT), QT(l, 1),
                nthreads);
        rc |= stack_lora(LO(l, 1), att, QD, y, d, QD, d, lora_rank, groups, ngroups, nthreads);
        /* MLP: h = norm(res + y), res += y;  y = down(silu(gate h) * up h) */
        rms_norm_f32(y, res, F(l, L_POST_NORM), h, res, N, d, d, eps, nthreads);
        if (LO(l, 2) && LO(l, 2)[LORA_A]) {  /* an adapter's delta joins before the SiLU: unfused */
            project(h, d, F(l, L_GATE_UP), F(l, L_GATE_UP_DENSE), 0, gate_up, 2 * I, N, d, 2 * I,
                    Q(l, L_GATE_UP_QUANT), QT(l, 2), nthreads);
            rc |= stack_lora(LO(l, 2), h, d, gate_up, 2 * I, d, 2 * I, lora_rank, groups, ngroups, nthreads);
            silu_and_mul_f32(gate_up, mid, N, I, nthreads);
        } else if (Q(l, L_GATE_UP_QUANT)) {
            quant_linear_silu_mul_f32(QT(l, 2), h, d, Q(l, L_GATE_UP_QUANT), d / quant_block_elems(QT(l, 2) & 0x7f)
                                      * quant_block_bytes(QT(l, 2) & 0x7f), mid, I, N, d, I, nthreads);
        } else if (N == 1 && F(l, L_GATE_UP_DENSE)) {
            gemv_f32(h, F(l, L_GATE_UP_DENSE), 0, gate_up, d, 2 * I, 2 * I, nthreads);
            silu_and_mul_f32(gate_up, mid, 1, I, nthreads);
        } else {
            packed_gemm(h, d, F(l, L_GATE_UP), 0, mid, I, N, d, I, 1, nthreads);
        }
        project(mid, I, F(l, L_DOWN), F(l, L_DOWN_DENSE), F(l, L_DOWN_BIAS), y, d, N, I, d, Q(l, L_DOWN_QUANT),
                QT(l, 3), nthreads);
        rc |= stack_lora(LO(l, 3), mid, I, y, d, I, d, lora_rank, groups, ngroups, nthreads);
    }
#undef LO
#undef F
#undef Q
#undef QT
    if (nlayers > 0) rms_norm_f32(y, res, final_norm, out, res, N, d, d, eps, nthreads);
    else rms_norm_f32(res, 0, final_norm, out, 0, N, d, d, eps, nthreads);
    free(res);
    free(h);
    free(y);
    free(qkv);
    free(att);
    free(mid);
    free(gate_up);
    return rc ? -1 : 0;
}

/* ==== MLA latent decode (DeepSeek multi-head latent attention) ===================================
 * Self-contained section: cpu_ops.py's "MLA latent decode" section wraps it (cpu_ops.mla_decode).
 *
 * Decode rows attend over the paged latent cache as one shared KV head (roofline/attention/mla/backend.py):
 *   q      [num_seqs, H, W] contiguous, W = L + R: the absorbed query [W_UK^T q_nope, q_pe] of each head
 *   cache  rows of W floats; token t of sequence s sits at row block_tables[s][t / bs] * bs + t % bs
 *   out    [num_seqs, H, L]: out_h = sum_t softmax_t(scale * q_h . row_t) * row_t[0:L]
 * Every head of a work item reads a latent row once (scores for all of its heads, then the weighted
 * sums), so the cache is streamed once per item.  Items are (sequence, group of heads): whole
 * sequences when there are enough of them for the threads, else each sequence's heads are split. */
#define DOT_ROWS 6    /* dsa_kernels.c's score tiles: 6 rows ... */
#define DOT_HEADS 16  /* ... by 16 heads (their queries transposed: transpose_heads_f32) */
void dot_tile_f32(const float *qt, const float *const rows[DOT_ROWS], int64_t dim, float sums[DOT_ROWS][DOT_HEADS]);
void transpose_heads_f32(const float *q, int64_t heads, int64_t dim, float *qt);
void prefetch_row(const float *row, int64_t n);
#define MLA_TILE 16   /* latent rows per tile of pass 3 */
#define MLA_HEADS 4   /* heads per pass over a tile in pass 3: 4 x 16 values of L in registers */

/* pos (DSA's sparse decode): the S positions to attend to (the first S of the row's kept positions), or 0 for
 * positions 0 .. S-1.  Pass 1 scores the rows six at a time for sixteen heads at a time (dot_tile_f32, the
 * queries transposed once into qt, the rows read in place and the next six prefetched); pass 3 adds the
 * weighted rows of a tile of sixteen (the next sixteen prefetched) into the sums of four heads at a time,
 * sixteen values of L in registers. */
static void mla_item(const float *q, float *out, const float *cache, const int32_t *bt, const int64_t *pos, int64_t S,
                     int64_t nh, int64_t L, int64_t W, int64_t bs, float scale, float *scores, float *acc, float *mx,
                     float *qt) {
#define MLA_ROW(t) (cache + ((int64_t)bt[(pos ? pos[t] : (t)) / bs] * bs + (pos ? pos[t] : (t)) % bs) * W)
    transpose_heads_f32(q, nh, W, qt);
    for (int64_t g = 0; g < nh; g++) mx[g] = -INFINITY;
    for (int64_t t0 = 0; t0 < S; t0 += DOT_ROWS) {  /* pass 1: scores, a tile of rows for all heads */
        const int64_t nt = S - t0 < DOT_ROWS ? S - t0 : DOT_ROWS;
        const float *rows[DOT_ROWS];
        for (int64_t j = 0; j < DOT_ROWS; j++) rows[j] = MLA_ROW(t0 + (j < nt ? j : nt - 1));
        for (int64_t t = t0 + DOT_ROWS; t < t0 + 2 * DOT_ROWS && t < S; t++) prefetch_row(MLA_ROW(t), W);
        for (int64_t g0 = 0; g0 < nh; g0 += DOT_HEADS) {
            const int64_t ng = nh - g0 < DOT_HEADS ? nh - g0 : DOT_HEADS;
            float sums[DOT_ROWS][DOT_HEADS];
            dot_tile_f32(qt + g0 * W, rows, W, sums);
            for (int64_t g = 0; g < ng; g++)
                for (int64_t j = 0; j < nt; j++) {
                    const float d = sums[j][g] * scale;
                    scores[(g0 + g) * S + t0 + j] = d;
                    if (d > mx[g0 + g]) mx[g0 + g] = d;
                }
        }
    }
    for (int64_t g = 0; g < nh; g++) {  /* pass 2: softmax numerators, their sum in mx[g]'s place below */
        float sum = 0.f;
        float *sg = scores + g * S;
        for (int64_t t = 0; t < S; t++) {
            sg[t] = expf(sg[t] - mx[g]);
            sum += sg[t];
        }
        mx[g] = sum;
    }
    memset(acc, 0, (size_t)(nh * L) * sizeof(float));
    for (int64_t t0 = 0; t0 < S; t0 += MLA_TILE) {  /* pass 3: weighted latent rows, a tile at a time */
        const int64_t nt = S - t0 < MLA_TILE ? S - t0 : MLA_TILE;
        const float *rows[MLA_TILE];
        for (int64_t j = 0; j < nt; j++) rows[j] = MLA_ROW(t0 + j);
        for (int64_t t = t0 + MLA_TILE; t < t0 + 2 * MLA_TILE && t < S; t++) prefetch_row(MLA_ROW(t), L);
        int64_t g0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; g0 + MLA_HEADS <= nh; g0 += MLA_HEADS) {  /* four heads by sixteen values of L */
            const float *p = scores + g0 * S + t0;
            int64_t i = 0;
            for (; i + 16 <= L; i += 16) {
                __m256 v[MLA_HEADS][2];
                for (int g = 0; g < MLA_HEADS; g++) {
                    v[g][0] = _mm256_loadu_ps(acc + (g0 + g) * L + i);
                    v[g][1] = _mm256_loadu_ps(acc + (g0 + g) * L + i + 8);
                }
                for (int64_t j = 0; j < nt; j++) {
                    const __m256 r0 = _mm256_loadu_ps(rows[j] + i), r1 = _mm256_loadu_ps(rows[j] + i + 8);
                    for (int g = 0; g < MLA_HEADS; g++) {
                        const __m256 pj = _mm256_broadcast_ss(p + g * S + j);
                        v[g][0] = _mm256_fmadd_ps(pj, r0, v[g][0]);
                        v[g][1] = _mm256_fmadd_ps(pj, r1, v[g][1]);
                    }
                }
                for (int g = 0; g < MLA_HEADS; g++) {
                    _mm256_storeu_ps(acc + (g0 + g) * L + i, v[g][0]);
                    _mm256_storeu_ps(acc + (g0 + g) * L + i + 8, v[g][1]);
                }
            }
            for (int g = 0; g < MLA_HEADS; g++)  /* the last values of L (L not a multiple of 16) */
                for (int64_t l = i; l < L; l++) {
                    float x = acc[(g0 + g) * L + l];
                    for (int64_t j = 0; j < nt; j++) x = fmaf(p[g * S + j], rows[j][l], x);
                    acc[(g0 + g) * L + l] = x;
                }
        }
#endif
        for (int64_t g = g0; g < nh; g++) {  /* the other heads, one at a time */
            const float *p = scores + g * S + t0;
            float *a = acc + g * L;
            for (int64_t l = 0; l < L; l++) {
                float x = a[l];
                for (int64_t j = 0; j < nt; j++) x = fmaf(p[j], rows[j][l], x);
                a[l] = x;
            }
        }
    }
    for (int64_t g = 0; g < nh; g++) {
        const float inv = 1.0f / mx[g];
        for (int64_t i = 0; i < L; i++) out[g * L + i] = acc[g * L + i] * inv;
    }
#undef MLA_ROW
}

static void mla_decode(const float *q, float *out, const float *cache, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *seq_lens, const int64_t *positions, int64_t pos_stride, int64_t num_seqs,
                       int64_t num_heads, int64_t latent_rank, int64_t width, int64_t block_size, float scale,
                       int nthreads);

void mla_decode_f32(const float *q, float *out, const float *cache, const int32_t *block_tables, int64_t bt_stride,
                    const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t latent_rank, int64_t width,
                    int64_t block_size, float scale, int nthreads) {
    mla_decode(q, out, cache, block_tables, bt_stride, seq_lens, 0, 0, num_seqs, num_heads, latent_rank, width,
               block_size, scale, nthreads);
}

/* DSA's sparse decode: sequence s attends to its counts[s] kept positions positions[s * pos_stride ..] only (the
 * latent rows of the other positions are never read) */
void mla_sparse_decode_f32(const float *q, float *out, const float *cache, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *counts, const int64_t *positions, int64_t pos_stride,
                           int64_t num_seqs, int64_t num_heads, int64_t latent_rank, int64_t width, int64_t block_size,
                           float scale, int nthreads) {
    mla_decode(q, out, cache, block_tables, bt_stride, counts, positions, pos_stride, num_seqs, num_heads, latent_rank,
               width, block_size, scale, nthreads);
}

static void mla_decode(const float *q, float *out, const float *cache, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *seq_lens, const int64_t *positions, int64_t pos_stride, int64_t num_seqs,
                       int64_t num_heads, int64_t latent_rank, int64_t width, int64_t block_size, float scale,
                       int nthreads) {
    int64_t groups = 1;
    if (num_seqs < nthreads) {
        groups = (nthreads + num_seqs - 1) / num_seqs;
        if (groups > num_heads) groups = num_heads;
    }
    const int64_t per = (num_heads + groups - 1) / groups;  /* heads per item */
    const int64_t items = num_seqs * groups;
#pragma omp parallel num_threads(nthreads) if (items > 1)
    {
        int64_t cap = 0;
        float *scores = NULL;
        float *acc = (float *)kernel_scratch((size_t)(per * latent_rank) * sizeof(float));
        float *mx = (float *)kernel_scratch((size_t)per * sizeof(float));
        float *qt = (float *)kernel_scratch((size_t)((per + DOT_HEADS - 1) / DOT_HEADS * DOT_HEADS * width)
                                            * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t s = it / groups, h0 = (it % groups) * per;
            const int64_t nh = num_heads - h0 < per ? num_heads - h0 : per;
            const int64_t S = seq_lens[s];
            if (nh <= 0 || S <= 0) continue;
            if (S * nh > cap) {
                cap = S * nh;
                free(scores);
                scores = (float *)kernel_scratch((size_t)cap * sizeof(float));
            }
            mla_item(q + (s * num_heads + h0) * width, out + (s * num_heads + h0) * latent_rank, cache,
                     block_tables + s * bt_stride, positions ? positions + s * pos_stride : 0, S, nh, latent_rank,
                     width, block_size, scale, scores, acc, mx, qt);
        }
        free(scores);
        free(acc);
        free(mx);
        free(qt);
    }
}
/* ==== end of MLA latent decode ================================================================ */
