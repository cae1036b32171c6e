/* MLA's absorbed decode attention over the latent cache (latent_attention.h). Per range of slots: the scores of 4
 * heads x 3 slots at a time in registers (each cache row read once per 4 heads, widened from its stored type), or,
 * for float32 caches and heads a multiple of 8, outer products of each slot's values with the queries packed by
 * column; the softmax's exponentials 8 at a time; then p @ latent for 6 heads x 16 columns at a time. At the AVX-512
 * level the outer products (16 heads a register, 12 slots) and p @ latent (8 heads x 32 columns) run 16 lanes wide:
 * each lane adds the same products in the same order, so one query a row gets the AVX2 code's bits, at half the
 * instructions (at 16 heads and 16k slots, one thread: 4.4-4.6 against 7.0-7.2 ms; onnxruntime's MatMuls 5.3-5.5).
 * onnxruntime's MatMuls multiply the same shapes as batched GEMMs and read every slot of the capacity. T query tokens a row over
 * float32 caches go in groups at the AVX-512 level (range_grouped; heads a multiple of 16, d_c of 32): one outer
 * product of a group's queries, two registers of 16 a slot block, reads each slot once a group; its softmax runs
 * over the slots any token of the group sees, so its sums take another order than one token's alone. The plain C
 * path computes the same range one product at a time. */
#include "latent_attention.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "widen.h"

#define HB 4 /* heads per register block */
#define SB 3 /* slots per register block of the scores (dot products) */
#define OS 6 /* slots per register block of the scores (outer products: float32 caches, heads a multiple of 8) */
#define OHB 6 /* heads per register block of p @ latent */

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* accumulate q[h] . c[s] over `width` (a multiple of 8) into acc[s][h], for nh <= HB heads (rows of q, `width` apart)
 * and ns <= SB cache rows */
INLINE void dot_segment(const int nh, const int ns, const float *q, int64_t width, const void *const *c, int kind,
                        __m256 acc[SB][HB]) {
    for (int64_t d = 0; d < width; d += 8) {
        __m256 cv[SB];
        for (int s = 0; s < ns; s++) cv[s] = load8(c[s], d, kind);
        for (int h = 0; h < nh; h++) {
            __m256 qv = _mm256_loadu_ps(q + h * width + d);
            for (int s = 0; s < ns; s++) acc[s][h] = _mm256_fmadd_ps(qv, cv[s], acc[s][h]);
        }
    }
}

/* score[h * n + s] = q_latent[h] . latent[s] + q_rope[h] . rope[s] for nh <= HB heads and ns <= SB slots; nh and ns
 * constant where inlined, so the accumulators stay in registers, and one horizontal sum per score */
INLINE void dots(const int nh, const int ns, const float *ql, int64_t dc, const void *const *latent, const float *qr,
                 int64_t dr, const void *const *rope, int kind, float *score, int64_t n) {
    __m256 acc[SB][HB];
    for (int s = 0; s < ns; s++)
        for (int h = 0; h < nh; h++) acc[s][h] = _mm256_setzero_ps();
    dot_segment(nh, ns, ql, dc, latent, kind, acc);
    dot_segment(nh, ns, qr, dr, rope, kind, acc);
    for (int s = 0; s < ns; s++)
        for (int h = 0; h < nh; h++) score[h * n + s] = hsum(acc[s][h]);
}

/* the same for any nh, ns: the edges of the blocks */
KERNEL static void dots_edge(int nh, int ns, const float *ql, int64_t dc, const void *const *latent, const float *qr,
                             int64_t dr, const void *const *rope, int kind, float *score, int64_t n) {
    for (int h = 0; h < nh; h++)
        for (int s = 0; s < ns; s++)
            dots(1, 1, ql + h * dc, dc, latent + s, qr + h * dr, dr, rope + s, kind, score + h * n + s, n);
}

/* score[(h0 + j) * n + s] for the 8 np heads from h0 and ns <= OS slots, float32 caches: outer products of each
 * slot's cache values (broadcast) with the queries packed [k][heads] (qt, `heads` floats a row), so a cache row is
 * read once for all these heads and no horizontal sums are needed; np and ns constant where inlined */
INLINE void outer_scores(const int np, const int ns, const float *qt, int64_t heads, int64_t h0,
                         const void *const *latent, int64_t dc, const void *const *rope, int64_t dr, float *score,
                         int64_t n) {
    __m256 acc[OS][2];
    for (int s = 0; s < ns; s++) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
    for (int part = 0; part < 2; part++) { /* the latent's d_c columns, then the rope's d_r */
        const void *const *rows = part ? rope : latent;
        int64_t width = part ? dr : dc;
        const float *q = qt + (part ? dc : 0) * heads + h0;
        for (int64_t k = 0; k < width; k++, q += heads) {
            __m256 q0 = _mm256_loadu_ps(q), q1 = np == 2 ? _mm256_loadu_ps(q + 8) : q0;
            for (int s = 0; s < ns; s++) {
                __m256 a = _mm256_broadcast_ss((const float *)rows[s] + k);
                acc[s][0] = _mm256_fmadd_ps(a, q0, acc[s][0]);
                if (np == 2) acc[s][1] = _mm256_fmadd_ps(a, q1, acc[s][1]);
            }
        }
    }
    float tmp[OS][16];
    for (int s = 0; s < ns; s++) {
        _mm256_storeu_ps(tmp[s], acc[s][0]);
        if (np == 2) _mm256_storeu_ps(tmp[s] + 8, acc[s][1]);
    }
    for (int j = 0; j < 8 * np; j++)
        for (int s = 0; s < ns; s++) score[(h0 + j) * n + s] = tmp[s][j];
}

KERNEL static void outer_scores_edge(int np, int ns, const float *qt, int64_t heads, int64_t h0,
                                     const void *const *latent, int64_t dc, const void *const *rope, int64_t dr,
                                     float *score, int64_t n) {
    for (int s = 0; s < ns; s++)
        if (np == 2)
            outer_scores(2, 1, qt, heads, h0, latent + s, dc, rope + s, dr, score + s, n);
        else
            outer_scores(1, 1, qt, heads, h0, latent + s, dc, rope + s, dr, score + s, n);
}

/* o[h, 0 .. 16) over the n slots: o[h] = sum_i p[h * n + i] * c_i[d0 .. d0 + 16) for nh <= OHB heads */
INLINE void weighted_rows(const int nh, const float *p, int64_t n, const void *const *rows, int64_t d0, int kind,
                          float *o, int64_t ldo) {
    __m256 lo[OHB], hi[OHB];
    for (int h = 0; h < nh; h++) lo[h] = hi[h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        __m256 c0 = load8(rows[i], d0, kind), c1 = load8(rows[i], d0 + 8, kind);
        for (int h = 0; h < nh; h++) {
            __m256 ph = _mm256_broadcast_ss(p + h * n + i);
            lo[h] = _mm256_fmadd_ps(ph, c0, lo[h]);
            hi[h] = _mm256_fmadd_ps(ph, c1, hi[h]);
        }
    }
    for (int h = 0; h < nh; h++) {
        _mm256_storeu_ps(o + h * ldo + d0, lo[h]);
        _mm256_storeu_ps(o + h * ldo + d0 + 8, hi[h]);
    }
}

/* ---- AVX-512: the same sums, 16 lanes a register (each lane adds the same products in the same order as the AVX2
 * code, so the two levels give the same bits) ---- */

#define OS16 12 /* slots per register block of the AVX-512 scores: 12 accumulators of 16 heads */
#define OH16 8  /* heads per register block of the AVX-512 p @ latent, each 32 columns */
#define GROUP_TASKS 16 /* grouped: at least these many range tasks with slots to read, where the tokens allow (a
                          many-core pool's threads; a short cache then takes smaller groups) */
#define GROUP_COLUMNS 128 /* queries a grouped task takes: its packed queries, scores and cache range ~1 MiB at
                             DeepSeek's widths (Zen 4's L2) */

/* outer_scores 16 lanes wide: np (1 or 2) registers of 16 queries from c0 of `columns` a packed row (a query row's
 * heads, or a group's queries) and ns <= OS16 slots; np and ns constant where inlined */
INLINE512 void outer_scores16(const int np, const int ns, const float *qt, int64_t columns, int64_t c0,
                              const void *const *latent, int64_t dc, const void *const *rope, int64_t dr, float *score,
                              int64_t n) {
    __m512 acc[OS16][2];
    for (int s = 0; s < ns; s++) acc[s][0] = acc[s][1] = _mm512_setzero_ps();
    for (int part = 0; part < 2; part++) {
        const void *const *rows = part ? rope : latent;
        int64_t width = part ? dr : dc;
        const float *q = qt + (part ? dc : 0) * columns + c0;
        for (int64_t k = 0; k < width; k++, q += columns) {
            __m512 q0 = _mm512_loadu_ps(q), q1 = np == 2 ? _mm512_loadu_ps(q + 16) : q0;
            for (int s = 0; s < ns; s++) {
                __m512 a = _mm512_set1_ps(((const float *)rows[s])[k]);
                acc[s][0] = _mm512_fmadd_ps(a, q0, acc[s][0]);
                if (np == 2) acc[s][1] = _mm512_fmadd_ps(a, q1, acc[s][1]);
            }
        }
    }
    float tmp[OS16][32];
    for (int s = 0; s < ns; s++) {
        _mm512_storeu_ps(tmp[s], acc[s][0]);
        if (np == 2) _mm512_storeu_ps(tmp[s] + 16, acc[s][1]);
    }
    for (int j = 0; j < 16 * np; j++)
        for (int s = 0; s < ns; s++) score[(c0 + j) * n + s] = tmp[s][j];
}

/* the scores of `columns` queries a packed row (a multiple of 16) and the n slots, float32 caches: `wide` panels of
 * 32 (a chunk's groups: each slot read once per 32 queries; a last panel of 16), else of 16 (a query row's heads) */
KERNEL512 static void outer_scores_avx512(const float *qt, int64_t columns, int wide, const void *const *latent,
                                          int64_t dc, const void *const *rope, int64_t dr, float *score, int64_t n) {
    for (int64_t c0 = 0; c0 < columns;) {
        int64_t i = 0;
        if (wide && columns - c0 >= 32) {
            for (; i + OS16 <= n; i += OS16) outer_scores16(2, OS16, qt, columns, c0, latent + i, dc, rope + i, dr,
                                                           score + i, n);
            for (; i < n; i++) outer_scores16(2, 1, qt, columns, c0, latent + i, dc, rope + i, dr, score + i, n);
            c0 += 32;
        } else {
            for (; i + OS16 <= n; i += OS16) outer_scores16(1, OS16, qt, columns, c0, latent + i, dc, rope + i, dr,
                                                           score + i, n);
            for (; i < n; i++) outer_scores16(1, 1, qt, columns, c0, latent + i, dc, rope + i, dr, score + i, n);
            c0 += 16;
        }
    }
}

/* weighted_rows for nh <= OH16 heads and 32 columns d0 .. d0 + 32 */
INLINE512 void weighted_rows32(const int nh, const float *p, int64_t n, const void *const *rows, int64_t d0, int kind,
                               float *o, int64_t ldo) {
    __m512 lo[OH16], hi[OH16];
    for (int h = 0; h < nh; h++) lo[h] = hi[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        __m512 c0 = load16(rows[i], d0, kind), c1 = load16(rows[i], d0 + 16, kind);
        for (int h = 0; h < nh; h++) {
            __m512 ph = _mm512_set1_ps(p[h * n + i]);
            lo[h] = _mm512_fmadd_ps(ph, c0, lo[h]);
            hi[h] = _mm512_fmadd_ps(ph, c1, hi[h]);
        }
    }
    for (int h = 0; h < nh; h++) {
        _mm512_storeu_ps(o + h * ldo + d0, lo[h]);
        _mm512_storeu_ps(o + h * ldo + d0 + 16, hi[h]);
    }
}

/* o[h, 0 .. d_c) of every head over the n slots, 32 columns at a time; 0 where d_c is not a multiple of 32 (the AVX2
 * code then runs) */
KERNEL512 static int weighted_avx512(const float *p, int64_t heads, int64_t n, const void *const *rows, int64_t dc,
                                     int kind, float *o, int64_t ldo) {
    if (dc % 32) return 0;
    for (int64_t h0 = 0; h0 < heads; h0 += OH16)
        for (int64_t d0 = 0; d0 < dc; d0 += 32) {
            int64_t nh = heads - h0;
            if (nh >= OH16)
                weighted_rows32(OH16, p + h0 * n, n, rows, d0, kind, o + h0 * ldo, ldo);
            else
                for (int64_t h = 0; h < nh; h++)
                    weighted_rows32(1, p + (h0 + h) * n, n, rows, d0, kind, o + (h0 + h) * ldo, ldo);
        }
    return 1;
}

/* A grouped call's query rows a group: T in groups of at most GROUP_COLUMNS / h rows, as even as they go, smaller
 * (down to one) where fewer than GROUP_TASKS range tasks would have a slot to read (a short cache). After the blind
 * rows are found. */
static int64_t group_rows(const LatentAttention *job) {
    int64_t busy = 0; /* the ranges any query row of a cache row sees a slot of, summed over the cache rows */
    for (int64_t row = 0; row < job->rows / job->queries; row++) {
        int64_t extent = 0; /* past the last slot any of the row's queries sees */
        for (int64_t r = row * job->queries; r < (row + 1) * job->queries; r++) {
            const float *bias = job->bias + r * job->capacity;
            int64_t last = job->capacity;
            while (!job->blind[r] && !(bias[last - 1] > -FLT_MAX)) last--;
            extent = last > extent ? last : extent;
        }
        busy += (extent + LATENT_SPLIT - 1) / LATENT_SPLIT;
    }
    int64_t most = GROUP_COLUMNS / job->heads > 1 ? GROUP_COLUMNS / job->heads : 1;
    int64_t groups = (job->queries + most - 1) / most;
    while (groups < job->queries && busy * groups < GROUP_TASKS) groups++;
    return (job->queries + groups - 1) / groups;
}

/* a cache row's groups of query rows (group_rows) */
static inline int64_t row_groups(const LatentAttention *job) { return (job->queries + job->group - 1) / job->group; }

int latent_attention_plan(LatentAttention *job) {
    job->splits = (job->capacity + LATENT_SPLIT - 1) / LATENT_SPLIT;
    size_t partial = (size_t)(job->rows * job->splits * job->heads * (job->latent + 2));
    int outer = job->kind == STRIP_F32 && job->heads % 8 == 0 && job->isa != ISA_SCALAR;
    size_t packed = outer ? (size_t)(job->rows * (job->latent + job->rope) * job->heads) : 0;
    if (!(job->partial = malloc((partial + packed) * sizeof(float) + (size_t)job->rows))) return -1;
    job->q_packed = outer ? job->partial + partial : NULL;
    job->blind = (uint8_t *)(job->partial + partial + packed);
    for (int64_t r = 0; r < job->rows; r++) {
        const float *bias = job->bias + r * job->capacity;
        int64_t s = 0;
        while (s < job->capacity && !(bias[s] > -FLT_MAX)) s++;
        job->blind[r] = s == job->capacity;
    }
    job->group = latent_attention_grouped(job) ? group_rows(job) : 1;
    /* [k][h] a query row (grouped: [k][g·h] a group of g query rows, column t·h + head): the latent's d_c values,
     * then the rope's d_r */
    for (int64_t r = 0; outer && r < job->rows; r++) {
        const int64_t t = r % job->queries, g0 = t - t % job->group; /* the group's first token */
        const int64_t columns = (job->queries - g0 < job->group ? job->queries - g0 : job->group) * job->heads;
        float *qt = job->q_packed + (r - t + g0) * (job->latent + job->rope) * job->heads;
        for (int64_t h = 0; h < job->heads; h++) {
            const int64_t c = (t - g0) * job->heads + h;
            const float *ql = job->q_latent + (r * job->heads + h) * job->latent;
            const float *qr = job->q_rope + (r * job->heads + h) * job->rope;
            for (int64_t k = 0; k < job->latent; k++) qt[k * columns + c] = ql[k];
            for (int64_t k = 0; k < job->rope; k++) qt[(job->latent + k) * columns + c] = qr[k];
        }
    }
    return 0;
}

void latent_attention_release(LatentAttention *job) {
    free(job->partial);
    job->partial = NULL;
}

/* The slots of range `task` its row sees: their cache rows and bias (0 for a blind row), n of them; and the scores'
 * memory [heads, n]. NULL where there is none (no slot seen, or out of memory): the range's partial then says so,
 * and the combine skips it. */
static float *seen_slots(LatentAttention *job, int64_t task, int kind, const void **latent, const void **rope,
                         float *added, int64_t *count) {
    int64_t row = task / job->splits, s0 = task % job->splits * LATENT_SPLIT, cap = job->capacity;
    int64_t s1 = s0 + LATENT_SPLIT < cap ? s0 + LATENT_SPLIT : cap, heads = job->heads, dc = job->latent;
    const float *bias = job->bias + row * cap;
    float *part = job->partial + task * heads * (dc + 2); /* per head: o [d_c], max, sum */
    int64_t n = 0, cache_row = row / job->queries;
    for (int64_t s = s0; s < s1; s++)
        if (job->blind[row] || bias[s] > -FLT_MAX) {
            latent[n] = element(job->latent_cache, (cache_row * cap + s) * dc, kind);
            rope[n] = element(job->rope_cache, (cache_row * cap + s) * job->rope, kind);
            added[n++] = job->blind[row] ? 0.0f : bias[s];
        }
    float *score = n ? malloc(sizeof(float) * (size_t)(heads * n)) : NULL;
    if (!score) {
        if (n) __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        for (int64_t h = 0; h < heads; h++) part[h * (dc + 2) + dc] = -INFINITY, part[h * (dc + 2) + dc + 1] = 0.0f;
    }
    *count = n;
    return score;
}

/* plain C: scores, softmax and p @ latent one product at a time */
static void range_scalar(LatentAttention *job, int64_t task) {
    const void *latent[LATENT_SPLIT], *rope[LATENT_SPLIT];
    float added[LATENT_SPLIT];
    int64_t n, row = task / job->splits, heads = job->heads, dc = job->latent, dr = job->rope;
    int kind = job->kind;
    float *score = seen_slots(job, task, kind, latent, rope, added, &n), *part = job->partial + task * heads * (dc + 2);
    if (!score) return;
    const float *ql = job->q_latent + row * heads * dc, *qr = job->q_rope + row * heads * dr;
    for (int64_t h = 0; h < heads; h++) {
        float *p = score + h * n, top = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float s = 0.0f;
            if (!job->blind[row]) { /* a blind row: equal scores, the plain mean */
                for (int64_t d = 0; d < dc; d++) s += ql[h * dc + d] * stored_value(latent[i], d, kind);
                for (int64_t d = 0; d < dr; d++) s += qr[h * dr + d] * stored_value(rope[i], d, kind);
            }
            top = fmaxf(top, p[i] = s + added[i]);
        }
        for (int64_t i = 0; i < n; i++) sum += p[i] = expf(p[i] - top);
        float *o = part + h * (dc + 2);
        for (int64_t d = 0; d < dc; d++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < n; i++) acc += p[i] * stored_value(latent[i], d, kind);
            o[d] = acc;
        }
        o[dc] = top, o[dc + 1] = sum;
    }
    free(score);
}

/* softmax over one head's n scores of a range: p = e^(score + added - max) in place; stats = {max, sum of p} */
KERNEL static void softmax_range(float *p, const float *added, int64_t n, float *stats) {
    int64_t i = 0;
    __m256 most = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(added + i));
        _mm256_storeu_ps(p + i, v);
        most = _mm256_max_ps(v, most); /* a NaN score left out of the max, as fmaxf leaves it; its e^ is NaN */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), sum;
    for (; i < n; i++) top = fmaxf(top, p[i] += added[i]);
    i = 0;
    __m256 total = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(top)));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
    }
    sum = hsum(total);
    for (; i < n; i++) sum += p[i] = expf(p[i] - top);
    stats[0] = top, stats[1] = sum;
}

/* part[h, 0 .. d_c) = sum over the n slots of p[h * n + i] * latent_i, for every head (rows d_c + 2 apart) */
KERNEL static void weighted(Isa isa, const float *p, int64_t heads, int64_t n, const void *const *latent, int64_t dc,
                            int kind, float *part) {
    if (isa == ISA_AVX512 && weighted_avx512(p, heads, n, latent, dc, kind, part, dc + 2)) return;
    for (int64_t h0 = 0; h0 < heads; h0 += OHB) {
        int nh = heads - h0 < OHB ? (int)(heads - h0) : OHB;
        for (int64_t d0 = 0; d0 < dc; d0 += 16) {
            if (nh == OHB)
                weighted_rows(OHB, p + h0 * n, n, latent, d0, kind, part + h0 * (dc + 2), dc + 2);
            else if (nh == 4)
                weighted_rows(4, p + h0 * n, n, latent, d0, kind, part + h0 * (dc + 2), dc + 2);
            else
                for (int h = 0; h < nh; h++)
                    weighted_rows(1, p + (h0 + h) * n, n, latent, d0, kind, part + (h0 + h) * (dc + 2), dc + 2);
        }
    }
}

/* A group of a chunk's query rows (latent_attention_plan: at most GROUP_COLUMNS queries) over one slot range at once
 * (task = range * groups + cache row * its groups + group; float32 caches, AVX-512, h a multiple of 16): the slots any
 * of them sees, their scores as one outer product of the group's packed queries, then per query row its bias (a slot
 * it does not see: p = 0), softmax and p @ latent. */
KERNEL512 static void range_grouped(LatentAttention *job, int64_t task) {
    const void *latent[LATENT_SPLIT], *rope[LATENT_SPLIT];
    float added[LATENT_SPLIT];
    int64_t slot[LATENT_SPLIT], n = 0;
    const int64_t per_row = row_groups(job), groups = job->rows / job->queries * per_row;
    const int64_t heads = job->heads, dc = job->latent, dr = job->rope, cap = job->capacity;
    const int64_t range = task / groups, cache_row = task % groups / per_row, g0 = task % per_row * job->group;
    const int64_t t_count = job->queries - g0 < job->group ? job->queries - g0 : job->group, columns = t_count * heads;
    const int64_t s0 = range * LATENT_SPLIT, s1 = s0 + LATENT_SPLIT < cap ? s0 + LATENT_SPLIT : cap;
    const int64_t first = cache_row * job->queries + g0;
    int any_blind = 0;
    for (int64_t t = 0; t < t_count; t++) any_blind |= job->blind[first + t];
    for (int64_t s = s0; s < s1; s++) {
        int seen = any_blind;
        for (int64_t t = 0; !seen && t < t_count; t++) seen = job->bias[(first + t) * cap + s] > -FLT_MAX;
        if (seen) {
            latent[n] = (const float *)job->latent_cache + (cache_row * cap + s) * dc;
            rope[n] = (const float *)job->rope_cache + (cache_row * cap + s) * dr;
            slot[n++] = s;
        }
    }
    float *score = n ? malloc(sizeof(float) * (size_t)(columns * n)) : NULL;
    if (n && !score) __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    if (score) outer_scores_avx512(job->q_packed + first * (dc + dr) * heads, columns, 1, latent, dc, rope, dr, score,
                                   n);
    for (int64_t t = 0; t < t_count; t++) {
        const int64_t row = first + t;
        const float *bias = job->bias + row * cap;
        float *part = job->partial + (row * job->splits + range) * heads * (dc + 2);
        int seen = 0, unseen = 0;
        for (int64_t i = 0; score && i < n; i++) {
            added[i] = job->blind[row] ? 0.0f : bias[slot[i]];
            seen |= added[i] > -FLT_MAX, unseen |= !(added[i] > -FLT_MAX);
        }
        if (!seen) { /* none of this range's slots for this query row */
            for (int64_t h = 0; h < heads; h++) part[h * (dc + 2) + dc] = -INFINITY, part[h * (dc + 2) + dc + 1] = 0.0f;
            continue;
        }
        float *p = score + t * heads * n;
        if (job->blind[row]) memset(p, 0, sizeof(float) * (size_t)(heads * n)); /* equal scores: the plain mean */
        for (int64_t h = 0; h < heads; h++) {
            softmax_range(p + h * n, added, n, part + h * (dc + 2) + dc);
            for (int64_t i = 0; unseen && i < n; i++) /* e^-87.3 (exp8's floor), left out of the sum (>= 1) */
                if (!(added[i] > -FLT_MAX)) p[h * n + i] = 0.0f;
        }
        weighted(ISA_AVX512, p, heads, n, latent, dc, STRIP_F32, part);
    }
    free(score);
}

KERNEL static void range_of(LatentAttention *job, int64_t task, int kind) {
    const void *latent[LATENT_SPLIT], *rope[LATENT_SPLIT];
    float added[LATENT_SPLIT];
    int64_t n, row = task / job->splits, heads = job->heads, dc = job->latent;
    float *score = seen_slots(job, task, kind, latent, rope, added, &n), *part = job->partial + task * heads * (dc + 2);
    if (!score) return;
    const float *ql = job->q_latent + row * heads * dc, *qr = job->q_rope + row * heads * job->rope;
    if (job->blind[row]) memset(score, 0, sizeof(float) * (size_t)(heads * n)); /* equal scores: the plain mean */
    else if (job->q_packed && job->isa == ISA_AVX512 && heads % 16 == 0)
        outer_scores_avx512(job->q_packed + row * (dc + job->rope) * heads, heads, 0, latent, dc, rope, job->rope,
                            score, n);
    else if (job->q_packed) { /* float32 caches, heads a multiple of 8: outer products, 16 (or 8) heads a panel */
        const float *qt = job->q_packed + row * (dc + job->rope) * heads;
        int np = heads % 16 == 0 ? 2 : 1;
        for (int64_t h0 = 0; h0 < heads; h0 += 8 * np)
            for (int64_t i = 0; i < n; i += OS) {
                int ns = n - i < OS ? (int)(n - i) : OS;
                if (ns == OS && np == 2)
                    outer_scores(2, OS, qt, heads, h0, latent + i, dc, rope + i, job->rope, score + i, n);
                else if (ns == OS)
                    outer_scores(1, OS, qt, heads, h0, latent + i, dc, rope + i, job->rope, score + i, n);
                else
                    outer_scores_edge(np, ns, qt, heads, h0, latent + i, dc, rope + i, job->rope, score + i, n);
            }
    } else /* dot products, 4 heads x 3 slots a block */
        for (int64_t h0 = 0; h0 < heads; h0 += HB) {
            int nh = heads - h0 < HB ? (int)(heads - h0) : HB;
            for (int64_t i = 0; i < n; i += SB) {
                int ns = n - i < SB ? (int)(n - i) : SB;
                float *sc = score + h0 * n + i;
                if (nh == HB && ns == SB)
                    dots(HB, SB, ql + h0 * dc, dc, latent + i, qr + h0 * job->rope, job->rope, rope + i, kind, sc, n);
                else
                    dots_edge(nh, ns, ql + h0 * dc, dc, latent + i, qr + h0 * job->rope, job->rope, rope + i, kind,
                              sc, n);
            }
        }
    for (int64_t h = 0; h < heads; h++) softmax_range(score + h * n, added, n, part + h * (dc + 2) + dc);
    weighted(job->isa, score, heads, n, latent, dc, kind, part);
    free(score);
}

KERNEL static void range_f32(LatentAttention *job, int64_t task) { range_of(job, task, STRIP_F32); }
KERNEL static void range_f16(LatentAttention *job, int64_t task) { range_of(job, task, STRIP_F16); }
KERNEL static void range_bf16(LatentAttention *job, int64_t task) { range_of(job, task, STRIP_BF16); }

int latent_attention_grouped(const LatentAttention *job) {
    return job->queries > 1 && job->kind == STRIP_F32 && job->isa == ISA_AVX512 && job->heads % 16 == 0 &&
           job->latent % 32 == 0;
}

int64_t latent_attention_tasks(const LatentAttention *job) {
    if (!latent_attention_grouped(job)) return job->rows * job->splits;
    return job->rows / job->queries * row_groups(job) * job->splits;
}

void latent_attention_range(LatentAttention *job, int64_t task) {
    if (latent_attention_grouped(job)) {
        range_grouped(job, task);
        return;
    }
    task = task % job->rows * job->splits + task / job->rows; /* range-major (the header) as row * splits + range */
    if (job->isa == ISA_SCALAR) {
        range_scalar(job, task);
        return;
    }
    switch (job->kind) { /* one instantiation per kind */
        case STRIP_F16: range_f16(job, task); break;
        case STRIP_BF16: range_bf16(job, task); break;
        default: range_f32(job, task); break;
    }
}

void latent_ranges_combine(const float *partial, int64_t splits, int64_t heads, int64_t dc, float *out,
                           int64_t task) {
    const int64_t stride = heads * (dc + 2), row = task / heads, h = task % heads;
    const float *parts = partial + row * splits * stride + h * (dc + 2);
    float top = -INFINITY, sum = 0.0f;
    out += (row * heads + h) * dc;
    for (int64_t j = 0; j < splits; j++) {
        const float seen = parts[j * stride + dc + 1];
        if (seen != seen) { /* a NaN score in the range (its sum NaN): the output is NaN, as the softmax's is */
            for (int64_t d = 0; d < dc; d++) out[d] = NAN;
            return;
        }
        if (seen > 0.0f) top = fmaxf(top, parts[j * stride + dc]);
    }
    memset(out, 0, sizeof(float) * (size_t)dc);
    if (top == -INFINITY) return; /* no slot anywhere: only after a failed allocation */
    for (int64_t j = 0; j < splits; j++) {
        const float *part = parts + j * stride;
        if (!(part[dc + 1] > 0.0f)) continue;
        float w = expf(part[dc] - top);
        sum += w * part[dc + 1];
        for (int64_t d = 0; d < dc; d++) out[d] += w * part[d];
    }
    for (int64_t d = 0; d < dc; d++) out[d] /= sum;
}

void latent_attention_combine(LatentAttention *job, int64_t task) {
    latent_ranges_combine(job->partial, job->splits, job->heads, job->latent, job->out, task);
}
