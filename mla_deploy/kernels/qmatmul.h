/* Y = A @ W for float32 A and Y and a block-quantized W read as stored (export/layouts.py): int4, int6 or int8
 * codes, unsigned with zero point z = 2^(bits-1), one float16 scale per block of B values along K per output
 * column, columns in groups of 16, per group and block one contiguous run of 2·B·bits bytes:
 *   codes  [G, KB, 2·B·bits]   G = ceil(N / 16), KB = ceil(K / B)
 *   scales [G, KB, 16]         float16
 * int8 run byte 64 q + 4 c + t: column c of the group at k = 4 q + t of the block; int4 run byte 64 p + 4 c + t:
 * low nibble k = 8 p + t, high nibble k = 8 p + 4 + t. int6 (the head, as llama.cpp's q6_K): the first 8·B bytes an
 * int4 run of the codes' low nibbles, then byte 8 B + 64 h + 4 c + t holds in bits 2 i, 2 i + 1 the high 2 bits of
 * the code at k = 4 (4 h + i) + t.
 *
 * Two numeric modes (onnxruntime MatMulNBits' accuracy_level):
 *   0: float activations; per block and column the sum of a · (code - z) in float32 (k ascending, one fused
 *      multiply-add each), then Y += that sum · scale: exact against the dequantized weight up to float32 rounding;
 *   4: each row of A quantized per block on the fly (qmatmul_quantize_row): scale a_s = max|a| / 127, codes
 *      rint(a · 127 / max|a|) in [-127, 127]; per block and column the exact integer sum of a_code · (code - z),
 *      then Y += float(sum) · (w_scale · a_s).
 * Every instruction-set path (plain C, AVX2, AVX-512 VNNI) does the same float32 operations in the same order, so
 * their results are equal bit for bit; only the integer sums are formed differently.
 * Plain C over plain arrays; custom_ops.c wires it to onnxruntime (QMatMul), qexperts.c multiplies each expert's
 * tokens with it. */
#ifndef MLA_DEPLOY_QMATMUL_H
#define MLA_DEPLOY_QMATMUL_H

#include <stdint.h>

#include "dispatch.h"

#define QCOLS 16      /* output columns per group */
#define QMAX_BLOCK 128

typedef struct {
    int bits, block;         /* 4, 6 or 8; 16, 32, 64 or 128 */
    int64_t k, n;            /* W [k, n] */
    int64_t kb, groups;      /* ceil(k / block), ceil(n / 16) */
    const uint8_t *codes;    /* [groups, kb, 2 * block * bits] */
    const uint16_t *scales;  /* float16 [groups, kb, 16] */
} QWeight;

/* A's rows as the products read them: row r of a product is row index[r] of the arrays (row r without an index) */
typedef struct {
    int level;               /* 0 or 4 */
    int64_t lda;             /* values per row: kb * block, zero past k */
    const int8_t *q;         /* level 4: codes [rows, lda] */
    const float *scale;      /* level 4: a_s [rows, kb] */
    const int32_t *offset;   /* level 4: -z · (the block's sum of codes) [rows, kb]: the zero point's share */
    const float *f;          /* level 0: the rows [rows, lda] */
    const int64_t *index;
} QActs;

/* bytes of one group's run of one block */
static inline int64_t qweight_run_bytes(const QWeight *w) { return 2 * (int64_t)w->block * w->bits; }

/* the unsigned code of column c (of 16) at k = kk of one block's run: the layout above, one value at a time (the
 * plain C product and QGather read it so) */
static inline int qweight_code(const uint8_t *run, int bits, int block, int kk, int c) {
    if (bits == 8) return run[kk / 4 * 64 + 4 * c + kk % 4];
    uint8_t byte = run[kk / 8 * 64 + 4 * c + kk % 4];
    int nibble = kk % 8 < 4 ? byte & 0x0F : byte >> 4;
    if (bits == 4) return nibble;
    int quad = kk / 4; /* int6: its high 2 bits at bits 2 (quad % 4) of the high part's piece quad / 4 */
    return nibble | ((run[8 * block + quad / 4 * 64 + 4 * c + kk % 4] >> (2 * (quad % 4))) & 3) << 4;
}

/* Level 4: row a[0 .. k) quantized into q [kb * block] (zero past k), scale [kb] and offset [kb] (for weights whose
 * zero point is `zero`). */
void qmatmul_quantize_row(Isa isa, const float *a, int64_t k, int block, int zero, int8_t *q, float *scale,
                          int32_t *offset);
/* Level 0: row a[0 .. k) copied into out [padded], zero past k. */
void qmatmul_pad_row(const float *a, int64_t k, int64_t padded, float *out);

/* Y's columns of groups g0 .. g1 - 1 (those below n) for product rows r0 .. r1 - 1: y points at row r0's column
 * 16 g0, rows ldy apart. Independent for disjoint rows or groups: run them on any threads. */
void qmatmul_rows_groups(Isa isa, const QWeight *w, const QActs *a, int64_t r0, int64_t r1, int64_t g0, int64_t g1,
                         float *y, int64_t ldy);

/* float16 bits as float32, exactly (subnormals included) */
float qmatmul_half_to_float(uint16_t h);

#endif
