/* Y = A @ W for float32 A and Y and a weight W (float16, bfloat16 or float32) stored as strips of 64 columns:
 * B[N / 64, K, 64], B[s, k, j] = W[k, 64 s + j]. Plain C over plain arrays; custom_ops.c wires it to onnxruntime
 * (MatMulF16 / MatMulBF16), routed_experts.c multiplies by every expert's strips with it. */
#ifndef MLA_DEPLOY_STRIP_MATMUL_H
#define MLA_DEPLOY_STRIP_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#define STRIP 64 /* output columns per strip: one task */
#define MR 6     /* rows of A per register block */

typedef enum { STRIP_F16, STRIP_BF16, STRIP_F32 } StripKind; /* the weight's stored type */

/* bytes of one stored value */
static inline int64_t strip_kind_bytes(StripKind kind) { return kind == STRIP_F32 ? 4 : 2; }

typedef struct {
    StripKind kind;
    const float *a;    /* A [m, k]; with more than one row, after strip_matmul_pack: groups packed [k, MR] each */
    const void *b;     /* [n / 64, k, 64] in `kind` */
    float *y;          /* [m, n] */
    int64_t m, k, n;
    int64_t group;     /* rows per packed group: at most MR, balanced (8 rows: 4 + 4, not 6 + 2) */
    int failed;        /* set when a strip could not get its scratch memory (Y then incomplete) */
} StripMatMul;

/* Groups of A's rows: strip_matmul_groups(m) of strip_matmul_group_rows(m) rows (the last may have fewer). */
int64_t strip_matmul_groups(int64_t m);
int64_t strip_matmul_group_rows(int64_t m);
/* Floats the packed A takes for `m` rows (0 for one row, which is read in place). */
int64_t strip_matmul_packed_size(int64_t m, int64_t k);
/* Group g of `a` [m, k] into `packed` (job->group rows per group); call for every group, then set job->a = packed. */
void strip_matmul_pack(const StripMatMul *job, const float *a, float *packed, int64_t g);
/* The same from A's rows wherever they are: rows[r] is A's row g * group + r, for the group's rows. */
void strip_matmul_pack_rows(const StripMatMul *job, const float *const *rows, float *packed, int64_t g);
/* Y's 64 columns of strip s, every row. Strips are independent: run them on any threads. */
void strip_matmul_strip(StripMatMul *job, int64_t s);

#endif
