/* MLA's absorbed attention over the latent cache, for T query tokens per cache row (1 in decode; the tokens of a
 * verification pass or a draft chunk, each with its own bias row: causality):
 *   score[h, s] = q_latent[h] . latent[s] + q_rope[h] . rope[s] + bias[s]      (the queries already scaled)
 *   out[h] = sum over slots s of softmax_s(score[h, s]) * latent[s]
 * A slot whose bias is -FLT_MAX (not seen: beyond the row's length, or masked) is skipped, so a step reads a row's
 * cache up to its own length, not the buffer's capacity; a row with no slot seen at all averages every slot, as
 * the graph's softmax does (every score + -FLT_MAX rounds to the same float). The caches are read as stored (float32, float16 or bfloat16: StripKind).
 * Slots go in ranges of LATENT_SPLIT per task (any thread), each with its own running maximum and sum; a second
 * step combines a row's ranges. Plain C over plain arrays; custom_ops.c wires it to onnxruntime. */
#ifndef MLA_DEPLOY_LATENT_ATTENTION_H
#define MLA_DEPLOY_LATENT_ATTENTION_H

#include <stdint.h>

#include "strip_matmul.h"

#define LATENT_SPLIT 256 /* slots per task (a range) */

typedef struct {
    StripKind kind;                              /* the caches' stored type */
    Isa isa;                                     /* the path that runs (dispatch.h) */
    int64_t rows, queries;                       /* query rows b·T, and T: query row r reads cache row r / T */
    int64_t heads, latent, rope, capacity;       /* h, d_c (a multiple of 16), d_r (a multiple of 8), cap */
    const float *q_latent;                       /* [b·T, h, d_c] */
    const float *q_rope;                         /* [b·T, h, d_r] */
    const void *latent_cache;                    /* [b, cap, d_c] */
    const void *rope_cache;                      /* [b, cap, d_r] */
    const float *bias;                           /* [b·T, cap] */
    float *out;                                  /* [b·T, h, d_c] */
    int64_t splits;                              /* slot ranges per row */
    uint8_t *blind;                              /* [b·T]: the query row sees no slot (every slot then counts, bias 0) */
    float *partial;                              /* [b·T, splits, h, d_c + 2]: sum p * latent, max, sum p */
    float *q_packed;                             /* [b·T, d_c + d_r, h]: the queries by column (float32 caches, h % 8 == 0;
                                                    grouped: [d_c + d_r, g·h] a group of g query rows) */
    int64_t group;                               /* grouped: query rows a task takes (the plan's) */
    int failed;                                  /* a task could not get its scratch memory */
} LatentAttention;

/* Allocate the partial results and find the blind rows. 0 on success, -1 out of memory. */
int latent_attention_plan(LatentAttention *job);
void latent_attention_release(LatentAttention *job);
/* A chunk's T query rows of a cache row go together (grouped), in groups of up to 128 queries (8 rows of 16 heads):
 * float32 caches at the AVX-512 level, heads a multiple of 16, d_c of 32, whatever the op's name. A group's queries
 * are packed [d_c + d_r, g·h], so each slot's values are read once for the group's queries (a verification pass's or
 * a draft's tokens); a group's softmax runs over the slots any of its tokens sees (another token's: p = 0). Where
 * few slot ranges hold a seen slot (a short cache), the groups are smaller, down to one token, so that a call still
 * makes GROUP_TASKS tasks with slots to read for a many-core pool. */
int latent_attention_grouped(const LatentAttention *job);
/* The range tasks: rows · splits, or groups · splits where grouped (after latent_attention_plan). */
int64_t latent_attention_tasks(const LatentAttention *job);
/* One slot range of one query row: task = range * rows + row (the query rows of one range one after another, while
 * its cache rows are warm: a chunk's T tokens read the same cache row). Grouped: task = range * groups + group, its
 * query rows. Tasks are independent. */
void latent_attention_range(LatentAttention *job, int64_t task);
/* The flash-decoding combine both latent attention kernels share: head task % heads of row task / heads, out[row, h]
 * from the row's `splits` partial results [splits, heads, d_c + 2] (sum p · latent, max, sum p), each rescaled by
 * e^(its max - the largest). */
void latent_ranges_combine(const float *partial, int64_t splits, int64_t heads, int64_t dc, float *out, int64_t task);
/* One head's output of one row from its ranges (after every range of the row): task = row · heads + head.
 * Tasks are independent. */
void latent_attention_combine(LatentAttention *job, int64_t task);

#endif
