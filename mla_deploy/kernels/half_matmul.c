/* The arithmetic of mla_deploy's half-precision-weight MatMul (half_matmul.h): a float16 or bfloat16 weight read as
 * stored and widened in registers, 8 values per instruction (F16C for float16; a 16-bit shift for bfloat16), so a
 * decode step reads half the bytes of a float32 weight. onnxruntime's CPU provider has neither a float16 MatMul (on
 * a CPU without AVX512-FP16) nor a bfloat16 one: it would multiply by float32 copies made at load.
 *
 * Per strip of 64 output columns (one task on onnxruntime's intra-op threads), by the number of rows of A:
 * - one (a decode step): eight 8-wide accumulators walk the strip's K rows, one contiguous stream;
 * - a few (batched decode, up to 12): per balanced group of at most 6 rows and per 16 columns, 6x16 accumulators
 *   straight from the half-precision strip (each weight is used once or twice; with two groups, K goes in chunks
 *   of 512 rows so that the second group finds the chunk in L2);
 * - more (prefill): per 256 rows of the strip, the block is widened once into a float32 panel per 16 columns that
 *   stays in L1 while every group passes over it (GotoBLAS order), partial sums in a per-strip buffer.
 * A's rows are packed per group [K, 6] so each block reads them as one stream.
 */
#include "half_matmul.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define PANEL 16    /* columns of one register block */
#define KC 256      /* rows of B per pass in the many-rows path */
#define FEW_ROWS 12 /* up to this many rows of A, B is read as stored in each group's pass */
#define FEW_KC 512  /* rows of B per pass in the few-rows path */
#define WIDE 2      /* a block's B already widened to float32 (besides HALF_F16, HALF_BF16) */

/* 8 consecutive weights at base[i] as float32 */
INLINE __m256 load8(const void *base, int64_t i, int kind) {
    if (kind == WIDE) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == HALF_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

INLINE void widen(const uint16_t *h, float *f, int64_t count, int kind) {
    for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(f + i, load8(h, i, kind)); /* count: a multiple of 16 */
}

/* y[0, 64) = a[k] @ strip[k, 64] */
INLINE void row_strip(const float *a, const uint16_t *strip, float *y, int64_t k, int kind) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++, strip += STRIP) {
        __m256 ai = _mm256_broadcast_ss(a + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(ai, load8(strip, 8 * j, kind), acc[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
}

/* c[mr, 16] (+)= a[kc, MR] @ b[kc, 16]: a one packed group, b's rows ldb apart, c's rows STRIP apart */
INLINE void block(int mr, const float *a, const void *b, int64_t ldb, int64_t kc, float *c, int first, int kind) {
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < mr; r++) {
        lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP);
        hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP + 8);
    }
    for (int64_t i = 0; i < kc; i++, a += MR) {
        __m256 b0 = load8(b, i * ldb, kind), b1 = load8(b, i * ldb + 8, kind);
        for (int r = 0; r < mr; r++) {
            __m256 ar = _mm256_broadcast_ss(a + r);
            lo[r] = _mm256_fmadd_ps(ar, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(ar, b1, hi[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(c + r * STRIP, lo[r]);
        _mm256_storeu_ps(c + r * STRIP + 8, hi[r]);
    }
}

INLINE void block_rows(int mr, const float *a, const void *b, int64_t ldb, int64_t kc, float *c, int first, int kind) {
    switch (mr) { /* a constant row count per case: the accumulators stay in registers */
        case 6: block(6, a, b, ldb, kc, c, first, kind); break;
        case 5: block(5, a, b, ldb, kc, c, first, kind); break;
        case 4: block(4, a, b, ldb, kc, c, first, kind); break;
        case 3: block(3, a, b, ldb, kc, c, first, kind); break;
        case 2: block(2, a, b, ldb, kc, c, first, kind); break;
        default: block(1, a, b, ldb, kc, c, first, kind); break;
    }
}

static int rows_in(const HalfMatMul *job, int64_t r0) { return (int)(job->m - r0 < job->group ? job->m - r0 : job->group); }

/* With two groups, K in chunks of FEW_KC rows, so that the chunk (64 KiB) is still in L2 when the second reads it */
INLINE void few_rows_strip(const HalfMatMul *job, const uint16_t *strip, int64_t col, int kind) {
    float c[FEW_ROWS * STRIP]; /* partial sums [m, 64] */
    int64_t chunk = job->m > job->group ? FEW_KC : job->k;
    for (int64_t k0 = 0; k0 < job->k; k0 += chunk) {
        int64_t kc = job->k - k0 < chunk ? job->k - k0 : chunk;
        for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
            const float *a = job->a + r0 / job->group * MR * job->k + k0 * MR; /* this group, from row k0 */
            for (int64_t p = 0; p < STRIP; p += PANEL)
                block_rows(rows_in(job, r0), a, strip + k0 * STRIP + p, STRIP, kc, c + r0 * STRIP + p, k0 == 0, kind);
        }
    }
    for (int64_t r = 0; r < job->m; r++) memcpy(job->y + r * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
}

/* c [m, 64] partial sums, b [64 / 16, KC, 16] the widened panels */
INLINE void many_rows_strip(const HalfMatMul *job, const uint16_t *strip, int64_t col, float *c, float *b, int kind) {
    for (int64_t k0 = 0; k0 < job->k; k0 += KC) {
        int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t i = 0; i < kc; i++) widen(strip + (k0 + i) * STRIP + p * PANEL, b + (p * kc + i) * PANEL, PANEL, kind);
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
                const float *a = job->a + r0 / job->group * MR * job->k + k0 * MR; /* this group, from row k0 */
                block_rows(rows_in(job, r0), a, b + p * kc * PANEL, PANEL, kc, c + r0 * STRIP + p * PANEL, k0 == 0, WIDE);
            }
    }
    for (int64_t r = 0; r < job->m; r++) memcpy(job->y + r * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
}

INLINE void strip_of(HalfMatMul *job, int64_t s, int kind) {
    const uint16_t *strip = job->b + s * job->k * STRIP;
    if (job->m == 1) {
        row_strip(job->a, strip, job->y + s * STRIP, job->k, kind);
    } else if (job->m <= FEW_ROWS) {
        few_rows_strip(job, strip, s * STRIP, kind);
    } else {
        float *scratch = malloc(sizeof(float) * (job->m * STRIP + KC * STRIP));
        if (!scratch) {
            __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED); /* strips run on several threads */
            return;
        }
        many_rows_strip(job, strip, s * STRIP, scratch, scratch + job->m * STRIP, kind);
        free(scratch);
    }
}

KERNEL static void strip_f16(HalfMatMul *job, int64_t s) { strip_of(job, s, HALF_F16); }
KERNEL static void strip_bf16(HalfMatMul *job, int64_t s) { strip_of(job, s, HALF_BF16); }

void half_matmul_strip(HalfMatMul *job, int64_t s) {
    if (job->kind == HALF_BF16)
        strip_bf16(job, s);
    else
        strip_f16(job, s);
}

int64_t half_matmul_groups(int64_t m) { return (m + MR - 1) / MR; }

int64_t half_matmul_group_rows(int64_t m) { return (m + half_matmul_groups(m) - 1) / half_matmul_groups(m); }

int64_t half_matmul_packed_size(int64_t m, int64_t k) { return m == 1 ? 0 : half_matmul_groups(m) * MR * k; }

void half_matmul_pack(const HalfMatMul *job, const float *a, float *packed, int64_t g) {
    float *out = packed + g * MR * job->k;
    for (int64_t r = 0; r < MR; r++) {
        int64_t source = g * job->group + r;
        int live = r < job->group && source < job->m;
        for (int64_t i = 0; i < job->k; i++) out[i * MR + r] = live ? a[source * job->k + i] : 0.0f;
    }
}

int half_matmul_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
