/* MLA's absorbed attention over an int8 latent cache (io_spec.CacheFormat: codes c[s] with one float32 scale sc[s] per
 * entry) and a float rope cache, for T query tokens per cache row (1 in decode, a prefill chunk's tokens in prefill,
 * each with its own bias row: causality), the queries already scaled:
 *   score[h, s] = q_latent[h] . sc[s] c[s] + q_rope[h] . rope[s] + bias[s]
 *   out[h] = sum over slots s of softmax_s(score[h, s]) sc[s] c[s]
 * The products with the latent run in integers, the rest in float32, in this order (every path, plain C included,
 * does the same operations, so forcing MLA_DEPLOY_ISA changes no bit):
 *   - each head's query is quantized once a call: qs[h] = max_k |q_latent[h, k]| / 127, q8[h, k] = round(q / qs[h])
 *     (half to even, clipped to [-127, 127]); dot[h, s] = sum_k q8[h, k] c[s, k] exactly in int32;
 *   - score = ((float)dot · (qs[h] · sc[s]) + r) + bias[s], with r = fma(q_rope[h, k], rope[s, k], r) over k in order;
 *   - per range of Q8_RANGE slots and per head: p = exp(score - max) by one polynomial, sum = the p's summed in slot
 *     order, w = p · sc[s] quantized to p16 = round(w · 32767 / max w) in [0, 32767] (16 bits: a probability of 1e-4
 *     of its range's largest keeps 3 digits, where 8 bits would round it to 0), o[h] = (float)(sum_s p16 c[s]) ·
 *     (max w / 32767) with the integer sum exact;
 *   - the ranges combined as latent_attention.c's are, flash-decoding style.
 * Paths (dispatch.h): AVX-512 VNNI (scores with vpdpbusd, 16 heads a register: the query codes + 128 as the unsigned
 * operand, 4 bytes of a cache row broadcast as the signed one, minus 128 · sum_k c[s, k]; probs @ latent with
 * vpdpwssd, 16 channels x 2 slots a register), AVX2 (both with vpmaddwd over 16-bit values), plain C.
 * A slot whose bias is -FLT_MAX is skipped; a row that sees no slot averages every slot (latent_attention.h). */
#ifndef MLA_DEPLOY_LATENT_ATTENTION_Q8_H
#define MLA_DEPLOY_LATENT_ATTENTION_Q8_H

#include <stdint.h>

#include "dispatch.h"
#include "strip_matmul.h"

/* slots per task: 32767 · 127 · Q8_RANGE < 2^31, so probs @ latent cannot overflow int32. 512 rather than 256: the
 * ranges' partial results, which the combine reads back, halve (the int4 v2lite-2L step at 16k 4-8 % faster), and
 * 16k slots still make 32 tasks a row */
#define Q8_RANGE 512
#define Q8_LANES 16  /* heads are padded to a multiple of this: one AVX-512 register of heads, two AVX2 ones */

typedef struct {
    Isa isa;                                     /* the path */
    StripKind rope_kind;                         /* the rope cache's stored type */
    int64_t rows, queries;                       /* query rows b·T, and T: query row r reads cache row r / T */
    int64_t heads, latent, rope, capacity;       /* h, d_c (a multiple of 16), d_r (a multiple of 8), cap */
    const float *q_latent;                       /* [b·T, h, d_c] */
    const float *q_rope;                         /* [b·T, h, d_r] */
    const int8_t *codes;                         /* [b, cap, d_c] */
    const float *scales;                         /* [b, cap] */
    const void *rope_cache;                      /* [b, cap, d_r] */
    const float *bias;                           /* [b·T, cap] */
    float *out;                                  /* [b·T, h, d_c] */
    /* latent_attention_q8_plan's */
    int64_t lanes, splits;                       /* heads padded to Q8_LANES; slot ranges per row */
    uint8_t *blind;                              /* [b·T]: the query row sees no slot */
    float *partial;                              /* [b·T, splits, h, d_c + 2]: o, max, sum */
    float *q_scale;                              /* [b·T, lanes]: qs (0 for a padding lane) */
    float *q_rope_packed;                        /* [b·T, d_r, lanes] */
    void *q_packed;                              /* [b·T, q_packed_row bytes]: the query codes as the path reads them */
    int64_t q_packed_row;
    int failed;                                  /* a task could not get its scratch memory */
} LatentAttentionQ8;

/* Quantize and pack the queries, allocate the partial results, find the blind rows. 0 on success, -1 out of
 * memory. */
int latent_attention_q8_plan(LatentAttentionQ8 *job);
void latent_attention_q8_release(LatentAttentionQ8 *job);
/* One slot range of one query row: task = range * rows + row (the query rows of one range one after another, while
 * its cache rows are warm). Tasks are independent. */
void latent_attention_q8_range(LatentAttentionQ8 *job, int64_t task);
/* One head's output of one row from its ranges (after every range of the row): task = row · heads + head.
 * Tasks are independent. */
void latent_attention_q8_combine(LatentAttentionQ8 *job, int64_t task);

#endif
