/* The routed experts of one MoE layer over block-quantized weights (qmatmul.h's layout), each on the tokens that
 * chose it:
 *   Y[t] = sum over experts e with dispatch[t, e] != 0 of dispatch[t, e] * down_e(silu(gate_e x[t]) * up_e x[t])
 * Tokens are grouped by expert, so an expert's weights are read once per call whatever the number of its tokens,
 * and an expert no token chose is not read at all.
 *   fc1 [E, 2 I' / 16, ceil(d / B), 2·B·bits] (+ scales [E, 2 I' / 16, ceil(d / B), 16]): W [d, 2 I'] whose 16-column
 *       groups alternate gate and up (export/layouts.py gate_up_columns), so a pair of groups gives 16 activations;
 *   fc2 [E, ceil(d / 16), ceil(I / B), 2·B·bits] (+ scales): down's W [I, d], K padded to whole blocks.
 * At accuracy level 4 each token's x is quantized once (shared by every expert it chose) and each routed row's
 * activations once after fc1. Plain C over plain arrays; custom_ops.c wires it to onnxruntime as QRoutedExperts. */
#ifndef MLA_DEPLOY_QEXPERTS_H
#define MLA_DEPLOY_QEXPERTS_H

#include <stdint.h>

#include "qmatmul.h"

typedef struct {
    Isa isa;
    int level, bits, block;
    int64_t tokens, d, experts, inter;    /* inter: I' = fc1's columns / 2 */
    int64_t groups1, kb1, groups2, kb2;   /* fc1: 2 I' / 16 groups of ceil(d / B) blocks; fc2: ceil(d / 16) groups of
                                           * ceil(I / B) blocks */
    const float *x, *dispatch;            /* [tokens, d], [tokens, experts] */
    const uint8_t *fc1_codes, *fc2_codes;
    const uint16_t *fc1_scales, *fc2_scales;
    float *y;                             /* [tokens, d] */
    /* the plan (qexperts_plan): the experts some token chose, in increasing order, and their rows */
    int64_t active;
    int64_t *expert;  /* [active] */
    int64_t *first;   /* [active + 1]: expert i's routed rows are first[i] .. first[i + 1] - 1 */
    int64_t *token;   /* [routed]: the token of each routed row */
    float *weight;    /* [routed]: its dispatch weight */
    /* fc1's input, the tokens' rows: level 4 codes [tokens, kb1 · B], scales and offsets [tokens, kb1]; level 0 the
     * rows zero-padded to kb1 · B (NULL where d is whole blocks: x is read in place) */
    int8_t *x_q;
    float *x_scale, *x_f;
    int32_t *x_offset;
    float *act;       /* [routed, kb2 · B] silu(gate) · up, zero past I' */
    int8_t *act_q;    /* level 4: act quantized [routed, kb2 · B], scales and offsets [routed, kb2] */
    float *act_scale;
    int32_t *act_offset;
    void *memory;
} QExperts;

/* Group the tokens by expert and allocate the scratch; zeroes Y. 0 on success, -1 out of memory. */
int qexperts_plan(QExperts *job);
void qexperts_release(QExperts *job);
/* The steps, in order, each over independent tasks (any threads):
 * x: tokens in chunks of qexperts_chunk_rows (each token's x quantized, or padded, for fc1); */
void qexperts_x(QExperts *job, int64_t task);
int64_t qexperts_x_tasks(const QExperts *job);
/* fc1: one task per active expert and chunk of QEXPERT_PAIRS pairs of fc1 groups: its rows' activations; */
#define QEXPERT_PAIRS 4
int64_t qexperts_fc1_tasks(const QExperts *job);
void qexperts_fc1(QExperts *job, int64_t task);
/* acts: routed rows in chunks (level 4: each row's activations quantized); */
int64_t qexperts_acts_tasks(const QExperts *job);
void qexperts_acts(QExperts *job, int64_t task);
/* fc2: one task per chunk of QEXPERT_GROUPS groups of Y's columns: every active expert's rows, added into Y in
 * expert order. */
#define QEXPERT_GROUPS 8
int64_t qexperts_fc2_tasks(const QExperts *job);
void qexperts_fc2(QExperts *job, int64_t task);

#endif
