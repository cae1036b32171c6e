/* The routed experts of one MoE layer, each on the tokens that chose it:
 *   Y[t] = sum over experts e with dispatch[t, e] != 0 of dispatch[t, e] * down_e(silu(gate_e x[t]) * up_e x[t])
 * Tokens are grouped by expert, so an expert's weights are read once per call whatever the number of its tokens,
 * and an expert no token chose is not read at all. Weights in column strips (strip_matmul.h), any StripKind:
 *   fc1 [E, I' / 32, d, 64]: strip j holds gate columns 32 j .. 32 j + 31, then up's same columns (I' = I rounded up
 *       to 32, the padding zero), so one strip's product gives 32 finished activations;
 *   fc2 [E, d' / 64, I', 64]: down's transpose [I', d'] in strips (d' = d rounded up to 64, the padding zero).
 * Plain C over plain arrays; custom_ops.c wires it to onnxruntime as mla_deploy.RoutedExperts. */
#ifndef MLA_DEPLOY_ROUTED_EXPERTS_H
#define MLA_DEPLOY_ROUTED_EXPERTS_H

#include <stdint.h>

#include "strip_matmul.h"

#define GATE_UP 32 /* activations per fc1 strip: its 64 columns are 32 gate and 32 up */

typedef struct {
    StripKind kind;
    Isa isa;               /* the path that runs (dispatch.h) */
    int64_t tokens, d, experts, inter, out_strips; /* inter: I' (a multiple of 32); out_strips: d' / 64 */
    const float *x;        /* [tokens, d] */
    const float *dispatch; /* [tokens, experts] */
    const void *fc1, *fc2; /* the strips above, in `kind` */
    float *y;              /* [tokens, d] */
    /* the plan (routed_experts_plan): the experts some token chose, in increasing order, and their rows */
    int64_t active;
    int64_t *expert;  /* [active] */
    int64_t *first;   /* [active + 1]: expert i's routed rows are first[i] .. first[i + 1] - 1 */
    int64_t *token;   /* [routed]: the token of each routed row */
    float *weight;    /* [routed]: its dispatch weight */
    int64_t *packed;  /* [active]: where expert i's packed rows start in xs and acts (strip_matmul_pack) */
    float *xs;        /* expert i's tokens' x rows, packed */
    float *hidden;    /* [routed, 2 I']: fc1's products */
    float *act;       /* [routed, I']: silu(gate) * up */
    float *acts;      /* act's rows, packed per expert */
    float *out;       /* [routed, d']: fc2's products */
    void *memory;     /* everything above, one allocation */
} RoutedExperts;

/* Group the tokens by expert and allocate the scratch; zeroes Y. 0 on success, -1 out of memory. */
int routed_experts_plan(RoutedExperts *job);
void routed_experts_release(RoutedExperts *job);
/* The steps, in order, each over independent tasks (any threads):
 * gather: one task per active expert (its tokens' x rows packed); */
void routed_experts_gather(RoutedExperts *job, int64_t i);
/* fc1: one task per active expert and fc1 strip (active * I' / 32): 32 activations of each of its rows; */
void routed_experts_fc1(RoutedExperts *job, int64_t task);
/* pack: one task per active expert (its activation rows packed); */
void routed_experts_pack(RoutedExperts *job, int64_t i);
/* fc2: one task per strip of Y's columns (out_strips): every active expert's rows, added into Y in expert order. */
void routed_experts_fc2(RoutedExperts *job, int64_t s);

#endif
