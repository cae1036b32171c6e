/* The arithmetic of mla_deploy's quantized MatMul (qmatmul.h), three paths chosen by dispatch.h's level:
 * - plain C: the reference, any x86-64 CPU;
 * - AVX-512 VNNI: one 512-bit register holds 16 columns x 4 consecutive k of a group's run (as the layout stores
 *   them), so vpdpbusd against 4 activation bytes broadcast to every lane adds one k-quad to 16 column sums;
 *   int4 runs become two such registers by a mask and a shift;
 * - AVX2: the same on 256-bit halves of a group (8 columns), vpmaddubsw + vpmaddwd instead of vpdpbusd: int4
 *   codes (0..15) times activations stay below 2^15 in 16-bit lanes for 8 quads, int6 codes (0..63) for one,
 *   int8 codes go through vpsignb (|w| times a with w's sign) so that no 16-bit lane saturates.
 * int6 runs are an int4 run of the codes' low nibbles followed by their high 2 bits, four quads to a 64-byte piece
 * (qmatmul.h): a mask, a shift and an or per quad on top of int4's unpacking.
 * The unsigned weight codes are the multiplicand vpdpbusd and vpmaddubsw want; each block's sum starts at the zero
 * point's share -z · sum(a), which qmatmul_quantize_row stores beside the codes (a load, not a multiply, per block).
 *
 * A product runs in tiles of R rows x G groups (R·G 16-column accumulators in registers across all of K): each
 * weight run is unpacked once per tile and multiplied by R rows from registers, each activation broadcast once per
 * tile and used by G groups. Up to 8 rows (decode, batched decode) take one group and every row: a single stream
 * through the weight, its runs unpacked once for all the rows; more rows (prefill) 6 x 2 (tile_shape).
 */
#include "qmatmul.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_simd.h"

#define MAX_TILE 12 /* R·G accumulators */

typedef struct {
    const QWeight *w;
    int level;
    int64_t g;                  /* first group */
    int last;                   /* columns of the tile's last group to write (1..16) */
    const int8_t *q[MAX_TILE];  /* level 4: row r's codes */
    const float *as[MAX_TILE];  /* level 4: row r's block scales */
    const int32_t *offset[MAX_TILE];
    const float *f[MAX_TILE];   /* level 0: row r */
    float *y[MAX_TILE];         /* row r of Y at the tile's first column */
} Tile;

float qmatmul_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    float f;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa · 2^-24, exact in float32 */
        f = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof(bits));
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* ---------- plain C: the reference every path equals ---------- */

static void scalar_product(const QWeight *w, const QActs *a, int64_t r0, int64_t r1, int64_t g0, int64_t g1, float *y,
                           int64_t ldy) {
    const int64_t run = qweight_run_bytes(w);
    const int z = 1 << (w->bits - 1), block = w->block;
    for (int64_t r = r0; r < r1; r++) {
        int64_t row = a->index ? a->index[r] : r;
        for (int64_t g = g0; g < g1; g++) {
            float acc[QCOLS] = {0};
            for (int64_t j = 0; j < w->kb; j++) {
                const uint8_t *codes = w->codes + (g * w->kb + j) * run;
                const uint16_t *scales = w->scales + (g * w->kb + j) * QCOLS;
                for (int c = 0; c < QCOLS; c++) {
                    float ws = qmatmul_half_to_float(scales[c]);
                    if (a->level == 4) {
                        const int8_t *q = a->q + row * a->lda + j * block;
                        int32_t sum = 0;
                        for (int kk = 0; kk < block; kk++) sum += (qweight_code(codes, w->bits, block, kk, c) - z) * q[kk];
                        acc[c] = fmaf((float)sum, ws * a->scale[row * w->kb + j], acc[c]);
                    } else {
                        const float *f = a->f + row * a->lda + j * block;
                        float sum = 0.0f;
                        for (int kk = 0; kk < block; kk++)
                            sum = fmaf(f[kk], (float)(qweight_code(codes, w->bits, block, kk, c) - z), sum);
                        acc[c] = fmaf(sum, ws, acc[c]);
                    }
                }
            }
            int64_t cols = w->n - g * QCOLS < QCOLS ? w->n - g * QCOLS : QCOLS;
            memcpy(y + (r - r0) * ldy + (g - g0) * QCOLS, acc, sizeof(float) * (size_t)cols);
        }
    }
}

/* 127 / max|x| of a block, 0 where that is not a finite float: a block of zeros, or one whose largest value is below
 * 127 / FLT_MAX (about 3.7e-37, subnormals included), quantizes to zeros with its scale, never to infinities. */
static inline float quantize_inverse(float amax) { return amax > 127.0f / FLT_MAX ? 127.0f / amax : 0.0f; }

/* cvtps2dq's conversion (round half to even; INT32_MIN for a NaN or a value out of range) and packsswb's saturation,
 * so that a non-finite activation gives the scalar path the SIMD paths' codes and sum, not undefined behaviour. */
static inline int32_t cvt_like_simd(float v) {
    float r = nearbyintf(v);
    return r >= -2147483648.0f && r < 2147483648.0f ? (int32_t)r : INT32_MIN;
}

static void quantize_block_scalar(const float *x, int block, int8_t *q, float *scale, int32_t *sum) {
    float amax = 0.0f;
    for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = quantize_inverse(amax);
    uint32_t total = 0; /* wraps as the SIMD paths' int32 lanes do */
    for (int i = 0; i < block; i++) {
        int32_t v = cvt_like_simd(x[i] * inv);
        q[i] = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v), total += (uint32_t)v;
    }
    *scale = amax / 127.0f, *sum = (int32_t)total;
}

/* Ask for the weight bytes PREFETCH_BYTES ahead of a run being read, into L1: a group's runs lie end to end, so
 * that is where the stream goes next, across the 4 KB page boundaries where a core's hardware prefetchers stop. In an
 * int4 v2lite-2L decode step (2 threads, Zen 5, processes alternating) 2048 bytes ahead ran 0.60-0.96x the time of
 * no prefetch at batch 1 (6 of 6 pairs faster), 1024 and 3072-8192 less well. A prefetch never faults, so past the
 * end of the weight it is harmless. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *run) {
    if (PREFETCH_BYTES) _mm_prefetch((const char *)(run + PREFETCH_BYTES), _MM_HINT_T0);
}

/* group g's 16 scales of block j (g counted from the tile's first group) */
static inline const uint16_t *scales_at(const Tile *t, int g, int64_t j) {
    return t->w->scales + ((t->g + g) * t->w->kb + j) * QCOLS;
}

/* ---------- AVX2 ---------- */

/* the 32 bytes of half i (group i / 2, its columns 8 (i % 2) .. 8 (i % 2) + 7) at byte `at` of the groups' runs */
INLINE_AVX2 __m256i load_half(const uint8_t *runs, int64_t stride, int i, int64_t at) {
    return _mm256_loadu_si256((const __m256i *)(runs + i / 2 * stride + at + 32 * (i % 2)));
}

INLINE_AVX2 __m256 half_scales(const Tile *t, int i, int64_t j) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales_at(t, i / 2, j) + 8 * (i % 2))));
}

/* int6: the high 2 bits of int4 piece p's two quads (2p in the low nibbles, 2p + 1 in the high ones) from the high
 * part's piece p / 2 (bits 2 (quad % 4)), moved to bits 4-5 of lo and hi; the masks keep every byte's bits its own */
INLINE_AVX2 void high_bits_avx2(__m256i piece, int p, __m256i *lo, __m256i *hi) {
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    __m256i l = p % 2 ? piece : _mm256_slli_epi16(piece, 4);
    __m256i h = p % 2 ? _mm256_srli_epi16(piece, 2) : _mm256_slli_epi16(piece, 2);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(l, bits45));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(h, bits45));
}

/* int6 quad qd of a level-0 tile as signed codes: its low nibbles (int4 piece qd / 2) and high 2 bits */
INLINE_AVX2 __m256i int6_quad_avx2(const uint8_t *runs, int64_t stride, int i, int qd, int block) {
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256i v = load_half(runs, stride, i, 64 * (qd / 2));
    __m256i piece = load_half(runs, stride, i, 8 * block + 64 * (qd / 4));
    __m256i nibble = _mm256_and_si256(qd % 2 ? _mm256_srli_epi16(v, 4) : v, low);
    __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(piece, 2 * (qd % 4)), three), 4);
    return _mm256_sub_epi8(_mm256_or_si256(nibble, high), _mm256_set1_epi8(32));
}

INLINE_AVX2 void store_half(float *dst, __m256 v, int cols) { /* cols of 8 */
    if (cols >= 8) {
        _mm256_storeu_ps(dst, v);
    } else if (cols > 0) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(dst, tmp, sizeof(float) * (size_t)cols);
    }
}

/* level 4, R rows x G groups as 2G halves of 8 columns (16 registers: the compiler keeps some sums in L1) */
INLINE_AVX2 void int_tile_avx2(const Tile *t, const int R, const int G, const int bits) {
    const QWeight *w = t->w;
    const int block = w->block;
    const int64_t run = 2 * (int64_t)block * bits, stride = w->kb * run;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    __m256 out[MAX_TILE * 2];
    for (int i = 0; i < R * G * 2; i++) out[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *wp = w->codes + (t->g * w->kb + j) * run;
        __m256i acc[MAX_TILE * 2];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < G * 2; i++) acc[r * G * 2 + i] = _mm256_set1_epi32(bits != 8 ? t->offset[r][j] : 0);
        if (bits == 4) { /* 16-bit partial sums, at most 8 quads (|sum| <= 8 · 2 · 15 · 127) before widening */
            for (int p0 = 0; p0 < block / 8; p0 += 4) {
                __m256i part[MAX_TILE * 2];
                for (int i = 0; i < R * G * 2; i++) part[i] = _mm256_setzero_si256();
                for (int p = p0; p < p0 + 4 && p < block / 8; p++) {
                    __m256i lo[4], hi[4];
                    for (int i = 0; i < G * 2; i += 2) prefetch_ahead(wp + i / 2 * stride + 64 * p);
                    for (int i = 0; i < G * 2; i++) {
                        __m256i v = load_half(wp, stride, i, 64 * p);
                        lo[i] = _mm256_and_si256(v, low), hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    }
                    for (int r = 0; r < R; r++) {
                        const int8_t *q = t->q[r] + j * block + 8 * p;
                        __m256i a0 = _mm256_set1_epi32(load4(q)), a1 = _mm256_set1_epi32(load4(q + 4));
                        for (int i = 0; i < G * 2; i++)
                            part[r * G * 2 + i] = _mm256_add_epi16(part[r * G * 2 + i], _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo[i], a0), _mm256_maddubs_epi16(hi[i], a1)));
                    }
                }
                for (int i = 0; i < R * G * 2; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(part[i], ones));
            }
        } else if (bits == 6) { /* widened every quad pair: 2 · 63 · 127 twice fills a 16-bit lane */
            for (int p = 0; p < block / 8; p++) {
                __m256i lo[4], hi[4];
                for (int i = 0; i < G * 2; i += 2) {
                    prefetch_ahead(wp + i / 2 * stride + 64 * p);
                    if (p % 2 == 0) prefetch_ahead(wp + i / 2 * stride + 8 * block + 64 * (p / 2));
                }
                for (int i = 0; i < G * 2; i++) {
                    __m256i v = load_half(wp, stride, i, 64 * p);
                    lo[i] = _mm256_and_si256(v, low), hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    high_bits_avx2(load_half(wp, stride, i, 8 * block + 64 * (p / 2)), p, &lo[i], &hi[i]);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *q = t->q[r] + j * block + 8 * p;
                    __m256i a0 = _mm256_set1_epi32(load4(q)), a1 = _mm256_set1_epi32(load4(q + 4));
                    for (int i = 0; i < G * 2; i++)
                        acc[r * G * 2 + i] = _mm256_add_epi32(acc[r * G * 2 + i], _mm256_madd_epi16(_mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[i], a0), _mm256_maddubs_epi16(hi[i], a1)), ones));
                }
            }
        } else { /* signed codes: |w| times a with w's sign, each product pair below 2^15 */
            for (int qd = 0; qd < block / 4; qd++) {
                __m256i mag[4], sgn[4];
                for (int i = 0; i < G * 2; i += 2) prefetch_ahead(wp + i / 2 * stride + 64 * qd);
                for (int i = 0; i < G * 2; i++) {
                    sgn[i] = _mm256_xor_si256(load_half(wp, stride, i, 64 * qd), flip);
                    mag[i] = _mm256_abs_epi8(sgn[i]);
                }
                for (int r = 0; r < R; r++) {
                    __m256i av = _mm256_set1_epi32(load4(t->q[r] + j * block + 4 * qd));
                    for (int i = 0; i < G * 2; i++)
                        acc[r * G * 2 + i] = _mm256_add_epi32(acc[r * G * 2 + i], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(mag[i], _mm256_sign_epi8(av, sgn[i])), ones));
                }
            }
        }
        for (int i = 0; i < G * 2; i++) {
            __m256 ws = half_scales(t, i, j);
            for (int r = 0; r < R; r++) {
                __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(t->as[r][j]));
                out[r * G * 2 + i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r * G * 2 + i]), scale, out[r * G * 2 + i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G * 2; i++)
            store_half(t->y[r] + 8 * i, out[r * G * 2 + i], i / 2 < G - 1 ? 8 : t->last - 8 * (i % 2));
}

/* level 0: per block, sum a · (code - z) in float32 one k at a time, then times the scale */
INLINE_AVX2 void float_tile_avx2(const Tile *t, const int R, const int G, const int bits) {
    const QWeight *w = t->w;
    const int block = w->block;
    const int64_t run = 2 * (int64_t)block * bits, stride = w->kb * run;
    const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8), flip = _mm256_set1_epi8((char)0x80);
    __m256 out[MAX_TILE * 2];
    for (int i = 0; i < R * G * 2; i++) out[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *wp = w->codes + (t->g * w->kb + j) * run;
        __m256 sum[MAX_TILE * 2];
        for (int i = 0; i < R * G * 2; i++) sum[i] = _mm256_setzero_ps();
        for (int qd = 0; qd < block / 4; qd++) {
            __m256i quad[4]; /* signed codes, 8 columns x 4 k */
            for (int i = 0; i < G * 2; i++) {
                if (bits == 8) {
                    quad[i] = _mm256_xor_si256(load_half(wp, stride, i, 64 * qd), flip);
                } else if (bits == 6) {
                    quad[i] = int6_quad_avx2(wp, stride, i, qd, block);
                } else {
                    __m256i v = load_half(wp, stride, i, 64 * (qd / 2));
                    v = qd % 2 ? _mm256_srli_epi16(v, 4) : v;
                    quad[i] = _mm256_sub_epi8(_mm256_and_si256(v, low), eight);
                }
            }
            for (int tk = 0; tk < 4; tk++) {
                for (int i = 0; i < G * 2; i++) {
                    __m256 wf = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(quad[i], 24 - 8 * tk), 24));
                    for (int r = 0; r < R; r++) {
                        __m256 a = _mm256_set1_ps(t->f[r][j * block + 4 * qd + tk]);
                        sum[r * G * 2 + i] = _mm256_fmadd_ps(a, wf, sum[r * G * 2 + i]);
                    }
                }
            }
        }
        for (int i = 0; i < G * 2; i++) {
            __m256 ws = half_scales(t, i, j);
            for (int r = 0; r < R; r++)
                out[r * G * 2 + i] = _mm256_fmadd_ps(sum[r * G * 2 + i], ws, out[r * G * 2 + i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < G * 2; i++)
            store_half(t->y[r] + 8 * i, out[r * G * 2 + i], i / 2 < G - 1 ? 8 : t->last - 8 * (i % 2));
}

/* ---------- AVX-512 VNNI ---------- */

INLINE_AVX512 __m512 group_scales(const Tile *t, int g, int64_t j) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales_at(t, g, j)));
}

/* high_bits_avx2 and int6_quad_avx2 on whole groups */
INLINE_AVX512 void high_bits_avx512(__m512i piece, int p, __m512i *lo, __m512i *hi) {
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    __m512i l = p % 2 ? piece : _mm512_slli_epi16(piece, 4);
    __m512i h = p % 2 ? _mm512_srli_epi16(piece, 2) : _mm512_slli_epi16(piece, 2);
    *lo = _mm512_or_si512(*lo, _mm512_and_si512(l, bits45));
    *hi = _mm512_or_si512(*hi, _mm512_and_si512(h, bits45));
}

INLINE_AVX512 __m512i int6_quad_avx512(const uint8_t *run, int qd, int block) {
    const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    __m512i v = _mm512_loadu_si512(run + 64 * (qd / 2)), piece = _mm512_loadu_si512(run + 8 * block + 64 * (qd / 4));
    __m512i nibble = _mm512_and_si512(qd % 2 ? _mm512_srli_epi16(v, 4) : v, low);
    __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(piece, 2 * (qd % 4)), three), 4);
    return _mm512_sub_epi8(_mm512_or_si512(nibble, high), _mm512_set1_epi8(32));
}

INLINE_AVX512 void store_group(float *dst, __m512 v, int cols) {
    if (cols >= QCOLS) _mm512_storeu_ps(dst, v);
    else _mm512_mask_storeu_ps(dst, (__mmask16)((1u << cols) - 1), v);
}

/* level 4, R rows x G groups, the R·G float sums in registers across K */
INLINE_AVX512 void int_tile_avx512(const Tile *t, const int R, const int G, const int bits) {
    const QWeight *w = t->w;
    const int block = w->block;
    const int64_t run = 2 * (int64_t)block * bits, stride = w->kb * run;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 out[MAX_TILE];
    for (int i = 0; i < R * G; i++) out[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *wp = w->codes + (t->g * w->kb + j) * run;
        __m512i acc[MAX_TILE];
        for (int r = 0; r < R; r++) {
            __m512i start = _mm512_set1_epi32(t->offset[r][j]);
            for (int g = 0; g < G; g++) acc[r * G + g] = start;
        }
        if (bits == 8) {
            for (int qd = 0; qd < block / 4; qd++) {
                __m512i wv[4];
                for (int g = 0; g < G; g++) prefetch_ahead(wp + g * stride + 64 * qd);
                for (int g = 0; g < G; g++) wv[g] = _mm512_loadu_si512(wp + g * stride + 64 * qd);
                for (int r = 0; r < R; r++) {
                    __m512i av = _mm512_set1_epi32(load4(t->q[r] + j * block + 4 * qd));
                    for (int g = 0; g < G; g++) acc[r * G + g] = _mm512_dpbusd_epi32(acc[r * G + g], wv[g], av);
                }
            }
        } else {
            for (int p = 0; p < block / 8; p++) {
                __m512i lo[4], hi[4];
                for (int g = 0; g < G; g++) {
                    prefetch_ahead(wp + g * stride + 64 * p);
                    __m512i v = _mm512_loadu_si512(wp + g * stride + 64 * p);
                    lo[g] = _mm512_and_si512(v, low), hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if (bits == 6) { /* the high 2 bits: the run's high part, a piece per two of int4's */
                        const uint8_t *piece = wp + g * stride + 8 * block + 64 * (p / 2);
                        if (p % 2 == 0) prefetch_ahead(piece);
                        high_bits_avx512(_mm512_loadu_si512(piece), p, &lo[g], &hi[g]);
                    }
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *q = t->q[r] + j * block + 8 * p;
                    __m512i a0 = _mm512_set1_epi32(load4(q)), a1 = _mm512_set1_epi32(load4(q + 4));
                    for (int g = 0; g < G; g++)
                        acc[r * G + g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r * G + g], lo[g], a0), hi[g],
                                                             a1);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            __m512 ws = group_scales(t, g, j);
            for (int r = 0; r < R; r++) {
                __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(t->as[r][j]));
                out[r * G + g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * G + g]), scale, out[r * G + g]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) store_group(t->y[r] + QCOLS * g, out[r * G + g], g < G - 1 ? QCOLS : t->last);
}

/* level 0, as float_tile_avx2 on whole groups */
INLINE_AVX512 void float_tile_avx512(const Tile *t, const int R, const int G, const int bits) {
    const QWeight *w = t->w;
    const int block = w->block;
    const int64_t run = 2 * (int64_t)block * bits, stride = w->kb * run;
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8), flip = _mm512_set1_epi8((char)0x80);
    __m512 out[MAX_TILE];
    for (int i = 0; i < R * G; i++) out[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *wp = w->codes + (t->g * w->kb + j) * run;
        __m512 sum[MAX_TILE];
        for (int i = 0; i < R * G; i++) sum[i] = _mm512_setzero_ps();
        for (int qd = 0; qd < block / 4; qd++) {
            __m512i quad[4];
            for (int g = 0; g < G; g++) {
                if (bits == 8) {
                    quad[g] = _mm512_xor_si512(_mm512_loadu_si512(wp + g * stride + 64 * qd), flip);
                } else if (bits == 6) {
                    quad[g] = int6_quad_avx512(wp + g * stride, qd, block);
                } else {
                    __m512i v = _mm512_loadu_si512(wp + g * stride + 64 * (qd / 2));
                    v = qd % 2 ? _mm512_srli_epi16(v, 4) : v;
                    quad[g] = _mm512_sub_epi8(_mm512_and_si512(v, low), eight);
                }
            }
            for (int tk = 0; tk < 4; tk++) {
                for (int g = 0; g < G; g++) {
                    __m512 wf = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(quad[g], 24 - 8 * tk), 24));
                    for (int r = 0; r < R; r++) {
                        __m512 a = _mm512_set1_ps(t->f[r][j * block + 4 * qd + tk]);
                        sum[r * G + g] = _mm512_fmadd_ps(a, wf, sum[r * G + g]);
                    }
                }
            }
        }
        for (int g = 0; g < G; g++) {
            __m512 ws = group_scales(t, g, j);
            for (int r = 0; r < R; r++) out[r * G + g] = _mm512_fmadd_ps(sum[r * G + g], ws, out[r * G + g]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) store_group(t->y[r] + QCOLS * g, out[r * G + g], g < G - 1 ? QCOLS : t->last);
}

/* ---------- tile shapes: one function per (path, level, bits, R, G) so every loop bound is a constant ---------- */

typedef void (*TileFn)(const Tile *);

#define DEFINE_TILE(PATH, TARGET, R, G, BITS)                                                                        \
    static TARGET void int_##PATH##_##R##_##G##_##BITS(const Tile *t) { int_tile_##PATH(t, R, G, BITS); }            \
    static TARGET void float_##PATH##_##R##_##G##_##BITS(const Tile *t) { float_tile_##PATH(t, R, G, BITS); }
#define CASE_TILE(PATH, TARGET, R, G, BITS)                                                                          \
    case (BITS) * 10000 + (G) * 100 + (R):                                                                           \
        return level == 4 ? int_##PATH##_##R##_##G##_##BITS : float_##PATH##_##R##_##G##_##BITS;

/* AVX-512: 2 groups for up to 6 rows, 1 for up to 8 */
#define SHAPES_AVX512(X, BITS)                                                                                       \
    X(avx512, TARGET_AVX512, 1, 2, BITS) X(avx512, TARGET_AVX512, 2, 2, BITS) X(avx512, TARGET_AVX512, 3, 2, BITS)   \
    X(avx512, TARGET_AVX512, 4, 2, BITS) X(avx512, TARGET_AVX512, 5, 2, BITS) X(avx512, TARGET_AVX512, 6, 2, BITS)   \
    X(avx512, TARGET_AVX512, 1, 1, BITS) X(avx512, TARGET_AVX512, 2, 1, BITS) X(avx512, TARGET_AVX512, 3, 1, BITS)   \
    X(avx512, TARGET_AVX512, 4, 1, BITS) X(avx512, TARGET_AVX512, 5, 1, BITS) X(avx512, TARGET_AVX512, 6, 1, BITS)   \
    X(avx512, TARGET_AVX512, 7, 1, BITS) X(avx512, TARGET_AVX512, 8, 1, BITS)
/* AVX2 (16 registers): 1 group, up to 4 rows */
#define SHAPES_AVX2(X, BITS)                                                                                         \
    X(avx2, TARGET_AVX2, 1, 1, BITS) X(avx2, TARGET_AVX2, 2, 1, BITS) X(avx2, TARGET_AVX2, 3, 1, BITS)               \
    X(avx2, TARGET_AVX2, 4, 1, BITS)

SHAPES_AVX512(DEFINE_TILE, 4)
SHAPES_AVX512(DEFINE_TILE, 6)
SHAPES_AVX512(DEFINE_TILE, 8)
SHAPES_AVX2(DEFINE_TILE, 4)
SHAPES_AVX2(DEFINE_TILE, 6)
SHAPES_AVX2(DEFINE_TILE, 8)

static TileFn tile_fn(Isa isa, int level, int bits, int rows, int groups) {
    if (isa == ISA_AVX512) {
        switch (bits * 10000 + groups * 100 + rows) {
            SHAPES_AVX512(CASE_TILE, 4)
            SHAPES_AVX512(CASE_TILE, 6)
            SHAPES_AVX512(CASE_TILE, 8)
            default: break;
        }
    } else {
        switch (bits * 10000 + groups * 100 + rows) {
            SHAPES_AVX2(CASE_TILE, 4)
            SHAPES_AVX2(CASE_TILE, 6)
            SHAPES_AVX2(CASE_TILE, 8)
            default: break;
        }
    }
    return NULL;
}

/* Rows and groups of the main tile for a product of `rows` rows. AVX-512: up to 8 rows (decode and batched decode,
 * most routed experts' rows) take every row in one tile of one group, a single stream through the weight that
 * prefetch_ahead runs ahead of, each run unpacked once for all the rows. On one Zen 5 core from memory
 * (benchmarks/qmatmul_core.c, K 2048 and 1408, 64-400 MB) one row read int4 at 28-32 GB/s against 20-28 GB/s for
 * 4 groups at once (before the prefetch; 38 GB/s with it), int8 at 32-38 against 30-35 GB/s; on a Zen 4 core
 * (family 25 model 17, 64 MiB of int4, two runs each) 8 rows 8.1-8.2 ms against 10.0-11.2 ms for 3 x 4 tiles, 5 rows
 * 6.6-6.9 against 7.3-8.2, int6 8 rows 10.8 against 12.7-15.5, K 1408 (an expert's fc2) 5.4-5.5 against 6.8-7.0,
 * 3 rows and int8 even. More rows (prefill, the column tile's runs in L1/L2 for every row tile): 6 x 2 ran at 73 %
 * of one vpdpbusd per cycle against 68 % for 12 x 1 and 64 % for 8 x 1. AVX2 (16 registers): up to 4 rows, one
 * group. */
static void tile_shape(Isa isa, int64_t rows, int *r, int *g) {
    if (isa == ISA_AVX2) {
        *r = rows < 4 ? (int)rows : 4, *g = 1;
    } else if (rows <= 8) {
        *r = (int)rows, *g = 1;
    } else {
        *r = 6, *g = 2;
    }
}

void qmatmul_rows_groups(Isa isa, const QWeight *w, const QActs *a, int64_t r0, int64_t r1, int64_t g0, int64_t g1,
                         float *y, int64_t ldy) {
    if (r0 >= r1 || g0 >= g1) return;
    if (isa == ISA_SCALAR) {
        scalar_product(w, a, r0, r1, g0, g1, y, ldy);
        return;
    }
    int main_rows, main_groups;
    tile_shape(isa, r1 - r0, &main_rows, &main_groups);
    Tile t = {.w = w, .level = a->level};
    for (int64_t g = g0; g < g1;) {
        int groups = main_groups;
        while (groups > g1 - g) groups /= 2; /* 2 or 1 */
        t.g = g;
        t.last = g + groups == w->groups ? (int)(w->n - (w->groups - 1) * QCOLS) : QCOLS;
        for (int64_t r = r0; r < r1; r += main_rows) {
            int rows = r1 - r < main_rows ? (int)(r1 - r) : main_rows;
            for (int i = 0; i < rows; i++) {
                int64_t row = a->index ? a->index[r + i] : r + i;
                if (a->level == 4) {
                    t.q[i] = a->q + row * a->lda, t.as[i] = a->scale + row * w->kb;
                    t.offset[i] = a->offset + row * w->kb;
                } else {
                    t.f[i] = a->f + row * a->lda;
                }
                t.y[i] = y + (r + i - r0) * ldy + (g - g0) * QCOLS;
            }
            tile_fn(isa, a->level, w->bits, rows, groups)(&t);
        }
        g += groups;
    }
}

/* ---------- activations ---------- */

TARGET_AVX2 static void quantize_block_avx2(const float *x, int block, int8_t *q, float *scale, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    float inv = quantize_inverse(amax);
    __m256 iv = _mm256_set1_ps(inv);
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < block; i += 16) {
        __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv));
        __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), iv));
        total = _mm256_add_epi32(total, _mm256_add_epi32(lo, hi));
        __m256i words = _mm256_packs_epi32(lo, hi); /* lanes: lo0-3 hi0-3 lo4-7 hi4-7 */
        __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        _mm_storeu_si128((__m128i *)(q + i), _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
    *scale = amax / 127.0f, *sum = _mm_cvtsi128_si32(t4);
}

TARGET_AVX512 static void quantize_block_avx512(const float *x, int block, int8_t *q, float *scale, int32_t *sum) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < block; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float amax = _mm512_reduce_max_ps(m);
    float inv = quantize_inverse(amax);
    __m512 iv = _mm512_set1_ps(inv);
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < block; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv));
        total = _mm512_add_epi32(total, v);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
    *scale = amax / 127.0f, *sum = _mm512_reduce_add_epi32(total);
}

void qmatmul_quantize_row(Isa isa, const float *a, int64_t k, int block, int zero, int8_t *q, float *scale,
                          int32_t *offset) {
    float tail[QMAX_BLOCK];
    for (int64_t j = 0, start = 0; start < k; j++, start += block) {
        const float *x = a + start;
        if (k - start < block) { /* the last block, zero-padded */
            memcpy(tail, x, sizeof(float) * (size_t)(k - start));
            memset(tail + (k - start), 0, sizeof(float) * (size_t)(block - (k - start)));
            x = tail;
        }
        int32_t sum;
        int finite = 1;
        for (int i = 0; i < block; i++) finite &= isfinite(x[i]) != 0;
        if (!finite) { /* NaN or infinity: the block's products are NaN on every path, as a float product's are */
            memset(q + start, 0, (size_t)block);
            scale[j] = NAN, offset[j] = 0;
            continue;
        }
        if (isa == ISA_AVX512) quantize_block_avx512(x, block, q + start, scale + j, &sum);
        else if (isa == ISA_AVX2) quantize_block_avx2(x, block, q + start, scale + j, &sum);
        else quantize_block_scalar(x, block, q + start, scale + j, &sum);
        offset[j] = -zero * sum;
    }
}

void qmatmul_pad_row(const float *a, int64_t k, int64_t padded, float *out) {
    memcpy(out, a, sizeof(float) * (size_t)k);
    memset(out + k, 0, sizeof(float) * (size_t)(padded - k));
}
