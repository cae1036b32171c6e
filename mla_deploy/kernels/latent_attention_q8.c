/* MLA's absorbed decode attention over an int8 latent cache (latent_attention_q8.h): the arithmetic, one function per
 * step and path. Per range of slots: the scores with heads in the lanes of a register (each cache row read once for
 * Q8_LANES heads, no horizontal sums, the softmax over slots a running maximum per lane), then probs @ latent with
 * 16 (8 on AVX2) channels of two slots in the lanes, each head's pair of probabilities broadcast. */
#include "latent_attention_q8.h"
#include "latent_attention.h"
#include "widen.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define Q8_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE_AVX2 static inline __attribute__((always_inline)) Q8_AVX2
#define INLINE_AVX512 static inline __attribute__((always_inline)) Q8_AVX512
#define SB 8    /* slots per register block of the AVX-512 scores */
#define SB2 4   /* the same on AVX2 (two registers of heads each) */
#define PMAX 32767 /* the largest 16-bit probability */

/* what one range task works on: its visible slots and its scratch */
typedef struct {
    int64_t row, n, n2;                 /* visible slots; n rounded up to even (a pair per probs @ latent step) */
    const int8_t *c[Q8_RANGE + 1];      /* their codes (c[n] = c[n - 1] where n is odd: its probability is 0) */
    const void *r[Q8_RANGE];            /* their rope rows */
    float sc[Q8_RANGE], added[Q8_RANGE]; /* their scales; their bias (0 for a blind row) */
    float *score;                       /* [n, lanes]: scores, then p · sc */
    int16_t *p16;                       /* [n2 / 2, heads, 2]: each head's probabilities of a pair of slots together */
    float *top, *sum, *pscale;          /* [lanes] */
    float *ropef;                       /* [SB, d_r]: rope rows widened */
    int16_t *c16;                       /* [SB2, d_c]: AVX2's rows widened */
    float *part;                        /* this task's [heads, d_c + 2] of the partial results */
} Task;

/* The cache lines of the next block of slots (its codes and rope rows), asked for one per step of this block's
 * product loop. In a decode step the weights have just streamed through the caches, so every row comes from memory:
 * unasked, the first read of a row waited on it for 30-44 % of the scores' time, and asked for all at once at the
 * block's start, the lines came too late to help (the misses a core keeps in flight are few); spread over the loop,
 * the wait fell to 8 % and the step at 16k by 12 % (benchmarks/attention_kernels.py, docs/long-context.md). */
#define AHEAD_LINES 128
typedef struct {
    const char *line[AHEAD_LINES];
    int64_t n;
} Ahead;

static inline void lines_ahead(const LatentAttentionQ8 *job, const Task *t, int64_t i0, int64_t count, Ahead *a) {
    const int64_t rope_bytes = job->rope * strip_kind_bytes(job->rope_kind);
    a->n = 0;
    for (int64_t i = i0; i < t->n && i < i0 + count; i++) {
        for (int64_t k = 0; k < job->latent && a->n < AHEAD_LINES; k += 64) a->line[a->n++] = (const char *)t->c[i] + k;
        for (int64_t k = 0; k < rope_bytes && a->n < AHEAD_LINES; k += 64) a->line[a->n++] = (const char *)t->r[i] + k;
    }
}

static inline void ask_ahead(const Ahead *a, int64_t j) {
    if (j < a->n) __builtin_prefetch(a->line[j]);
}

/* ---- plain C: the reference every path matches bit for bit ---- */

/* e^x as exp16 / exp8 compute it, one value: x = n ln 2 + r, Cephes' degree-6 polynomial for e^r (relative error
 * ~2e-7), x clamped to [-87.3, 88.3] */
static float exp_q8(float x) {
    if (x != x) return x; /* e^NaN is NaN (and NaN never reaches the integer conversion below) */
    x = fminf(fmaxf(x, -87.3f), 88.3f);
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y, r * r, r + 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static int16_t probability16(float w, float inv) {
    float v = nearbyintf(w * inv);
    return (int16_t)(v > PMAX ? PMAX : v == v ? v : 0); /* NaN (a NaN score): 0, its range's sum NaN */
}

/* where head h's probability of slot i lives in p16 */
static inline int64_t p16_at(const Task *t, int64_t heads, int64_t h, int64_t i) { (void)t; return (i / 2 * heads + h) * 2 + i % 2; }

static void scores_scalar(const LatentAttentionQ8 *job, Task *t) {
    const int64_t lanes = job->lanes, dc = job->latent, dr = job->rope;
    const int8_t *q8 = (const int8_t *)job->q_packed + t->row * job->q_packed_row; /* [lanes, d_c] */
    const float *qs = job->q_scale + t->row * lanes, *qr = job->q_rope_packed + t->row * dr * lanes;
    for (int64_t i = 0; i < t->n; i++)
        for (int64_t h = 0; h < job->heads; h++) {
            int32_t dot = 0;
            for (int64_t k = 0; k < dc; k++) dot += q8[h * dc + k] * t->c[i][k];
            float lat = (float)dot * (qs[h] * t->sc[i]), r = 0.0f;
            for (int64_t k = 0; k < dr; k++) r = fmaf(qr[k * lanes + h], stored_value(t->r[i], k, job->rope_kind), r);
            t->score[i * lanes + h] = job->blind[t->row] ? 0.0f : (lat + r) + t->added[i];
        }
}

static void softmax_scalar(const LatentAttentionQ8 *job, Task *t) {
    const int64_t lanes = job->lanes;
    for (int64_t h = 0; h < job->heads; h++) {
        float top = -INFINITY, sum = 0.0f, wmax = 0.0f;
        for (int64_t i = 0; i < t->n; i++) top = fmaxf(top, t->score[i * lanes + h]);
        for (int64_t i = 0; i < t->n; i++) {
            float p = exp_q8(t->score[i * lanes + h] - top), w = p * t->sc[i];
            sum += p;
            t->score[i * lanes + h] = w;
            wmax = fmaxf(wmax, w);
        }
        float inv = wmax > 0.0f ? PMAX / wmax : 0.0f;
        for (int64_t i = 0; i < t->n; i++) t->p16[p16_at(t, job->heads, h, i)] = probability16(t->score[i * lanes + h], inv);
        t->top[h] = top, t->sum[h] = sum, t->pscale[h] = wmax / PMAX;
    }
}

static void weighted_scalar(const LatentAttentionQ8 *job, Task *t) {
    const int64_t dc = job->latent;
    for (int64_t h = 0; h < job->heads; h++)
        for (int64_t k = 0; k < dc; k++) {
            int32_t acc = 0;
            for (int64_t i = 0; i < t->n2; i++) acc += t->p16[p16_at(t, job->heads, h, i)] * t->c[i][k];
            t->part[h * (dc + 2) + k] = (float)acc * t->pscale[h];
        }
}

/* ---- AVX2: 16-bit products (vpmaddwd), 8 heads or channels a register ---- */

INLINE_AVX2 __m256 exp8_q8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x)); /* a NaN stays NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

/* rope rows [ns] of this block as float32 into ropef [ns, d_r] */
Q8_AVX2 static void widen_rope_avx2(const LatentAttentionQ8 *job, const void *const *rows, int ns, float *ropef) {
    for (int s = 0; s < ns; s++)
        for (int64_t k = 0; k < job->rope; k += 8) {
            __m256 v;
            if (job->rope_kind == STRIP_F32) {
                v = _mm256_loadu_ps((const float *)rows[s] + k);
            } else {
                __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)rows[s] + k));
                v = job->rope_kind == STRIP_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                                 : _mm256_cvtph_ps(h);
            }
            _mm256_storeu_ps(ropef + s * job->rope + k, v);
        }
}

/* scores of slots [i0, i0 + ns) for lanes [hb, hb + 8): their rows widened in c16 [ns, d_c], ropef [ns, d_r] */
INLINE_AVX2 void score_block_avx2(const int ns, const LatentAttentionQ8 *job, Task *t, int64_t i0, int64_t hb,
                                  const int16_t *c16, const float *ropef, const Ahead *ahead) {
    const int64_t lanes = job->lanes, dc = job->latent, dr = job->rope;
    const int16_t *qp = (const int16_t *)job->q_packed + t->row * job->q_packed_row / 2; /* [d_c / 2, lanes, 2] */
    const float *qr = job->q_rope_packed + t->row * dr * lanes + hb;
    __m256i acc[SB2];
    for (int s = 0; s < ns; s++) acc[s] = _mm256_setzero_si256();
    for (int64_t j = 0; j < dc / 2; j++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qp + (j * lanes + hb) * 2));
        ask_ahead(ahead, j);
        for (int s = 0; s < ns; s++) {
            int32_t pair;
            memcpy(&pair, c16 + s * dc + 2 * j, sizeof pair);
            acc[s] = _mm256_add_epi32(acc[s], _mm256_madd_epi16(q, _mm256_set1_epi32(pair)));
        }
    }
    __m256 r[SB2]; /* the rope's dot products, one chain per slot, k in order */
    for (int s = 0; s < ns; s++) r[s] = _mm256_setzero_ps();
    for (int64_t k = 0; k < dr; k++) {
        __m256 q = _mm256_loadu_ps(qr + k * lanes);
        for (int s = 0; s < ns; s++) r[s] = _mm256_fmadd_ps(q, _mm256_set1_ps(ropef[s * dr + k]), r[s]);
    }
    __m256 qs = _mm256_loadu_ps(job->q_scale + t->row * lanes + hb);
    for (int s = 0; s < ns; s++) {
        __m256 lat = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[s]), _mm256_mul_ps(qs, _mm256_set1_ps(t->sc[i0 + s])));
        __m256 score = job->blind[t->row] ? _mm256_setzero_ps()
                                          : _mm256_add_ps(_mm256_add_ps(lat, r[s]), _mm256_set1_ps(t->added[i0 + s]));
        _mm256_storeu_ps(t->score + (i0 + s) * lanes + hb, score);
    }
}

Q8_AVX2 static void scores_avx2(const LatentAttentionQ8 *job, Task *t) {
    for (int64_t i0 = 0; i0 < t->n; i0 += SB2) {
        int ns = t->n - i0 < SB2 ? (int)(t->n - i0) : SB2;
        Ahead ahead;
        lines_ahead(job, t, i0 + SB2, SB2, &ahead);
        for (int s = 0; s < ns; s++) /* the rows as 16-bit values, read once for every head */
            for (int64_t k = 0; k < job->latent; k += 16)
                _mm256_storeu_si256((__m256i *)(t->c16 + s * job->latent + k),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(t->c[i0 + s] + k))));
        widen_rope_avx2(job, t->r + i0, ns, t->ropef);
        for (int64_t hb = 0; hb < job->lanes; hb += 8)
            if (ns == SB2)
                score_block_avx2(SB2, job, t, i0, hb, t->c16, t->ropef, &ahead);
            else /* the block's edge, a slot at a time */
                for (int s = 0; s < ns; s++)
                    score_block_avx2(1, job, t, i0 + s, hb, t->c16 + s * job->latent, t->ropef + s * job->rope, &ahead);
    }
}

/* round(w · inv) of 8 lanes, at most PMAX */
INLINE_AVX2 __m256i probability16_avx2(const float *w, __m256 inv) {
    return _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w), inv)), _mm256_set1_epi32(PMAX));
}

/* the 16-bit probabilities of lanes [hb, hb + 8): from w = p · sc in score, transposed into p16 [heads, n2] */
Q8_AVX2 static void softmax_avx2(const LatentAttentionQ8 *job, Task *t) {
    const int64_t lanes = job->lanes;
    for (int64_t hb = 0; hb < job->heads; hb += 8) {
        __m256 top = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps(), wmax = _mm256_setzero_ps();
        for (int64_t i = 0; i < t->n; i++) top = _mm256_max_ps(top, _mm256_loadu_ps(t->score + i * lanes + hb));
        for (int64_t i = 0; i < t->n; i++) {
            __m256 p = exp8_q8(_mm256_sub_ps(_mm256_loadu_ps(t->score + i * lanes + hb), top));
            __m256 w = _mm256_mul_ps(p, _mm256_set1_ps(t->sc[i]));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(t->score + i * lanes + hb, w);
            wmax = _mm256_max_ps(wmax, w);
        }
        __m256 positive = _mm256_cmp_ps(wmax, _mm256_setzero_ps(), _CMP_GT_OQ);
        __m256 inv = _mm256_and_ps(positive, _mm256_div_ps(_mm256_set1_ps((float)PMAX), wmax));
        int nh = job->heads - hb < 8 ? (int)(job->heads - hb) : 8;
        __m256i real = _mm256_cmpgt_epi32(_mm256_set1_epi32(nh), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); /* lanes */
        for (int64_t i = 0; i < t->n; i += 2) { /* a pair of slots: each head's two 16-bit values in one 32-bit lane */
            __m256i even = probability16_avx2(t->score + i * lanes + hb, inv);
            __m256i odd = i + 1 < t->n ? probability16_avx2(t->score + (i + 1) * lanes + hb, inv)
                                       : _mm256_setzero_si256();
            __m256i pairs = _mm256_or_si256(even, _mm256_slli_epi32(odd, 16)); /* both in [0, PMAX] */
            _mm256_maskstore_epi32((int32_t *)(t->p16 + p16_at(t, job->heads, hb, i)), real, pairs);
        }
        _mm256_storeu_ps(t->top + hb, top);
        _mm256_storeu_ps(t->sum + hb, sum);
        _mm256_storeu_ps(t->pscale + hb, _mm256_div_ps(wmax, _mm256_set1_ps((float)PMAX)));
    }
}

INLINE_AVX2 void weighted_block_avx2(const int nh, const LatentAttentionQ8 *job, Task *t, int64_t h0, int64_t k0) {
    __m256i acc[8];
    for (int h = 0; h < nh; h++) acc[h] = _mm256_setzero_si256();
    for (int64_t i = 0; i < t->n2; i += 2) {
        __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t->c[i] + k0)));
        __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t->c[i + 1] + k0)));
        __m256i b = _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA); /* channel j: (c[i][j], c[i + 1][j]) */
        const int16_t *pairs = t->p16 + p16_at(t, job->heads, h0, i);
        for (int h = 0; h < nh; h++) {
            int32_t pair;
            memcpy(&pair, pairs + 2 * h, sizeof pair);
            acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(b, _mm256_set1_epi32(pair)));
        }
    }
    const int64_t dc = job->latent;
    for (int h = 0; h < nh; h++)
        _mm256_storeu_ps(t->part + (h0 + h) * (dc + 2) + k0,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(acc[h]), _mm256_set1_ps(t->pscale[h0 + h])));
}

Q8_AVX2 static void weighted_avx2(const LatentAttentionQ8 *job, Task *t) {
    for (int64_t h0 = 0; h0 < job->heads; h0 += 8)
        for (int64_t k0 = 0; k0 < job->latent; k0 += 8) {
            int64_t nh = job->heads - h0;
            if (nh >= 8)
                weighted_block_avx2(8, job, t, h0, k0);
            else if (nh == 4)
                weighted_block_avx2(4, job, t, h0, k0);
            else
                for (int64_t h = 0; h < nh; h++) weighted_block_avx2(1, job, t, h0 + h, k0);
        }
}

/* ---- AVX-512 VNNI: 8-bit products for the scores (vpdpbusd), 16-bit for probs @ latent (vpdpwssd) ---- */

/* acc + the products, in place: GCC's intrinsics leave each accumulator's register untied across a loop's iterations
 * and copy it there and back every step, so the two products are written out with the accumulator as operand 0 */
INLINE_AVX512 __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
INLINE_AVX512 __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

INLINE_AVX512 __m512 exp16_q8(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x)); /* a NaN stays NaN */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(two_n));
}

/* sum_k c[k] over d_c codes (a multiple of 16) */
Q8_AVX512 static int32_t code_sum_avx512(const int8_t *c, int64_t dc) {
    __m512i acc = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
    for (int64_t k = 0; k < dc; k += 64) {
        __mmask64 m = dc - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (dc - k)) - 1;
        acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(m, c + k));
    }
    return _mm512_reduce_add_epi32(acc);
}

/* scores of slots [i0, i0 + ns) for lanes [hb, hb + 16): the sums of their codes in csum [ns], rope in ropef [ns, d_r] */
INLINE_AVX512 void score_block_avx512(const int ns, const LatentAttentionQ8 *job, Task *t, int64_t i0, int64_t hb,
                                      const int32_t *csum, const float *ropef, const Ahead *ahead) {
    const int64_t lanes = job->lanes, dc = job->latent, dr = job->rope;
    const uint8_t *qp = (const uint8_t *)job->q_packed + t->row * job->q_packed_row; /* [d_c / 4, lanes, 4] */
    const float *qr = job->q_rope_packed + t->row * dr * lanes + hb;
    __m512i acc[SB];
    for (int s = 0; s < ns; s++) acc[s] = _mm512_setzero_si512();
    for (int64_t j = 0; j < dc / 4; j++) {
        __m512i q = _mm512_loadu_si512(qp + (j * lanes + hb) * 4);
        ask_ahead(ahead, j);
        for (int s = 0; s < ns; s++) {
            int32_t quad;
            memcpy(&quad, t->c[i0 + s] + 4 * j, sizeof quad);
            acc[s] = dpbusd(acc[s], q, _mm512_set1_epi32(quad));
        }
    }
    __m512 r[SB]; /* the rope's dot products, one chain per slot, k in order */
    for (int s = 0; s < ns; s++) r[s] = _mm512_setzero_ps();
    for (int64_t k = 0; k < dr; k++) {
        __m512 q = _mm512_loadu_ps(qr + k * lanes);
        for (int s = 0; s < ns; s++) r[s] = _mm512_fmadd_ps(q, _mm512_set1_ps(ropef[s * dr + k]), r[s]);
    }
    __m512 qs = _mm512_loadu_ps(job->q_scale + t->row * lanes + hb);
    for (int s = 0; s < ns; s++) {
        __m512i dot = _mm512_sub_epi32(acc[s], _mm512_set1_epi32(128 * csum[s])); /* the codes' + 128 taken back */
        __m512 lat = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(qs, _mm512_set1_ps(t->sc[i0 + s])));
        __m512 score = job->blind[t->row] ? _mm512_setzero_ps()
                                          : _mm512_add_ps(_mm512_add_ps(lat, r[s]), _mm512_set1_ps(t->added[i0 + s]));
        _mm512_storeu_ps(t->score + (i0 + s) * lanes + hb, score);
    }
}

Q8_AVX512 static void scores_avx512(const LatentAttentionQ8 *job, Task *t) {
    for (int64_t i0 = 0; i0 < t->n; i0 += SB) {
        int ns = t->n - i0 < SB ? (int)(t->n - i0) : SB;
        Ahead ahead;
        lines_ahead(job, t, i0 + SB, SB, &ahead);
        int32_t csum[SB];
        for (int s = 0; s < ns; s++) csum[s] = code_sum_avx512(t->c[i0 + s], job->latent);
        widen_rope_avx2(job, t->r + i0, ns, t->ropef);
        for (int64_t hb = 0; hb < job->lanes; hb += 16)
            if (ns == SB)
                score_block_avx512(SB, job, t, i0, hb, csum, t->ropef, &ahead);
            else /* the block's edge, a slot at a time */
                for (int s = 0; s < ns; s++)
                    score_block_avx512(1, job, t, i0 + s, hb, csum + s, t->ropef + s * job->rope, &ahead);
    }
}

/* round(w · inv) of 16 lanes, at most PMAX */
INLINE_AVX512 __m512i probability16_avx512(const float *w, __m512 inv) {
    return _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w), inv)), _mm512_set1_epi32(PMAX));
}

Q8_AVX512 static void softmax_avx512(const LatentAttentionQ8 *job, Task *t) {
    const int64_t lanes = job->lanes;
    for (int64_t hb = 0; hb < job->heads; hb += 16) {
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
        for (int64_t i = 0; i < t->n; i++) top = _mm512_max_ps(top, _mm512_loadu_ps(t->score + i * lanes + hb));
        for (int64_t i = 0; i < t->n; i++) {
            __m512 p = exp16_q8(_mm512_sub_ps(_mm512_loadu_ps(t->score + i * lanes + hb), top));
            __m512 w = _mm512_mul_ps(p, _mm512_set1_ps(t->sc[i]));
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(t->score + i * lanes + hb, w);
            wmax = _mm512_max_ps(wmax, w);
        }
        __mmask16 positive = _mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ);
        __m512 inv = _mm512_maskz_div_ps(positive, _mm512_set1_ps((float)PMAX), wmax);
        int nh = job->heads - hb < 16 ? (int)(job->heads - hb) : 16;
        for (int64_t i = 0; i < t->n; i += 2) { /* a pair of slots: each head's two 16-bit values in one 32-bit lane */
            __m512i even = probability16_avx512(t->score + i * lanes + hb, inv);
            __m512i odd = i + 1 < t->n ? probability16_avx512(t->score + (i + 1) * lanes + hb, inv)
                                       : _mm512_setzero_si512();
            __m512i pairs = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)); /* both in [0, PMAX] */
            _mm512_mask_storeu_epi32(t->p16 + p16_at(t, job->heads, hb, i), (__mmask16)((1u << nh) - 1), pairs);
        }
        _mm512_storeu_ps(t->top + hb, top);
        _mm512_storeu_ps(t->sum + hb, sum);
        _mm512_storeu_ps(t->pscale + hb, _mm512_div_ps(wmax, _mm512_set1_ps((float)PMAX)));
    }
}

INLINE_AVX512 void weighted_block_avx512(const int nh, const LatentAttentionQ8 *job, Task *t, int64_t h0, int64_t k0) {
    __m512i acc[16];
    for (int h = 0; h < nh; h++) acc[h] = _mm512_setzero_si512();
    for (int64_t i = 0; i < t->n2; i += 2) {
        __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t->c[i] + k0)));
        __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t->c[i + 1] + k0)));
        __m512i b = _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, _mm512_slli_epi32(hi, 16)); /* (c[i][j], c[i + 1][j]) */
        const int16_t *pairs = t->p16 + p16_at(t, job->heads, h0, i);
        for (int h = 0; h < nh; h++) {
            int32_t pair;
            memcpy(&pair, pairs + 2 * h, sizeof pair);
            acc[h] = dpwssd(acc[h], b, _mm512_set1_epi32(pair));
        }
    }
    const int64_t dc = job->latent;
    for (int h = 0; h < nh; h++)
        _mm512_storeu_ps(t->part + (h0 + h) * (dc + 2) + k0,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h]), _mm512_set1_ps(t->pscale[h0 + h])));
}

Q8_AVX512 static void weighted_avx512(const LatentAttentionQ8 *job, Task *t) {
    for (int64_t h0 = 0; h0 < job->heads; h0 += 16)
        for (int64_t k0 = 0; k0 < job->latent; k0 += 16) {
            int64_t nh = job->heads - h0;
            if (nh >= 16)
                weighted_block_avx512(16, job, t, h0, k0);
            else if (nh >= 8) {
                weighted_block_avx512(8, job, t, h0, k0);
                for (int64_t h = 8; h < nh; h++) weighted_block_avx512(1, job, t, h0 + h, k0);
            } else if (nh == 4)
                weighted_block_avx512(4, job, t, h0, k0);
            else
                for (int64_t h = 0; h < nh; h++) weighted_block_avx512(1, job, t, h0 + h, k0);
        }
}

/* ---- the steps onnxruntime calls (custom_ops.c) ---- */

static int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

int latent_attention_q8_plan(LatentAttentionQ8 *job) {
    const int64_t b = job->rows, h = job->heads, dc = job->latent, dr = job->rope;
    job->lanes = round_up(h, Q8_LANES);
    job->splits = (job->capacity + Q8_RANGE - 1) / Q8_RANGE;
    job->q_packed_row = job->lanes * dc * (job->isa == ISA_AVX2 ? 2 : 1);
    size_t partial = (size_t)(b * job->splits * h * (dc + 2)), queries = (size_t)(b * job->lanes * (1 + dr));
    size_t bytes = (partial + queries) * sizeof(float) + (size_t)(b * job->q_packed_row) + (size_t)b;
    if (!(job->partial = malloc(bytes))) return -1;
    job->q_scale = job->partial + partial;
    job->q_rope_packed = job->q_scale + b * job->lanes;
    job->q_packed = job->q_rope_packed + b * dr * job->lanes;
    job->blind = (uint8_t *)job->q_packed + b * job->q_packed_row;
    memset(job->q_scale, 0, queries * sizeof(float));
    /* a padding lane's code is 0: + 128 on AVX-512, whose unsigned operand is the code + 128 */
    memset(job->q_packed, job->isa == ISA_AVX512 ? 128 : 0, (size_t)(b * job->q_packed_row));
    for (int64_t r = 0; r < b; r++)
        for (int64_t head = 0; head < h; head++) {
            const float *q = job->q_latent + (r * h + head) * dc;
            float peak = 0.0f;
            int nan = 0;
            for (int64_t k = 0; k < dc; k++) peak = fmaxf(peak, fabsf(q[k])), nan |= !isfinite(q[k]);
            float qs = nan ? NAN : peak / 127.0f; /* a NaN or infinite query: every score NaN, on every path */
            job->q_scale[r * job->lanes + head] = qs;
            for (int64_t k = 0; k < dc; k++) {
                float v = qs > 0.0f ? nearbyintf(q[k] / qs) : 0.0f; /* NaN: 0 (qs > 0 is false) */
                int8_t code = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
                uint8_t *row = (uint8_t *)job->q_packed + r * job->q_packed_row;
                if (job->isa == ISA_AVX512) /* [d_c / 4, lanes, 4], + 128 */
                    row[((k / 4) * job->lanes + head) * 4 + k % 4] = (uint8_t)(code + 128);
                else if (job->isa == ISA_AVX2) /* [d_c / 2, lanes, 2] 16-bit */
                    ((int16_t *)row)[((k / 2) * job->lanes + head) * 2 + k % 2] = code;
                else /* [lanes, d_c] */
                    ((int8_t *)row)[head * dc + k] = code;
            }
            for (int64_t k = 0; k < dr; k++)
                job->q_rope_packed[(r * dr + k) * job->lanes + head] = job->q_rope[(r * h + head) * dr + k];
        }
    for (int64_t r = 0; r < b; r++) {
        const float *bias = job->bias + r * job->capacity;
        int64_t s = 0;
        while (s < job->capacity && !(bias[s] > -FLT_MAX)) s++;
        job->blind[r] = s == job->capacity;
    }
    return 0;
}

void latent_attention_q8_release(LatentAttentionQ8 *job) {
    free(job->partial);
    job->partial = NULL;
}

void latent_attention_q8_range(LatentAttentionQ8 *job, int64_t task) {
    const int64_t row = task % job->rows, split = task / job->rows, cache_row = row / job->queries;
    const int64_t s0 = split * Q8_RANGE, cap = job->capacity;
    const int64_t s1 = s0 + Q8_RANGE < cap ? s0 + Q8_RANGE : cap, dc = job->latent, dr = job->rope;
    const int64_t lanes = job->lanes, heads = job->heads;
    const float *bias = job->bias + row * cap;
    Task t;
    t.row = row, t.n = 0;
    t.part = job->partial + (row * job->splits + split) * heads * (dc + 2);
    for (int64_t s = s0; s < s1; s++)
        if (job->blind[row] || bias[s] > -FLT_MAX) {
            t.c[t.n] = job->codes + (cache_row * cap + s) * dc;
            t.r[t.n] = (const char *)job->rope_cache + (cache_row * cap + s) * dr * strip_kind_bytes(job->rope_kind);
            t.sc[t.n] = job->scales[cache_row * cap + s];
            t.added[t.n++] = job->blind[row] ? 0.0f : bias[s];
        }
    t.n2 = t.n + (t.n & 1);
    if (t.n) t.c[t.n2 - 1] = t.c[t.n - 1]; /* an odd count's pair partner: probability 0 */
    size_t floats = (size_t)(t.n * lanes + 3 * lanes + SB * dr), shorts = (size_t)(heads * t.n2 + SB2 * dc);
    char *scratch = t.n ? malloc(floats * sizeof(float) + shorts * sizeof(int16_t)) : NULL;
    if (!scratch) {
        if (t.n) __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        for (int64_t h = 0; h < heads; h++) t.part[h * (dc + 2) + dc] = -INFINITY, t.part[h * (dc + 2) + dc + 1] = 0.0f;
        return; /* no slot seen in this range: the combine skips it */
    }
    t.score = (float *)scratch;
    t.top = t.score + t.n * lanes, t.sum = t.top + lanes, t.pscale = t.sum + lanes, t.ropef = t.pscale + lanes;
    t.p16 = (int16_t *)(t.ropef + SB * dr);
    t.c16 = t.p16 + heads * t.n2;
    for (int64_t h = 0; h < heads; h++) t.p16[p16_at(&t, heads, h, t.n2 - 1)] = 0;
    if (job->isa == ISA_AVX512) {
        scores_avx512(job, &t);
        softmax_avx512(job, &t);
        weighted_avx512(job, &t);
    } else if (job->isa == ISA_AVX2) {
        scores_avx2(job, &t);
        softmax_avx2(job, &t);
        weighted_avx2(job, &t);
    } else {
        scores_scalar(job, &t);
        softmax_scalar(job, &t);
        weighted_scalar(job, &t);
    }
    for (int64_t h = 0; h < heads; h++) t.part[h * (dc + 2) + dc] = t.top[h], t.part[h * (dc + 2) + dc + 1] = t.sum[h];
    free(scratch);
}

void latent_attention_q8_combine(LatentAttentionQ8 *job, int64_t task) {
    latent_ranges_combine(job->partial, job->splits, job->heads, job->latent, job->out, task);
}
