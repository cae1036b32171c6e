/* The arithmetic of mla_deploy's MatMul by a weight stored in column strips (strip_matmul.h). A float16 or bfloat16
 * weight is read as stored and widened in registers, 8 values per instruction (F16C for float16; a 16-bit shift for
 * bfloat16), so a decode step reads half the bytes of a float32 weight: onnxruntime's CPU provider has neither a
 * float16 MatMul (on a CPU without AVX512-FP16) nor a bfloat16 one, and would multiply by float32 copies made at
 * load. A float32 weight goes through the same code (the routed experts of a float32 export: routed_experts.c).
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
#include "strip_matmul.h"

#include <stdlib.h>
#include <string.h>

#include "widen.h"

#define PANEL 16    /* columns of one register block */
#define KC 256      /* rows of B per pass in the many-rows path */
#define FEW_ROWS 12 /* up to this many rows of A, B is read as stored in each group's pass */
#define FEW_KC 512  /* rows of B per pass in the few-rows path */
#define WIDE STRIP_F32 /* a block's B already widened to float32 */
#define PREFETCH 16 /* rows of B ahead */

INLINE void widen(const void *h, float *f, int64_t count, int kind) {
    for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(f + i, load8(h, i, kind)); /* count: a multiple of 16 */
}

/* y[0, 64) = a[k] @ strip[k, 64] */
INLINE void row_strip(const float *a, const void *strip, float *y, int64_t k, int kind) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 ai = _mm256_broadcast_ss(a + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(ai, load8(strip, i * STRIP + 8 * j, kind), acc[j]);
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
        _mm_prefetch((const char *)element(b, (i + PREFETCH) * ldb, kind), _MM_HINT_T0);
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

static int rows_in(const StripMatMul *job, int64_t r0) { return (int)(job->m - r0 < job->group ? job->m - r0 : job->group); }

/* With two groups, K in chunks of FEW_KC rows, so that the chunk (64 KiB) is still in L2 when the second reads it */
INLINE void few_rows_strip(const StripMatMul *job, const void *strip, int64_t col, int kind) {
    float c[FEW_ROWS * STRIP]; /* partial sums [m, 64] */
    int64_t chunk = job->m > job->group ? FEW_KC : job->k;
    for (int64_t k0 = 0; k0 < job->k; k0 += chunk) {
        int64_t kc = job->k - k0 < chunk ? job->k - k0 : chunk;
        for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
            const float *a = job->a + r0 / job->group * MR * job->k + k0 * MR; /* this group, from row k0 */
            for (int64_t p = 0; p < STRIP; p += PANEL)
                block_rows(rows_in(job, r0), a, element(strip, k0 * STRIP + p, kind), STRIP, kc, c + r0 * STRIP + p, k0 == 0, kind);
        }
    }
    for (int64_t r = 0; r < job->m; r++) memcpy(job->y + r * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
}

/* c [m, 64] partial sums, b [64 / 16, KC, 16] the widened panels */
INLINE void many_rows_strip(const StripMatMul *job, const void *strip, int64_t col, float *c, float *b, int kind) {
    for (int64_t k0 = 0; k0 < job->k; k0 += KC) {
        int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t i = 0; i < kc; i++) widen(element(strip, (k0 + i) * STRIP + p * PANEL, kind), b + (p * kc + i) * PANEL, PANEL, kind);
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
                const float *a = job->a + r0 / job->group * MR * job->k + k0 * MR; /* this group, from row k0 */
                block_rows(rows_in(job, r0), a, b + p * kc * PANEL, PANEL, kc, c + r0 * STRIP + p * PANEL, k0 == 0, WIDE);
            }
    }
    for (int64_t r = 0; r < job->m; r++) memcpy(job->y + r * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
}

INLINE void strip_of(StripMatMul *job, int64_t s, int kind) {
    const void *strip = element(job->b, s * job->k * STRIP, kind);
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

KERNEL static void strip_f16(StripMatMul *job, int64_t s) { strip_of(job, s, STRIP_F16); }
KERNEL static void strip_bf16(StripMatMul *job, int64_t s) { strip_of(job, s, STRIP_BF16); }
KERNEL static void strip_f32(StripMatMul *job, int64_t s) { strip_of(job, s, STRIP_F32); }

void strip_matmul_strip(StripMatMul *job, int64_t s) {
    switch (job->kind) { /* one instantiation per kind: load8's branch on it folds away */
        case STRIP_BF16: strip_bf16(job, s); break;
        case STRIP_F32: strip_f32(job, s); break;
        default: strip_f16(job, s); break;
    }
}

int64_t strip_matmul_groups(int64_t m) { return (m + MR - 1) / MR; }

int64_t strip_matmul_group_rows(int64_t m) { return (m + strip_matmul_groups(m) - 1) / strip_matmul_groups(m); }

int64_t strip_matmul_packed_size(int64_t m, int64_t k) { return m == 1 ? 0 : strip_matmul_groups(m) * MR * k; }

void strip_matmul_pack_rows(const StripMatMul *job, const float *const *rows, float *packed, int64_t g) {
    float *out = packed + g * MR * job->k;
    for (int64_t r = 0; r < MR; r++) {
        const float *row = r < job->group && g * job->group + r < job->m ? rows[r] : NULL;
        for (int64_t i = 0; i < job->k; i++) out[i * MR + r] = row ? row[i] : 0.0f;
    }
}

void strip_matmul_pack(const StripMatMul *job, const float *a, float *packed, int64_t g) {
    const float *rows[MR];
    for (int64_t r = 0, row = g * job->group; r < MR; r++, row++) rows[r] = row < job->m ? a + row * job->k : NULL;
    strip_matmul_pack_rows(job, rows, packed, g);
}
