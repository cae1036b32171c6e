/* The arithmetic of mla_deploy's MatMul by a weight stored in column strips (strip_matmul.h). A float16 or bfloat16
 * weight is read as stored and widened in registers (F16C for float16; a 16-bit shift for bfloat16), so a decode step
 * reads half the bytes of a float32 weight: onnxruntime's CPU provider has neither a float16 MatMul (on a CPU without
 * AVX512-FP16) nor a bfloat16 one, and would multiply by float32 copies made at load. A float32 weight goes through
 * the same code (the routed experts of a float32 export: routed_experts.c). Products and sums are float32 on every
 * path.
 *
 * Per strip of 64 output columns, by the number of rows of A:
 * - one (a decode step): eight 8-wide accumulators walk the strip's K rows, one contiguous stream at the memory's
 *   rate (AVX2 and AVX-512 alike: a wider register would not read faster);
 * - more (batched decode, prefill, an expert's tokens): A packed in groups of at most 6 rows; B in passes of KC rows
 *   (all of K where one AVX-512 group holds the whole strip in registers), each pass read from memory once and
 *   from L1/L2 by every further group. A group's register block is 6 rows x 64 columns (AVX-512: 24 accumulators,
 *   each weight widened once for 6 rows) or 6 x 16 (AVX2, 4 blocks a pass), partial sums kept in Y between passes.
 *   Widening in the loop costs less than storing a widened copy: the conversions issue beside the FMAs.
 * The plain C path computes the same sums in the same layout, one product at a time.
 */
#include "strip_matmul.h"

#include "widen.h"

#define PANEL 16    /* columns of one AVX2 register block */
#define PREFETCH 16 /* rows of B ahead: a decode batch streams B from memory */
#ifndef ROW_PREFETCH_BYTES /* one row of A: the strip's bytes this far ahead, across the 4 KB pages where a core's
                            * hardware prefetchers stop (as qmatmul.c's runs) */
#define ROW_PREFETCH_BYTES 2048
#endif
#define TASKS 32    /* strip_matmul_task: at least this many tasks where rows allow (several per thread) */
#define TASK_GROUPS 8 /* and at least this many groups per task (each task reads its strip's B once) */

static int64_t groups_of(const StripMatMul *job) { return strip_matmul_groups(job->m); }

static int rows_in(const StripMatMul *job, int64_t g) {
    int64_t left = job->m - g * job->group;
    return (int)(left < job->group ? left : job->group);
}

/* group g's packed [kc, MR] block of the pass from B's row k0 (strip_matmul.h's layout) */
static const float *packed_block(const StripMatMul *job, int64_t g, int64_t k0) {
    int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
    return job->a + k0 * groups_of(job) * MR + g * kc * MR;
}

/* rows of B per pass: KC; all of K for a single group whose block spans the strip (its sums never leave registers;
 * the packed layout of one group is [K, MR] whatever the pass) */
static int64_t pass_rows(const StripMatMul *job, int whole_strip) {
    return whole_strip && groups_of(job) == 1 ? job->k : KC;
}

/* ---------- plain C ---------- */

static void row_scalar(const float *a, const void *strip, float *y, int64_t k, int kind) {
    float acc[STRIP] = {0};
    for (int64_t i = 0; i < k; i++)
        for (int j = 0; j < STRIP; j++) acc[j] += a[i] * stored_value(strip, i * STRIP + j, kind);
    memcpy(y, acc, sizeof acc);
}

static void groups_scalar(const StripMatMul *job, const void *strip, int64_t col, int64_t g0, int64_t g1, int kind) {
    for (int64_t k0 = 0; k0 < job->k; k0 += KC) {
        int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
        for (int64_t g = g0; g < g1; g++) {
            const float *a = packed_block(job, g, k0);
            float *c = job->y + g * job->group * job->n + col;
            for (int r = 0; r < rows_in(job, g); r++) {
                float acc[STRIP];
                for (int j = 0; j < STRIP; j++) acc[j] = k0 ? c[r * job->n + j] : 0.0f;
                for (int64_t i = 0; i < kc; i++)
                    for (int j = 0; j < STRIP; j++) acc[j] += a[i * MR + r] * stored_value(strip, (k0 + i) * STRIP + j, kind);
                memcpy(c + r * job->n, acc, sizeof acc);
            }
        }
    }
}

/* ---------- AVX2 ---------- */

/* y[0, 64) = a[k] @ strip[k, 64] */
INLINE void row_strip(const float *a, const void *strip, float *y, int64_t k, int kind) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const char *ahead = (const char *)element(strip, i * STRIP, kind) + ROW_PREFETCH_BYTES;
        for (int l = 0; l < STRIP * strip_kind_bytes(kind); l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
        __m256 ai = _mm256_broadcast_ss(a + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(ai, load8(strip, i * STRIP + 8 * j, kind), acc[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
}

/* c[mr, 16] (+)= a[kc, MR] @ b[kc, 16]: a, one group's packed block; b, 16 columns of B's rows (STRIP apart); c's
 * rows ldc apart; mr constant where inlined, so the accumulators stay in registers */
INLINE void tile16(const int mr, const float *a, const void *b, int64_t kc, float *c, int64_t ldc, int first, int kind) {
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < mr; r++) {
        lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
        hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
    }
    for (int64_t i = 0; i < kc; i++, a += MR) {
        _mm_prefetch((const char *)element(b, (i + PREFETCH) * STRIP, kind), _MM_HINT_T0);
        __m256 b0 = load8(b, i * STRIP, kind), b1 = load8(b, i * STRIP + 8, kind);
        for (int r = 0; r < mr; r++) {
            __m256 ar = _mm256_broadcast_ss(a + r);
            lo[r] = _mm256_fmadd_ps(ar, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(ar, b1, hi[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(c + r * ldc, lo[r]);
        _mm256_storeu_ps(c + r * ldc + 8, hi[r]);
    }
}

INLINE void tile16_rows(int mr, const float *a, const void *b, int64_t kc, float *c, int64_t ldc, int first, int kind) {
    switch (mr) { /* a constant row count per case */
        case 6: tile16(6, a, b, kc, c, ldc, first, kind); break;
        case 5: tile16(5, a, b, kc, c, ldc, first, kind); break;
        case 4: tile16(4, a, b, kc, c, ldc, first, kind); break;
        case 3: tile16(3, a, b, kc, c, ldc, first, kind); break;
        case 2: tile16(2, a, b, kc, c, ldc, first, kind); break;
        default: tile16(1, a, b, kc, c, ldc, first, kind); break;
    }
}

INLINE void groups_avx2(const StripMatMul *job, const void *strip, int64_t col, int64_t g0, int64_t g1, int kind) {
    int64_t pass = pass_rows(job, 0);
    for (int64_t k0 = 0; k0 < job->k; k0 += pass) {
        int64_t kc = job->k - k0 < pass ? job->k - k0 : pass;
        for (int64_t g = g0; g < g1; g++) {
            const float *a = packed_block(job, g, k0);
            float *c = job->y + g * job->group * job->n + col;
            for (int64_t p = 0; p < STRIP; p += PANEL)
                tile16_rows(rows_in(job, g), a, element(strip, k0 * STRIP + p, kind), kc, c + p, job->n, k0 == 0, kind);
        }
    }
}

/* ---------- AVX-512 ---------- */

/* c[mr, 64] (+)= a[kc, MR] @ b[kc, 64]: the whole strip's width in 4 x mr accumulators */
INLINE512 void tile64(const int mr, const float *a, const void *b, int64_t kc, float *c, int64_t ldc, int first, int kind) {
    __m512 acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * j);
    for (int64_t i = 0; i < kc; i++, a += MR) {
        _mm_prefetch((const char *)element(b, (i + PREFETCH) * STRIP, kind), _MM_HINT_T0);
        _mm_prefetch((const char *)element(b, (i + PREFETCH) * STRIP + 32, kind), _MM_HINT_T0);
        __m512 bv[4];
        for (int j = 0; j < 4; j++) bv[j] = load16(b, i * STRIP + 16 * j, kind);
        for (int r = 0; r < mr; r++) {
            __m512 ar = _mm512_set1_ps(a[r]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(ar, bv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

INLINE512 void tile64_rows(int mr, const float *a, const void *b, int64_t kc, float *c, int64_t ldc, int first, int kind) {
    switch (mr) {
        case 6: tile64(6, a, b, kc, c, ldc, first, kind); break;
        case 5: tile64(5, a, b, kc, c, ldc, first, kind); break;
        case 4: tile64(4, a, b, kc, c, ldc, first, kind); break;
        case 3: tile64(3, a, b, kc, c, ldc, first, kind); break;
        case 2: tile64(2, a, b, kc, c, ldc, first, kind); break;
        default: tile64(1, a, b, kc, c, ldc, first, kind); break;
    }
}

INLINE512 void groups_avx512(const StripMatMul *job, const void *strip, int64_t col, int64_t g0, int64_t g1, int kind) {
    int64_t pass = pass_rows(job, 1);
    for (int64_t k0 = 0; k0 < job->k; k0 += pass) {
        int64_t kc = job->k - k0 < pass ? job->k - k0 : pass;
        for (int64_t g = g0; g < g1; g++)
            tile64_rows(rows_in(job, g), packed_block(job, g, k0), element(strip, k0 * STRIP, kind), kc,
                        job->y + g * job->group * job->n + col, job->n, k0 == 0, kind);
    }
}

/* ---------- dispatch: one instantiation per path and kind (load8's and load16's branches on it fold away) ---------- */

#define PATH(NAME, TARGET, GROUPS, KIND)                                                                              \
    TARGET static void NAME(const StripMatMul *job, int64_t s, int64_t g0, int64_t g1) {                              \
        const void *strip = element(job->b, s * job->k * STRIP, KIND);                                                \
        if (job->m == 1) row_strip(job->a, strip, job->y + s * STRIP, job->k, KIND);                                 \
        else GROUPS(job, strip, s * STRIP, g0, g1, KIND);                                                             \
    }
PATH(avx2_f16, KERNEL, groups_avx2, STRIP_F16)
PATH(avx2_bf16, KERNEL, groups_avx2, STRIP_BF16)
PATH(avx2_f32, KERNEL, groups_avx2, STRIP_F32)
PATH(avx512_f16, KERNEL512, groups_avx512, STRIP_F16)
PATH(avx512_bf16, KERNEL512, groups_avx512, STRIP_BF16)
PATH(avx512_f32, KERNEL512, groups_avx512, STRIP_F32)

static void strip_scalar(const StripMatMul *job, int64_t s, int64_t g0, int64_t g1) {
    const void *strip = element(job->b, s * job->k * STRIP, job->kind);
    if (job->m == 1) row_scalar(job->a, strip, job->y + s * STRIP, job->k, job->kind);
    else groups_scalar(job, strip, s * STRIP, g0, g1, job->kind);
}

/* groups g0 .. g1 - 1 of strip s (every row for one row of A) */
static void strip_groups(const StripMatMul *job, int64_t s, int64_t g0, int64_t g1) {
    static void (*const paths[][3])(const StripMatMul *, int64_t, int64_t, int64_t) = {
        [ISA_AVX2] = {[STRIP_F16] = avx2_f16, [STRIP_BF16] = avx2_bf16, [STRIP_F32] = avx2_f32},
        [ISA_AVX512] = {[STRIP_F16] = avx512_f16, [STRIP_BF16] = avx512_bf16, [STRIP_F32] = avx512_f32},
    };
    if (job->k == 0) { /* an empty sum: no pass would write Y */
        int64_t r0 = job->m == 1 ? 0 : g0 * job->group, r1 = job->m == 1 ? 1 : g1 * job->group;
        for (int64_t r = r0; r < r1 && r < job->m; r++) memset(job->y + r * job->n + s * STRIP, 0, sizeof(float) * STRIP);
    } else if (job->isa == ISA_SCALAR) {
        strip_scalar(job, s, g0, g1);
    } else {
        paths[job->isa][job->kind](job, s, g0, g1);
    }
}

void strip_matmul_strip(const StripMatMul *job, int64_t s) { strip_groups(job, s, 0, groups_of(job)); }

/* blocks of groups per strip in strip_matmul_task */
static int64_t blocks_of(const StripMatMul *job) {
    int64_t strips = job->n / STRIP, most = job->m == 1 ? 1 : groups_of(job) / TASK_GROUPS;
    int64_t wanted = (TASKS + strips - 1) / strips;
    return wanted < most ? wanted : most > 1 ? most : 1;
}

int64_t strip_matmul_tasks(const StripMatMul *job) { return job->n / STRIP * blocks_of(job); }

void strip_matmul_task(const StripMatMul *job, int64_t task) {
    int64_t blocks = blocks_of(job), block = task % blocks, groups = groups_of(job);
    strip_groups(job, task / blocks, block * groups / blocks, (block + 1) * groups / blocks);
}

/* ---------- packing A ---------- */

int64_t strip_matmul_groups(int64_t m) { return (m + MR - 1) / MR; }

int64_t strip_matmul_group_rows(int64_t m) { return (m + strip_matmul_groups(m) - 1) / strip_matmul_groups(m); }

int64_t strip_matmul_packed_size(int64_t m, int64_t k) { return m == 1 ? 0 : strip_matmul_groups(m) * MR * k; }

void strip_matmul_pack_rows(const StripMatMul *job, const float *const *rows, float *packed, int64_t g) {
    const float *row[MR];
    for (int64_t r = 0; r < MR; r++) row[r] = r < job->group && g * job->group + r < job->m ? rows[r] : NULL;
    for (int64_t k0 = 0; k0 < job->k; k0 += KC) {
        int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
        float *out = packed + k0 * groups_of(job) * MR + g * kc * MR;
        for (int64_t i = 0; i < kc; i++)
            for (int64_t r = 0; r < MR; r++) out[i * MR + r] = row[r] ? row[r][k0 + i] : 0.0f;
    }
}

void strip_matmul_pack(const StripMatMul *job, const float *a, float *packed, int64_t g) {
    const float *rows[MR];
    for (int64_t r = 0, row = g * job->group; r < MR; r++, row++) rows[r] = row < job->m ? a + row * job->k : NULL;
    strip_matmul_pack_rows(job, rows, packed, g);
}
