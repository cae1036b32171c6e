/* Y = A @ W for float32 A and Y and a half-precision W (float16 or bfloat16) stored as strips of 64 columns:
 * B[N / 64, K, 64], B[s, k, j] = W[k, 64 s + j]. Plain C over plain arrays; custom_ops.c wires it to onnxruntime. */
#ifndef MLA_DEPLOY_HALF_MATMUL_H
#define MLA_DEPLOY_HALF_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#define STRIP 64 /* output columns per strip: one task */
#define MR 6     /* rows of A per register block */

typedef enum { HALF_F16, HALF_BF16 } HalfKind;

typedef struct {
    HalfKind kind;
    const float *a;    /* A [m, k]; with more than one row, after half_matmul_pack: groups packed [k, MR] each */
    const uint16_t *b; /* [n / 64, k, 64] half-precision bits */
    float *y;          /* [m, n] */
    int64_t m, k, n;
    int64_t group;     /* rows per packed group: at most MR, balanced (8 rows: 4 + 4, not 6 + 2) */
    int failed;        /* set when a strip could not get its scratch memory (Y then incomplete) */
} HalfMatMul;

/* Groups of A's rows: half_matmul_groups(m) of half_matmul_group_rows(m) rows (the last may have fewer). */
int64_t half_matmul_groups(int64_t m);
int64_t half_matmul_group_rows(int64_t m);
/* Floats the packed A takes for `m` rows (0 for one row, which is read in place). */
int64_t half_matmul_packed_size(int64_t m, int64_t k);
/* Group g of `a` [m, k] into `packed` (job->group rows per group); call for every group, then set job->a = packed. */
void half_matmul_pack(const HalfMatMul *job, const float *a, float *packed, int64_t g);
/* Y's 64 columns of strip s, every row. Strips are independent: run them on any threads. */
void half_matmul_strip(HalfMatMul *job, int64_t s);
/* Whether this CPU has what the kernels use (AVX2, FMA, F16C). */
int half_matmul_supported(void);

#endif
