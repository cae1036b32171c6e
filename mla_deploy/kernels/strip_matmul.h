/* Y = A @ W for float32 A and Y and a weight W (float16, bfloat16 or float32) stored as strips of 64 columns:
 * B[N / 64, K, 64], B[s, k, j] = W[k, 64 s + j]. Plain C over plain arrays; custom_ops.c wires it to onnxruntime
 * (MatMulF16 / MatMulBF16), routed_experts.c multiplies by every expert's strips with it. */
#ifndef MLA_DEPLOY_STRIP_MATMUL_H
#define MLA_DEPLOY_STRIP_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch.h"

#define STRIP 64 /* output columns per strip */
#define MR 6     /* rows of A per register block (a group) */
#define KC 256   /* rows of B per pass when A has several groups: the pass's B (32 KiB of float16) stays in L1/L2
                    while every group reads it */

typedef enum { STRIP_F16, STRIP_BF16, STRIP_F32 } StripKind; /* the weight's stored type */

/* bytes of one stored value */
static inline int64_t strip_kind_bytes(StripKind kind) { return kind == STRIP_F32 ? 4 : 2; }

typedef struct {
    StripKind kind;
    Isa isa;           /* the path that runs (dispatch.h) */
    const float *a;    /* A [m, k]; with more than one row, packed by strip_matmul_pack (below) */
    const void *b;     /* [n / 64, k, 64] in `kind` */
    float *y;          /* [m, n] */
    int64_t m, k, n;
    int64_t group;     /* rows per packed group: at most MR, balanced (8 rows: 4 + 4, not 6 + 2) */
} StripMatMul;

/* Groups of A's rows: strip_matmul_groups(m) of strip_matmul_group_rows(m) rows (the last may have fewer).
 * Packed A: for each pass of KC rows of B (k0 = 0, KC, ...; the last pass kc = k - k0 <= KC), every group's
 * [kc, MR] block (rows past the group's own zero), so that a pass reads its groups as one stream:
 *   packed[k0 * groups * MR + g * kc * MR + (k - k0) * MR + r] = A[g * group + r, k]. */
int64_t strip_matmul_groups(int64_t m);
int64_t strip_matmul_group_rows(int64_t m);
/* Floats the packed A takes for `m` rows (0 for one row, which is read in place). */
int64_t strip_matmul_packed_size(int64_t m, int64_t k);
/* Group g of `a` [m, k] into `packed` (job->group rows per group); call for every group, then set job->a = packed. */
void strip_matmul_pack(const StripMatMul *job, const float *a, float *packed, int64_t g);
/* The same from A's rows wherever they are: rows[r] is A's row g * group + r, for the group's rows. */
void strip_matmul_pack_rows(const StripMatMul *job, const float *const *rows, float *packed, int64_t g);
/* Y's 64 columns of strip s, every row. Strips are independent: run them on any threads. */
void strip_matmul_strip(const StripMatMul *job, int64_t s);
/* The same work cut finer for a thread pool: strips x blocks of groups (few strips and many rows: more than one
 * block per strip, so that both of two threads stay busy to the end). Tasks are independent. */
int64_t strip_matmul_tasks(const StripMatMul *job);
void strip_matmul_task(const StripMatMul *job, int64_t task);

#endif
