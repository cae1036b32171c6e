/* The routed experts of one MoE layer (routed_experts.h): each expert's tokens gathered into one small matrix,
 * multiplied by its strips with strip_matmul's kernels (one row: a stream over the strip; more: register blocks), on
 * the path job->isa names; SiLU 8 at a time on the SIMD paths, in plain C on the scalar one.
 * onnxruntime's MoE op groups tokens the same way but multiplies through MLAS with B transposed, which packs the
 * whole expert matrix on every call once an expert has two tokens or more: at batch 16 of the demo model it ran at
 * a quarter of this machine's single-core FMA rate. */
#include "routed_experts.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "widen.h"

static int64_t packed_slots(int64_t rows) { return rows == 1 ? 0 : strip_matmul_groups(rows) * MR; }

static const void *expert_strips(const RoutedExperts *job, const void *base, int64_t e, int64_t per_expert) {
    return (const char *)base + e * per_expert * strip_kind_bytes(job->kind);
}

/* expert i's product by its fc1 (which = 1) or fc2 (which = 2) strips, as a StripMatMul over its routed rows */
static StripMatMul product(const RoutedExperts *job, int64_t i, int which) {
    int64_t rows = job->first[i + 1] - job->first[i], row0 = job->first[i];
    StripMatMul m = {.kind = job->kind, .isa = job->isa, .m = rows, .group = strip_matmul_group_rows(rows)};
    if (which == 1) {
        m.k = job->d, m.n = 2 * job->inter;
        m.a = rows == 1 ? job->x + job->token[row0] * job->d : job->xs + job->packed[i] * job->d;
        m.b = expert_strips(job, job->fc1, job->expert[i], job->inter / GATE_UP * job->d * STRIP);
        m.y = job->hidden + row0 * m.n;
    } else {
        m.k = job->inter, m.n = job->out_strips * STRIP;
        m.a = rows == 1 ? job->act + row0 * job->inter : job->acts + job->packed[i] * job->inter;
        m.b = expert_strips(job, job->fc2, job->expert[i], job->out_strips * job->inter * STRIP);
        m.y = job->out + row0 * m.n;
    }
    return m;
}

int routed_experts_plan(RoutedExperts *job) {
    int64_t *rows = calloc((size_t)job->experts, sizeof(int64_t)); /* per expert */
    if (!rows) return -1;
    for (int64_t t = 0; t < job->tokens; t++)
        for (int64_t e = 0; e < job->experts; e++) rows[e] += job->dispatch[t * job->experts + e] != 0.0f;
    int64_t active = 0, slots = 0, routed = 0;
    for (int64_t e = 0; e < job->experts; e++) active += rows[e] > 0, slots += packed_slots(rows[e]), routed += rows[e];
    int64_t d_out = job->out_strips * STRIP;
    size_t ints = (size_t)(active + active + 1 + routed + active);
    size_t floats = (size_t)(routed + slots * job->d + routed * 2 * job->inter + routed * job->inter +
                             slots * job->inter + routed * d_out);
    char *memory = malloc(ints * sizeof(int64_t) + floats * sizeof(float) + 1);
    if (!memory) {
        free(rows);
        return -1;
    }
    job->memory = memory;
    job->active = active;
    job->expert = (int64_t *)memory, job->first = job->expert + active, job->token = job->first + active + 1;
    job->packed = job->token + routed;
    job->weight = (float *)(job->packed + active);
    job->xs = job->weight + routed, job->hidden = job->xs + slots * job->d;
    job->act = job->hidden + routed * 2 * job->inter, job->acts = job->act + routed * job->inter;
    job->out = job->acts + slots * job->inter;
    int64_t i = 0, row = 0, slot = 0;
    for (int64_t e = 0; e < job->experts; e++) {
        if (!rows[e]) continue;
        job->expert[i] = e, job->first[i] = row, job->packed[i] = slot;
        for (int64_t t = 0; t < job->tokens; t++) {
            float w = job->dispatch[t * job->experts + e];
            if (w != 0.0f) job->token[row] = t, job->weight[row] = w, row++;
        }
        slot += packed_slots(rows[e]), i++;
    }
    job->first[active] = row;
    free(rows);
    memset(job->y, 0, sizeof(float) * (size_t)(job->tokens * job->d));
    return 0;
}

void routed_experts_release(RoutedExperts *job) {
    free(job->memory);
    job->memory = NULL;
}

void routed_experts_gather(RoutedExperts *job, int64_t i) {
    StripMatMul m = product(job, i, 1);
    if (m.m == 1) return; /* read in place */
    const float *rows[MR];
    for (int64_t g = 0; g < strip_matmul_groups(m.m); g++) {
        for (int64_t r = 0, row = g * m.group; r < MR; r++, row++)
            rows[r] = row < m.m ? job->x + job->token[job->first[i] + row] * job->d : NULL;
        strip_matmul_pack_rows(&m, rows, job->xs + job->packed[i] * job->d, g);
    }
}

/* act[c] = silu(gate[c]) * up[c] = gate[c] / (1 + e^-gate[c]) * up[c] for c < GATE_UP */
static void silu_scalar(const float *gate, const float *up, float *act) {
    for (int c = 0; c < GATE_UP; c++) act[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
}

KERNEL static void silu_avx2(const float *gate, const float *up, float *act) {
    for (int c = 0; c < GATE_UP; c += 8) {
        __m256 g = _mm256_loadu_ps(gate + c), e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(act + c, _mm256_mul_ps(silu, _mm256_loadu_ps(up + c)));
    }
}

void routed_experts_fc1(RoutedExperts *job, int64_t task) {
    int64_t strips = job->inter / GATE_UP, i = task / strips, j = task % strips;
    StripMatMul m = product(job, i, 1);
    strip_matmul_strip(&m, j);
    for (int64_t r = 0; r < m.m; r++) {
        const float *gate = m.y + r * m.n + j * STRIP, *up = gate + GATE_UP;
        float *act = job->act + (job->first[i] + r) * job->inter + j * GATE_UP;
        if (job->isa == ISA_SCALAR) silu_scalar(gate, up, act);
        else silu_avx2(gate, up, act);
    }
}

void routed_experts_pack(RoutedExperts *job, int64_t i) {
    StripMatMul m = product(job, i, 2);
    if (m.m == 1) return;
    const float *rows = job->act + job->first[i] * job->inter;
    for (int64_t g = 0; g < strip_matmul_groups(m.m); g++) strip_matmul_pack(&m, rows, job->acts + job->packed[i] * job->inter, g);
}

void routed_experts_fc2(RoutedExperts *job, int64_t s) {
    int64_t col = s * STRIP, width = job->d - col < STRIP ? job->d - col : STRIP; /* d' pads the last strip */
    for (int64_t i = 0; i < job->active; i++) {
        StripMatMul m = product(job, i, 2);
        strip_matmul_strip(&m, s);
        for (int64_t r = 0; r < m.m; r++) {
            int64_t row = job->first[i] + r;
            const float *out = m.y + r * m.n + col;
            float *y = job->y + job->token[row] * job->d + col, w = job->weight[row];
            for (int64_t c = 0; c < width; c++) y[c] += w * out[c];
        }
    }
}
