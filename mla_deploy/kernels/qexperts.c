/* The routed experts of one MoE layer over quantized weights (qexperts.h): each expert's tokens multiplied together
 * by qmatmul.c's tiles (one row: a stream over the expert's runs; more: R rows per unpacked run), the tokens' rows
 * read in place through an index. Partial products go to per-task buffers of ROWS rows on the stack, so no task
 * allocates, and Y receives each expert's rows in expert order whatever the threads do. */
#include "qexperts.h"

#include <stdlib.h>
#include <string.h>

#include "quant_simd.h"

#define ROWS 64        /* routed rows per partial product */
#define CHUNK_ROWS 32  /* rows per quantizing task */

/* e^x within 2 ulp for x in [-87, 88], Cephes' expf: 2^n e^r with r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split in
 * two for an exact product) and e^r by a degree-7 polynomial. Plain float operations that vectorize, so every path
 * computes the same bits: the scalar one, and AVX2 / AVX-512 over 16 columns at once (glibc's expf, one value at a
 * time, took 8 % of a 512-token prefill's routed experts). */
static inline __attribute__((always_inline)) float exp_poly(float x) {
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 · 2^23 */
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof(two_n));
    return p * two_n;
}

/* act[c] = silu(gate[c]) · up[c] = gate[c] / (1 + e^-gate[c]) · up[c] for 16 columns, e^ of -gate clamped to
 * [-87, 88] beforehand (min and max are exact, however computed: GCC vectorizes the loop only without the branches) */
static inline __attribute__((always_inline)) void silu_up(const float *gate, const float *minus, const float *up,
                                                          float *act) {
    for (int c = 0; c < QCOLS; c++) act[c] = gate[c] / (1.0f + exp_poly(minus[c])) * up[c];
}

static void silu_up_scalar(const float *gate, const float *up, float *act) {
    float minus[QCOLS];
    for (int c = 0; c < QCOLS; c++) minus[c] = -gate[c] < -87.0f ? -87.0f : -gate[c] > 88.0f ? 88.0f : -gate[c];
    silu_up(gate, minus, up, act);
}

TARGET_AVX2 static void silu_up_avx2(const float *gate, const float *up, float *act) {
    float minus[QCOLS];
    for (int h = 0; h < QCOLS; h += 8) {
        __m256 x = _mm256_xor_ps(_mm256_loadu_ps(gate + h), _mm256_set1_ps(-0.0f)); /* -gate */
        _mm256_storeu_ps(minus + h, _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
    }
    silu_up(gate, minus, up, act);
}

TARGET_AVX512 static void silu_up_avx512(const float *gate, const float *up, float *act) {
    __m512 x = _mm512_xor_ps(_mm512_loadu_ps(gate), _mm512_set1_ps(-0.0f)); /* -gate */
    float minus[QCOLS];
    _mm512_storeu_ps(minus, _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
    silu_up(gate, minus, up, act);
}

static int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

/* expert e's fc1 (which = 1) or fc2 (which = 2) as a QWeight */
static QWeight weight_of(const QExperts *job, int64_t e, int which) {
    QWeight w = {.bits = job->bits, .block = job->block};
    int64_t run = 2 * (int64_t)job->block * job->bits;
    if (which == 1) {
        w.k = job->d, w.n = 2 * job->inter, w.kb = job->kb1, w.groups = job->groups1;
        w.codes = job->fc1_codes + e * w.groups * w.kb * run, w.scales = job->fc1_scales + e * w.groups * w.kb * QCOLS;
    } else {
        w.k = job->kb2 * job->block, w.n = job->d, w.kb = job->kb2, w.groups = job->groups2;
        w.codes = job->fc2_codes + e * w.groups * w.kb * run, w.scales = job->fc2_scales + e * w.groups * w.kb * QCOLS;
    }
    return w;
}

/* a bump allocator over one block of memory: `size` bytes at a 64-byte boundary */
static void *take(char **cursor, int64_t size) {
    void *p = *cursor;
    *cursor += round_up(size, 64);
    return p;
}

int qexperts_plan(QExperts *job) {
    int64_t *rows = calloc((size_t)job->experts, sizeof(int64_t)); /* per expert */
    if (!rows) return -1;
    for (int64_t t = 0; t < job->tokens; t++)
        for (int64_t e = 0; e < job->experts; e++) rows[e] += job->dispatch[t * job->experts + e] != 0.0f;
    int64_t active = 0, routed = 0;
    for (int64_t e = 0; e < job->experts; e++) active += rows[e] > 0, routed += rows[e];
    int64_t lda1 = job->kb1 * job->block, lda2 = job->kb2 * job->block, t = job->tokens;
    int64_t level4 = job->level == 4, pad_x = !level4 && lda1 != job->d;
    int64_t plan = round_up(8 * active, 64) + round_up(8 * (active + 1), 64) + round_up(8 * routed, 64) +
                   round_up(4 * routed, 64) + round_up(4 * routed * lda2, 64);
    int64_t int8 = round_up(t * lda1, 64) + 2 * round_up(4 * t * job->kb1, 64) + round_up(routed * lda2, 64) +
                   2 * round_up(4 * routed * job->kb2, 64);
    int64_t total = 64 + plan + level4 * int8 + pad_x * round_up(4 * t * lda1, 64);
    char *memory = malloc((size_t)total);
    if (!memory) {
        free(rows);
        return -1;
    }
    job->memory = memory;
    char *cursor = (char *)round_up((int64_t)(uintptr_t)memory, 64);
    job->active = active;
    job->expert = take(&cursor, 8 * active), job->first = take(&cursor, 8 * (active + 1));
    job->token = take(&cursor, 8 * routed), job->weight = take(&cursor, 4 * routed);
    job->act = take(&cursor, 4 * routed * lda2);
    job->x_q = job->act_q = NULL, job->x_scale = job->x_f = job->act_scale = NULL;
    job->x_offset = job->act_offset = NULL;
    if (level4) {
        job->x_q = take(&cursor, t * lda1), job->x_scale = take(&cursor, 4 * t * job->kb1);
        job->x_offset = take(&cursor, 4 * t * job->kb1);
        job->act_q = take(&cursor, routed * lda2), job->act_scale = take(&cursor, 4 * routed * job->kb2);
        job->act_offset = take(&cursor, 4 * routed * job->kb2);
    } else if (pad_x) {
        job->x_f = take(&cursor, 4 * t * lda1);
    }
    int64_t i = 0, row = 0;
    for (int64_t e = 0; e < job->experts; e++) {
        if (!rows[e]) continue;
        job->expert[i] = e, job->first[i] = row;
        for (int64_t tk = 0; tk < job->tokens; tk++) {
            float w = job->dispatch[tk * job->experts + e];
            if (w != 0.0f) job->token[row] = tk, job->weight[row] = w, row++;
        }
        i++;
    }
    job->first[active] = row;
    for (int64_t r = 0; r < routed; r++) /* fc2's K past I': zero, never written by fc1 */
        memset(job->act + r * lda2 + job->inter, 0, sizeof(float) * (size_t)(lda2 - job->inter));
    free(rows);
    memset(job->y, 0, sizeof(float) * (size_t)(job->tokens * job->d));
    return 0;
}

/* fc1's input: the tokens' rows, through the routed rows' token index */
static QActs x_rows(const QExperts *job) {
    QActs a = {.level = job->level, .lda = job->kb1 * job->block, .q = job->x_q, .scale = job->x_scale,
               .offset = job->x_offset, .f = job->x_f, .index = job->token};
    if (job->level == 0 && !job->x_f) a.f = job->x, a.lda = job->d;
    return a;
}

/* fc2's input: the routed rows' activations */
static QActs act_rows(const QExperts *job) {
    return (QActs){.level = job->level, .lda = job->kb2 * job->block, .q = job->act_q, .scale = job->act_scale,
                   .offset = job->act_offset, .f = job->act};
}

void qexperts_release(QExperts *job) {
    free(job->memory);
    job->memory = NULL;
}

int64_t qexperts_x_tasks(const QExperts *job) {
    return job->x_q || job->x_f ? (job->tokens + CHUNK_ROWS - 1) / CHUNK_ROWS : 0;
}

void qexperts_x(QExperts *job, int64_t task) {
    int64_t end = (task + 1) * CHUNK_ROWS < job->tokens ? (task + 1) * CHUNK_ROWS : job->tokens;
    int64_t lda1 = job->kb1 * job->block;
    for (int64_t t = task * CHUNK_ROWS; t < end; t++) {
        const float *x = job->x + t * job->d;
        if (job->level == 4)
            qmatmul_quantize_row(job->isa, x, job->d, job->block, 1 << (job->bits - 1), job->x_q + t * lda1,
                                 job->x_scale + t * job->kb1, job->x_offset + t * job->kb1);
        else
            qmatmul_pad_row(x, job->d, lda1, job->x_f + t * lda1);
    }
}

static int64_t pair_chunks(const QExperts *job) { return (job->inter / QCOLS + QEXPERT_PAIRS - 1) / QEXPERT_PAIRS; }

int64_t qexperts_fc1_tasks(const QExperts *job) { return job->active * pair_chunks(job); }

void qexperts_fc1(QExperts *job, int64_t task) {
    int64_t i = task / pair_chunks(job), g0 = task % pair_chunks(job) * 2 * QEXPERT_PAIRS;
    int64_t g1 = g0 + 2 * QEXPERT_PAIRS < job->groups1 ? g0 + 2 * QEXPERT_PAIRS : job->groups1;
    QWeight w = weight_of(job, job->expert[i], 1);
    QActs a = x_rows(job);
    float hidden[ROWS * 2 * QEXPERT_PAIRS * QCOLS]; /* [rows, this task's gate and up columns] */
    const int64_t ldh = 2 * QEXPERT_PAIRS * QCOLS, lda2 = job->kb2 * job->block;
    for (int64_t r0 = job->first[i]; r0 < job->first[i + 1]; r0 += ROWS) {
        int64_t r1 = r0 + ROWS < job->first[i + 1] ? r0 + ROWS : job->first[i + 1];
        qmatmul_rows_groups(job->isa, &w, &a, r0, r1, g0, g1, hidden, ldh);
        void (*silu)(const float *, const float *, float *) =
            job->isa == ISA_AVX512 ? silu_up_avx512 : job->isa == ISA_AVX2 ? silu_up_avx2 : silu_up_scalar;
        for (int64_t r = r0; r < r1; r++) {
            for (int64_t g = g0; g < g1; g += 2) {
                const float *gate = hidden + (r - r0) * ldh + (g - g0) * QCOLS;
                silu(gate, gate + QCOLS, job->act + r * lda2 + g / 2 * QCOLS);
            }
        }
    }
}

int64_t qexperts_acts_tasks(const QExperts *job) {
    return job->level == 4 ? (job->first[job->active] + CHUNK_ROWS - 1) / CHUNK_ROWS : 0;
}

void qexperts_acts(QExperts *job, int64_t task) {
    int64_t routed = job->first[job->active], end = (task + 1) * CHUNK_ROWS < routed ? (task + 1) * CHUNK_ROWS : routed;
    int64_t lda2 = job->kb2 * job->block;
    for (int64_t r = task * CHUNK_ROWS; r < end; r++)
        qmatmul_quantize_row(job->isa, job->act + r * lda2, lda2, job->block, 1 << (job->bits - 1),
                             job->act_q + r * lda2, job->act_scale + r * job->kb2, job->act_offset + r * job->kb2);
}

int64_t qexperts_fc2_tasks(const QExperts *job) { return (job->groups2 + QEXPERT_GROUPS - 1) / QEXPERT_GROUPS; }

void qexperts_fc2(QExperts *job, int64_t task) {
    int64_t g0 = task * QEXPERT_GROUPS, g1 = g0 + QEXPERT_GROUPS < job->groups2 ? g0 + QEXPERT_GROUPS : job->groups2;
    int64_t col = g0 * QCOLS, width = (job->d < g1 * QCOLS ? job->d : g1 * QCOLS) - col;
    float out[ROWS * QEXPERT_GROUPS * QCOLS];
    const int64_t ldo = QEXPERT_GROUPS * QCOLS;
    QActs a = act_rows(job);
    for (int64_t i = 0; i < job->active; i++) {
        QWeight w = weight_of(job, job->expert[i], 2);
        for (int64_t r0 = job->first[i]; r0 < job->first[i + 1]; r0 += ROWS) {
            int64_t r1 = r0 + ROWS < job->first[i + 1] ? r0 + ROWS : job->first[i + 1];
            qmatmul_rows_groups(job->isa, &w, &a, r0, r1, g0, g1, out, ldo);
            for (int64_t r = r0; r < r1; r++) {
                float *y = job->y + job->token[r] * job->d + col, weight = job->weight[r];
                const float *o = out + (r - r0) * ldo;
                for (int64_t c = 0; c < width; c++) y[c] += weight * o[c];
            }
        }
    }
}
