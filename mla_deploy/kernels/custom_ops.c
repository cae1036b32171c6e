/* onnxruntime's side of mla_deploy's kernels: the custom-op domain "mla_deploy" with
 *   MatMulF16  (A float32 [..., K], B float16 strips [N / 64, K, 64]) -> Y float32 [..., N]
 *   MatMulBF16 (the same with B bfloat16)
 *   RoutedExperts (X float32 [T, d], dispatch float32 [T, E], fc1 float32 [E, I' / 32, d, 64],
 *                  fc2 float32 [E, d' / 64, I', 64]) -> Y float32 [T, d]   (routed_experts.h)
 *   RoutedExpertsF16, RoutedExpertsBF16 (the same with fc1 and fc2 float16 or bfloat16)
 *   LatentAttention (q_latent float32 [b, h, d_c], q_rope float32 [b, h, d_r], latent cache [b, cap, d_c],
 *                    rope cache [b, cap, d_r], bias float32 [b, 1, 1, cap]) -> float32 [b, h, d_c]
 *                    (latent_attention.h; LatentAttentionF16 / BF16 with the caches in half precision;
 *                    LatentAttentionLong* the same kernels under other names, whose function bodies suit long caches;
 *                    LatentAttentionChunk*: T query tokens a row [b, T, h, ·], bias [b, 1, T, cap], the verify and
 *                    draft graphs; LatentAttentionAvx512, LatentAttentionLongAvx512, LatentAttentionChunkAvx512:
 *                    the float32 kernels again, registered only where the kernels run AVX-512 code, so that elsewhere
 *                    onnxruntime runs their function bodies, its own MatMuls, faster there at 16 heads and more)
 *   LatentAttentionQ8 (q_latent, q_rope, latent int8 [b, cap, d_c], latent_scale float32 [b, cap, 1],
 *                      rope float32 [b, cap, d_r], bias) -> float32 [b, h, d_c]   (latent_attention_q8.h;
 *                      Q8F16 / Q8BF16 with the rope cache in half precision; LatentAttentionLongQ8* likewise;
 *                      LatentAttentionChunkQ8*: the queries [b, T, h, ·] of a prefill chunk, bias [b, 1, T, cap])
 *   QMatMul4, QMatMul6, QMatMul8 (A float32 [..., K], codes uint8 [G, KB, 2·B·bits], scales float16 [G, KB, 16];
 *                       attributes K, N, block_size, accuracy_level) -> Y float32 [..., N]   (qmatmul.h: int4 / int6 /
 *                       int8 weights)
 *   QBatchMatMul4, QBatchMatMul8 (A float32 [M, H, K], codes [H, G, KB, 2·B·bits], scales [H, G, KB, 16]; the same
 *                       attributes) -> Y float32 [M, H, N]: row m's head h times weight h (the per-head W^UK, W^UV)
 *   QRoutedExperts4, QRoutedExperts8 (X float32 [T, d], dispatch float32 [T, E], fc1 codes and scales, fc2 codes and
 *                       scales, each [E, ...] of qmatmul.h's layout; attributes block_size, accuracy_level) -> Y [T, d]
 *                       (qexperts.h)
 *   QGather4, QGather6, QGather8 (ids int64 [...], codes, scales; attributes K, N, block_size) -> rows float32 [..., K]
 *                       (qgather.h: columns of W [K, N], a tied head's embedding rows)
 * registered by RegisterCustomOps, which onnxruntime calls on SessionOptions.register_custom_ops_library. The
 * arithmetic is strip_matmul.c's, routed_experts.c's, latent_attention.c's, qmatmul.c's, qexperts.c's and qgather.c's;
 * this file reads shapes, allocates the outputs and splits the work over the session's intra-op threads. Every graph
 * using these ops also carries them as ONNX functions (built from the graph code: export/linear.py, export/moe.py,
 * export/attention.py),
 * which onnxruntime runs where this library is not registered.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "latent_attention.h"
#include "latent_attention_q8.h"
#include "qexperts.h"
#include "qgather.h"
#include "qmatmul.h"
#include "routed_experts.h"
#include "strip_matmul.h"
#include "ort_abi.h"

#define MAX_RANK 8

static const OrtApi *api;

static OrtStatus *error(const char *op, const char *problem) {
    char message[256];
    strcpy(message, op);
    strcat(message, ": ");
    strncat(message, problem, sizeof(message) - strlen(message) - 1);
    return ORT_FN(api, OrtCreateStatusFn, ORT_CreateStatus)(ORT_INVALID_ARGUMENT, message);
}

/* dims and rank of an input; 0 on success */
static int shape(const OrtValue *value, int64_t *dims, size_t *rank) {
    OrtTensorTypeAndShapeInfo *info;
    if (ORT_FN(api, OrtGetTensorTypeAndShapeFn, ORT_GetTensorTypeAndShape)(value, &info)) return -1;
    int bad = ORT_FN(api, OrtGetDimensionsCountFn, ORT_GetDimensionsCount)(info, rank) != NULL || *rank > MAX_RANK ||
              ORT_FN(api, OrtGetDimensionsFn, ORT_GetDimensions)(info, dims, *rank) != NULL;
    ORT_FN(api, OrtReleaseTensorTypeAndShapeInfoFn, ORT_ReleaseTensorTypeAndShapeInfo)(info);
    return bad ? -1 : 0;
}

typedef struct {
    StripMatMul *job;
    const float *a;
    float *packed;
} Packing;

static void run_pack(void *data, size_t g) {
    Packing *p = data;
    strip_matmul_pack(p->job, p->a, p->packed, (int64_t)g);
}

static void run_task(void *data, size_t task) { strip_matmul_task(data, (int64_t)task); }

/* fn(data, 0 .. total - 1) on the session's intra-op threads; on this thread alone without a context */
static OrtStatus *parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t total, void *data) {
    if (total == 1 || !context) {
        for (size_t i = 0; i < total; i++) fn(data, i);
        return NULL;
    }
    return ORT_FN(api, OrtKernelContextParallelForFn, ORT_KernelContext_ParallelFor)(context, fn, total, 0, data);
}

static OrtStatus *compute(OrtKernelContext *context, StripKind kind, const char *op, Isa isa) {
    const OrtValue *a_value, *b_value;
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 0, &a_value);
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 1, &b_value);
    int64_t a_dims[MAX_RANK], b_dims[MAX_RANK], y_dims[MAX_RANK];
    size_t a_rank, b_rank;
    if (shape(a_value, a_dims, &a_rank) || a_rank < 1) return error(op, "A must have rank 1 to 8");
    if (shape(b_value, b_dims, &b_rank) || b_rank != 3 || b_dims[2] != STRIP)
        return error(op, "B must be strips [N / 64, K, 64]");
    if (a_dims[a_rank - 1] != b_dims[1]) return error(op, "A's last dimension must equal B's K");
    StripMatMul job = {.kind = kind, .isa = isa, .k = b_dims[1], .n = b_dims[0] * STRIP, .m = 1};
    for (size_t i = 0; i + 1 < a_rank; i++) job.m *= a_dims[i];
    memcpy(y_dims, a_dims, sizeof(int64_t) * a_rank);
    y_dims[a_rank - 1] = job.n;
    OrtValue *y_value;
    void *a, *b, *y;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, y_dims, a_rank, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)((OrtValue *)a_value, &a) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)((OrtValue *)b_value, &b) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(op, "cannot reach the tensors' data");
    if (job.m == 0 || job.n == 0) return NULL;
    if (job.k == 0) { /* an empty sum */
        memset(y, 0, sizeof(float) * job.m * job.n);
        return NULL;
    }
    job.group = strip_matmul_group_rows(job.m), job.b = b, job.y = y, job.a = a;
    float *packed = NULL;
    OrtStatus *status = NULL;
    if (job.m > 1) {
        if (!(packed = malloc(sizeof(float) * strip_matmul_packed_size(job.m, job.k))))
            return error(op, "out of memory packing A");
        Packing packing = {&job, a, packed};
        status = parallel_for(context, run_pack, (size_t)strip_matmul_groups(job.m), &packing);
        job.a = packed;
    }
    if (!status) status = parallel_for(context, run_task, (size_t)strip_matmul_tasks(&job), &job);
    free(packed);
    return status;
}

/* an op's n inputs: their shapes and data; a status naming `op` where one cannot be read */
static OrtStatus *inputs(OrtKernelContext *context, const char *op, size_t n, int64_t dims[][MAX_RANK], size_t *rank,
                         void **data) {
    for (size_t i = 0; i < n; i++) {
        const OrtValue *value;
        ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, i, &value);
        if (shape(value, dims[i], &rank[i])) return error(op, "cannot read an input's shape");
        if (ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)((OrtValue *)value, &data[i]))
            return error(op, "cannot reach the inputs' data");
    }
    return NULL;
}

/* below ~1M multiply-adds (one token through two of the demo's experts: ~15 us), waking a pool thread costs more than
 * it saves (measured: 51 vs 34 us at one token on two threads): the work then runs on this thread alone */
static OrtKernelContext *pool_for(OrtKernelContext *context, int64_t multiply_adds) {
    return multiply_adds < (1 << 20) ? NULL : context;
}

typedef struct {
    RoutedExperts *job;
    void (*step)(RoutedExperts *, int64_t);
} ExpertStep;

static void run_expert_step(void *data, size_t task) {
    ExpertStep *s = data;
    s->step(s->job, (int64_t)task);
}

static OrtStatus *compute_routed_experts(OrtKernelContext *context, StripKind kind, const char *op, Isa isa) {
    int64_t dims[4][MAX_RANK];
    size_t rank[4];
    void *data[4], *y;
    OrtStatus *status = inputs(context, op, 4, dims, rank, data);
    if (status) return status;
    if (rank[0] != 2 || rank[1] != 2 || rank[2] != 4 || rank[3] != 4)
        return error(op, "expected X [T, d], dispatch [T, E], fc1 [E, I'/32, d, 64], fc2 [E, d'/64, I', 64]");
    RoutedExperts job = {.kind = kind, .isa = isa, .tokens = dims[0][0], .d = dims[0][1], .experts = dims[1][1],
                         .inter = dims[2][1] * GATE_UP, .out_strips = dims[3][1]};
    if (dims[1][0] != job.tokens || dims[2][0] != job.experts || dims[3][0] != job.experts)
        return error(op, "X, dispatch, fc1 and fc2 disagree on the tokens or the experts");
    if (dims[2][2] != job.d || dims[2][3] != STRIP || dims[3][2] != job.inter || dims[3][3] != STRIP ||
        job.out_strips * STRIP < job.d || job.out_strips * STRIP - job.d >= STRIP)
        return error(op, "fc1 must be [E, I'/32, d, 64] and fc2 [E, d'/64, I', 64] (d' = d rounded up to 64)");
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], 2, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(op, "cannot allocate Y");
    job.x = data[0], job.dispatch = data[1], job.fc1 = data[2], job.fc2 = data[3], job.y = y;
    if (job.tokens == 0 || job.d == 0) return NULL;
    if (routed_experts_plan(&job)) return error(op, "out of memory planning the experts' rows");
    if (job.active) { /* per active expert: gather (its rows packed), fc1 by strips, pack (its activations), fc2 */
        ExpertStep steps[] = {{&job, routed_experts_gather}, {&job, routed_experts_fc1}, {&job, routed_experts_pack},
                              {&job, routed_experts_fc2}};
        size_t tasks[] = {(size_t)job.active, (size_t)(job.active * job.inter / GATE_UP), (size_t)job.active,
                          (size_t)job.out_strips};
        OrtKernelContext *pool = pool_for(context, job.first[job.active] * 3 * job.inter * job.d);
        for (int i = 0; !status && i < 4; i++) status = parallel_for(pool, run_expert_step, tasks[i], &steps[i]);
    }
    routed_experts_release(&job);
    return status;
}

static void run_latent_range(void *data, size_t task) { latent_attention_range(data, (int64_t)task); }
static void run_latent_combine(void *data, size_t task) { latent_attention_combine(data, (int64_t)task); }

static OrtStatus *compute_latent_attention(OrtKernelContext *context, StripKind kind, const char *op, Isa isa) {
    int64_t dims[5][MAX_RANK];
    size_t rank[5];
    void *data[5], *y;
    OrtStatus *status = inputs(context, op, 5, dims, rank, data);
    if (status) return status;
    size_t q = rank[0]; /* 3: one query a row [b, h, ·]; 4: T tokens a row [b, T, h, ·] */
    if ((q != 3 && q != 4) || rank[1] != q || rank[2] != 3 || rank[3] != 3 || rank[4] < 1)
        return error(op, "expected q_latent [b, h, d_c] or [b, T, h, d_c], q_rope likewise, latent [b, cap, d_c], "
                         "rope [b, cap, d_r], bias [b, 1, T, cap]");
    int64_t b = dims[0][0], t = q == 4 ? dims[0][1] : 1;
    LatentAttention job = {.kind = kind, .isa = isa, .rows = b * t, .queries = t, .heads = dims[0][q - 2],
                           .latent = dims[0][q - 1], .rope = dims[1][q - 1], .capacity = dims[2][1]};
    int64_t bias_size = 1;
    for (size_t i = 0; i < rank[4]; i++) bias_size *= dims[4][i];
    if (dims[1][0] != b || (q == 4 && dims[1][1] != t) || dims[1][q - 2] != job.heads || dims[2][0] != b ||
        dims[2][2] != job.latent || dims[3][0] != b || dims[3][1] != job.capacity || dims[3][2] != job.rope)
        return error(op, "the queries and the caches disagree on the rows, the heads or the widths");
    if (dims[4][rank[4] - 1] != job.capacity || bias_size != job.rows * job.capacity)
        return error(op, "bias must hold one value per query and cache slot [b, 1, T, cap]");
    if (job.latent % 16 || job.rope % 8) return error(op, "d_c must be a multiple of 16 and d_r of 8");
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], q, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(op, "cannot allocate the output");
    job.q_latent = data[0], job.q_rope = data[1], job.latent_cache = data[2], job.rope_cache = data[3];
    job.bias = data[4], job.out = y;
    if (job.rows == 0 || job.heads == 0 || job.latent == 0) return NULL;
    if (job.capacity == 0) return error(op, "the cache has no slots");
    if (latent_attention_plan(&job)) return error(op, "out of memory for the partial results");
    status = parallel_for(pool_for(context, job.rows * job.capacity * job.heads * (job.latent + job.rope)),
                          run_latent_range, (size_t)latent_attention_tasks(&job), &job);
    if (!status) /* the ranges' partial results summed per head: splits x d_c multiply-adds a task */
        status = parallel_for(pool_for(context, job.rows * job.heads * job.splits * job.latent), run_latent_combine,
                              (size_t)(job.rows * job.heads), &job);
    if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a range's scores");
    latent_attention_release(&job);
    return status;
}

static void run_latent_range_q8(void *data, size_t task) { latent_attention_q8_range(data, (int64_t)task); }
static void run_latent_combine_q8(void *data, size_t task) { latent_attention_q8_combine(data, (int64_t)task); }

/* A kernel holds nothing but the instruction-set level read when onnxruntime created it (create; dispatch.h), as its
 * pointer's value: level + 1, so that it is never NULL. */
static Isa isa_of(void *kernel) { return (Isa)((intptr_t)kernel - 1); }

static OrtStatus *compute_latent_attention_q8(void *kernel, OrtKernelContext *context, StripKind rope_kind,
                                              const char *op) {
    int64_t dims[6][MAX_RANK];
    size_t rank[6];
    void *data[6], *y;
    OrtStatus *status = inputs(context, op, 6, dims, rank, data);
    if (status) return status;
    size_t q = rank[0]; /* 3: one query a row [b, h, ·]; 4: a chunk's [b, T, h, ·] */
    if ((q != 3 && q != 4) || rank[1] != q || rank[2] != 3 || rank[3] != 3 || rank[4] != 3 || rank[5] < 1)
        return error(op, "expected q_latent [b, h, d_c] or [b, T, h, d_c], q_rope likewise, latent [b, cap, d_c], "
                         "latent_scale [b, cap, 1], rope [b, cap, d_r], bias [b, 1, T, cap]");
    int64_t b = dims[0][0], t = q == 4 ? dims[0][1] : 1;
    LatentAttentionQ8 job = {.isa = isa_of(kernel), .rope_kind = rope_kind, .rows = b * t, .queries = t,
                             .heads = dims[0][q - 2], .latent = dims[0][q - 1], .rope = dims[1][q - 1],
                             .capacity = dims[2][1]};
    int64_t bias_size = 1;
    for (size_t i = 0; i < rank[5]; i++) bias_size *= dims[5][i];
    if (dims[1][0] != b || (q == 4 && dims[1][1] != t) || dims[1][q - 2] != job.heads || dims[2][0] != b ||
        dims[2][2] != job.latent || dims[4][0] != b || dims[4][1] != job.capacity || dims[4][2] != job.rope)
        return error(op, "the queries and the caches disagree on the rows, the heads or the widths");
    if (dims[3][0] != b || dims[3][1] != job.capacity || dims[3][2] != 1)
        return error(op, "latent_scale must hold one scale per row and cache slot [b, cap, 1]");
    if (dims[5][rank[5] - 1] != job.capacity || bias_size != job.rows * job.capacity)
        return error(op, "bias must hold one value per query and cache slot [b, 1, T, cap]");
    if (job.latent % 16 || job.rope % 8) return error(op, "d_c must be a multiple of 16 and d_r of 8");
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], q, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(op, "cannot allocate the output");
    job.q_latent = data[0], job.q_rope = data[1], job.codes = data[2], job.scales = data[3], job.rope_cache = data[4];
    job.bias = data[5], job.out = y;
    if (job.rows == 0 || job.heads == 0 || job.latent == 0) return NULL;
    if (job.capacity == 0) return error(op, "the cache has no slots");
    if (latent_attention_q8_plan(&job)) return error(op, "out of memory for the packed queries and partial results");
    /* about a quarter of the float kernel's instructions a slot (int8 products): the same threshold in slots */
    status = parallel_for(pool_for(context, job.rows * job.capacity * job.heads * (job.latent + job.rope) / 4),
                          run_latent_range_q8, (size_t)(job.rows * job.splits), &job);
    if (!status) /* the ranges' partial results summed per head: splits x d_c multiply-adds a task */
        status = parallel_for(pool_for(context, job.rows * job.heads * job.splits * job.latent), run_latent_combine_q8,
                              (size_t)(job.rows * job.heads), &job);
    if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a range's scores");
    latent_attention_q8_release(&job);
    return status;
}

#define Q8_FUNCTIONS(ID, KIND, NAME)                                                                                   \
    static OrtStatus *compute_##ID(void *kernel, OrtKernelContext *context) {                                        \
        return compute_latent_attention_q8(kernel, context, KIND, NAME);                                              \
    }                                                                                                                 \
    static const char *name_##ID(const OrtCustomOp *op) {                                                            \
        (void)op;                                                                                                     \
        return NAME;                                                                                                  \
    }
Q8_FUNCTIONS(q8_f32, STRIP_F32, "LatentAttentionQ8")
Q8_FUNCTIONS(q8_f16, STRIP_F16, "LatentAttentionQ8F16")
Q8_FUNCTIONS(q8_bf16, STRIP_BF16, "LatentAttentionQ8BF16")
Q8_FUNCTIONS(long_q8_f32, STRIP_F32, "LatentAttentionLongQ8")
Q8_FUNCTIONS(long_q8_f16, STRIP_F16, "LatentAttentionLongQ8F16")
Q8_FUNCTIONS(long_q8_bf16, STRIP_BF16, "LatentAttentionLongQ8BF16")
Q8_FUNCTIONS(chunk_q8_f32, STRIP_F32, "LatentAttentionChunkQ8")
Q8_FUNCTIONS(chunk_q8_f16, STRIP_F16, "LatentAttentionChunkQ8F16")
Q8_FUNCTIONS(chunk_q8_bf16, STRIP_BF16, "LatentAttentionChunkQ8BF16")

/* ---------- the quantized ops: QMatMul4/6/8, QRoutedExperts4/8, QGather4/6/8 (qmatmul.h's layout) ---------- */

/* a quantized op's node: its attributes and the instruction-set level, both read when onnxruntime creates it */
typedef struct {
    const char *op;
    int64_t k, n, bits, block, level;
    Isa isa;
} QKernel;

static OrtStatus *attribute(const OrtKernelInfo *info, const char *op, const char *name, int64_t *value, int required) {
    OrtStatus *status =
        ORT_FN(api, OrtKernelInfoGetAttributeInt64Fn, ORT_KernelInfoGetAttribute_int64)(info, name, value);
    if (!status) return NULL;
    ORT_FN(api, OrtReleaseStatusFn, ORT_ReleaseStatus)(status);
    if (!required) return NULL;
    char problem[96];
    snprintf(problem, sizeof(problem), "the integer attribute %s is missing", name);
    return error(op, problem);
}

/* the op's name ends in its weights' bits (QMatMul4, QRoutedExperts8, ...): their function bodies unpack differently */
static OrtStatus *create_quantized(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)a;
    QKernel q = {.op = op->GetName(op), .level = 0, .isa = mla_isa()};
    q.bits = q.op[strlen(q.op) - 1] - '0';
    int experts = !strncmp(q.op, "QRoutedExperts", 14), gather = !strncmp(q.op, "QGather", 7);
    OrtStatus *status = NULL;
    if (!status && !experts) status = attribute(info, q.op, "K", &q.k, 1);
    if (!status && !experts) status = attribute(info, q.op, "N", &q.n, 1);
    if (!status) status = attribute(info, q.op, "block_size", &q.block, 1);
    if (!status && !gather) status = attribute(info, q.op, "accuracy_level", &q.level, 0);
    if (status) return status;
    if (q.block != 16 && q.block != 32 && q.block != 64 && q.block != 128)
        return error(q.op, "block_size must be 16, 32, 64 or 128");
    if (q.level != 0 && q.level != 4) return error(q.op, "accuracy_level must be 0 (float activations) or 4 (int8)");
    if (!experts && (q.k < 1 || q.n < 1)) return error(q.op, "K and N must be positive");
    QKernel *node = malloc(sizeof(QKernel));
    if (!node) return error(q.op, "out of memory");
    *node = q;
    *kernel = node;
    return NULL;
}

static void destroy_quantized(void *kernel) { free(kernel); }

/* the weight [k, n] of `node` whose codes and scales have dims c and s (rank 3 each); NULL or a status naming what
 * disagrees */
static OrtStatus *quantized_weight(const QKernel *node, const char *what, int64_t k, int64_t n, const int64_t *c,
                                   const int64_t *s, const void *codes, const void *scales, QWeight *w) {
    *w = (QWeight){.bits = (int)node->bits, .block = (int)node->block, .k = k, .n = n, .codes = codes, .scales = scales,
                   .kb = (k + node->block - 1) / node->block, .groups = (n + QCOLS - 1) / QCOLS};
    if (c[0] != w->groups || c[1] != w->kb || c[2] != qweight_run_bytes(w) || s[0] != w->groups || s[1] != w->kb ||
        s[2] != QCOLS) {
        char problem[200];
        snprintf(problem, sizeof(problem), "%s must be codes [%lld, %lld, %lld] and scales [%lld, %lld, 16] for a "
                 "%lld-bit [%lld, %lld] weight in blocks of %lld", what, (long long)w->groups, (long long)w->kb,
                 (long long)qweight_run_bytes(w), (long long)w->groups, (long long)w->kb, (long long)node->bits,
                 (long long)k, (long long)n, (long long)node->block);
        return error(node->op, problem);
    }
    return NULL;
}

typedef struct {
    const QKernel *node;
    const QWeight *w;
    const float *a;
    QActs acts;
    int8_t *q;        /* level 4: where the quantized rows go (acts' codes, scales and offsets) */
    float *scale;
    int32_t *offset;
    float *padded;    /* level 0: the rows zero-padded to whole blocks */
    int64_t m, row_chunk, rows_chunks, group_chunk, column_chunks;
    int64_t heads, head_rows;        /* QBatchMatMul: H weights, each multiplying head_rows = M rows; QMatMul: 1, m */
    int64_t head_codes, head_scales; /* one head's codes (bytes) and scales (values) */
    int64_t *head_index;             /* QBatchMatMul: [H, M], the rows of A ([M, H] of them) head h multiplies */
    float *y;
} QProduct;

static void run_quantize(void *data, size_t task) {
    QProduct *p = data;
    int64_t end = ((int64_t)task + 1) * p->row_chunk < p->m ? ((int64_t)task + 1) * p->row_chunk : p->m;
    for (int64_t r = (int64_t)task * p->row_chunk; r < end; r++) {
        if (p->acts.level == 4)
            qmatmul_quantize_row(p->node->isa, p->a + r * p->w->k, p->w->k, p->w->block, 1 << (p->w->bits - 1),
                                 p->q + r * p->acts.lda, p->scale + r * p->w->kb, p->offset + r * p->w->kb);
        else
            qmatmul_pad_row(p->a + r * p->w->k, p->w->k, p->acts.lda, p->padded + r * p->acts.lda);
    }
}

/* task = (head · column chunks + column chunk) · row chunks + row chunk. QBatchMatMul: head h's product row m is row
 * m H + h of A and Y ([M, H, ·]), through the head's row index */
static void run_product(void *data, size_t task) {
    QProduct *p = data;
    int64_t rc = (int64_t)task % p->rows_chunks, gc = (int64_t)task / p->rows_chunks % p->column_chunks;
    int64_t head = (int64_t)task / p->rows_chunks / p->column_chunks;
    int64_t r0 = rc * p->row_chunk, r1 = r0 + p->row_chunk < p->head_rows ? r0 + p->row_chunk : p->head_rows;
    int64_t g0 = gc * p->group_chunk, g1 = g0 + p->group_chunk < p->w->groups ? g0 + p->group_chunk : p->w->groups;
    QWeight w = *p->w;
    QActs acts = p->acts;
    w.codes += head * p->head_codes, w.scales += head * p->head_scales;
    if (p->head_index) acts.index = p->head_index + head * p->head_rows;
    qmatmul_rows_groups(p->node->isa, &w, &acts, r0, r1, g0, g1, p->y + (r0 * p->heads + head) * w.n + g0 * QCOLS,
                        p->heads * w.n);
}

#define PRODUCT_ROWS 64 /* rows per task: their codes (64 x K bytes) stay in L2 while a task's column tiles pass */

/* QMatMul (batched = 0): A [..., K] @ W; QBatchMatMul (batched = 1): A [M, H, K], row m's head h @ W_h, the weights'
 * codes and scales stacked [H, ...]. Rows are quantized (or padded) all at once, then multiplied per head. */
static OrtStatus *compute_qmatmul_any(const QKernel *node, OrtKernelContext *context, int batched) {
    int64_t dims[3][MAX_RANK], y_dims[MAX_RANK];
    size_t rank[3];
    void *data[3], *y;
    OrtStatus *status = inputs(context, node->op, 3, dims, rank, data);
    if (status) return status;
    if (!batched && (rank[0] < 1 || rank[1] != 3 || rank[2] != 3))
        return error(node->op, "expected A [..., K], codes [G, KB, bytes], scales [G, KB, 16]");
    if (batched && (rank[0] != 3 || rank[1] != 4 || rank[2] != 4))
        return error(node->op, "expected A [M, H, K], codes [H, G, KB, bytes], scales [H, G, KB, 16]");
    if (batched && (dims[1][0] != dims[0][1] || dims[2][0] != dims[0][1]))
        return error(node->op, "A's heads (its second dimension) must equal the first dimension of codes and scales");
    if (dims[0][rank[0] - 1] != node->k) return error(node->op, "A's last dimension must equal the attribute K");
    QWeight w;
    if ((status = quantized_weight(node, "B", node->k, node->n, dims[1] + batched, dims[2] + batched, data[1], data[2],
                                   &w)))
        return status;
    QProduct p = {.node = node, .w = &w, .a = data[0], .m = 1, .heads = batched ? dims[0][1] : 1,
                  .head_codes = w.groups * w.kb * qweight_run_bytes(&w), .head_scales = w.groups * w.kb * QCOLS,
                  .acts = {.level = (int)node->level, .lda = w.kb * w.block}};
    for (size_t i = 0; i + 1 < rank[0]; i++) p.m *= dims[0][i];
    memcpy(y_dims, dims[0], sizeof(int64_t) * rank[0]);
    y_dims[rank[0] - 1] = node->n;
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, y_dims, rank[0], &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(node->op, "cannot allocate Y");
    if (p.m == 0) return NULL;
    p.y = y, p.head_rows = p.m / p.heads;
    /* level 4: A's rows quantized (codes, scales, offsets); level 0: copied zero-padded where K is not whole blocks */
    int64_t lda = p.acts.lda, copies = node->level == 4 ? p.m * lda + 8 * p.m * w.kb
                                      : node->k % node->block ? 4 * p.m * lda : 0;
    char *scratch = NULL;
    if (copies && !(scratch = malloc((size_t)copies))) return error(node->op, "out of memory for A's rows");
    if (batched && !(p.head_index = malloc(sizeof(int64_t) * (size_t)p.m))) {
        free(scratch);
        return error(node->op, "out of memory for the heads' row index");
    }
    for (int64_t h = 0; batched && h < p.heads; h++)
        for (int64_t r = 0; r < p.head_rows; r++) p.head_index[h * p.head_rows + r] = r * p.heads + h;
    if (node->level == 4) {
        p.acts.scale = p.scale = (float *)scratch, p.acts.offset = p.offset = (int32_t *)(scratch + 4 * p.m * w.kb);
        p.acts.q = p.q = (int8_t *)(scratch + 8 * p.m * w.kb);
    } else {
        p.acts.f = p.padded = scratch ? (float *)scratch : NULL;
        if (!scratch) p.acts.f = p.a;
        p.acts.lda = scratch ? lda : node->k;
    }
    OrtKernelContext *pool = pool_for(context, p.m * node->k * node->n);
    p.row_chunk = 32;
    if (scratch) status = parallel_for(pool, run_quantize, (size_t)((p.m + p.row_chunk - 1) / p.row_chunk), &p);
    /* tasks: heads x row chunks x column chunks (multiples of 4 groups: whole tiles of every shape), about 16 in all */
    p.row_chunk = PRODUCT_ROWS;
    p.rows_chunks = (p.head_rows + PRODUCT_ROWS - 1) / PRODUCT_ROWS;
    int64_t row_tasks = p.heads * p.rows_chunks;
    p.column_chunks = row_tasks >= 8 ? 2 : 16 / row_tasks;
    p.group_chunk = ((w.groups + p.column_chunks - 1) / p.column_chunks + 3) / 4 * 4;
    p.column_chunks = (w.groups + p.group_chunk - 1) / p.group_chunk;
    if (!status) status = parallel_for(pool, run_product, (size_t)(p.heads * p.rows_chunks * p.column_chunks), &p);
    free(p.head_index);
    free(scratch);
    return status;
}

static OrtStatus *compute_qmatmul(void *kernel, OrtKernelContext *context) {
    return compute_qmatmul_any(kernel, context, 0);
}

static OrtStatus *compute_qbatchmatmul(void *kernel, OrtKernelContext *context) {
    return compute_qmatmul_any(kernel, context, 1);
}

typedef struct {
    QExperts *job;
    void (*step)(QExperts *, int64_t);
} QExpertStep;

static void run_qexpert_step(void *data, size_t task) {
    QExpertStep *s = data;
    s->step(s->job, (int64_t)task);
}

static OrtStatus *compute_qexperts(void *kernel, OrtKernelContext *context) {
    const QKernel *node = kernel;
    int64_t dims[6][MAX_RANK];
    size_t rank[6];
    void *data[6], *y;
    OrtStatus *status = inputs(context, node->op, 6, dims, rank, data);
    if (status) return status;
    if (rank[0] != 2 || rank[1] != 2 || rank[2] != 4 || rank[3] != 4 || rank[4] != 4 || rank[5] != 4)
        return error(node->op, "expected X [T, d], dispatch [T, E], fc1 codes and scales [E, 2 I'/16, KB, ...], "
                               "fc2 codes and scales [E, d'/16, KB, ...]");
    QExperts job = {.isa = node->isa, .level = (int)node->level, .bits = (int)node->bits, .block = (int)node->block,
                    .tokens = dims[0][0], .d = dims[0][1], .experts = dims[1][1], .groups1 = dims[2][1],
                    .groups2 = dims[4][1], .kb2 = dims[4][2]};
    if (dims[1][0] != job.tokens || dims[2][0] != job.experts || dims[3][0] != job.experts ||
        dims[4][0] != job.experts || dims[5][0] != job.experts)
        return error(node->op, "X, dispatch and the expert weights disagree on the tokens or the experts");
    if (job.groups1 % 2) return error(node->op, "fc1 must hold pairs of gate and up groups (2 I' / 16 even)");
    job.inter = job.groups1 / 2 * QCOLS;
    QWeight fc1, fc2;
    status = quantized_weight(node, "fc1", job.d, 2 * job.inter, dims[2] + 1, dims[3] + 1, data[2], data[3], &fc1);
    if (!status)
        status = quantized_weight(node, "fc2", job.kb2 * job.block, job.d, dims[4] + 1, dims[5] + 1, data[4], data[5], &fc2);
    if (status) return status;
    if (job.kb2 * job.block < job.inter || (job.kb2 - 1) * job.block >= job.inter)
        return error(node->op, "fc2's K blocks must cover fc1's I' activations (ceil(I / block) blocks)");
    job.kb1 = fc1.kb;
    job.x = data[0], job.dispatch = data[1], job.fc1_codes = data[2], job.fc1_scales = data[3];
    job.fc2_codes = data[4], job.fc2_scales = data[5];
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], 2, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(node->op, "cannot allocate Y");
    job.y = y;
    if (job.tokens == 0 || job.d == 0) return NULL;
    if (qexperts_plan(&job)) return error(node->op, "out of memory planning the experts' rows");
    if (job.active) {
        OrtKernelContext *pool = pool_for(context, job.first[job.active] * 3 * job.inter * job.d);
        QExpertStep steps[] = {{&job, qexperts_x}, {&job, qexperts_fc1}, {&job, qexperts_acts}, {&job, qexperts_fc2}};
        int64_t tasks[] = {qexperts_x_tasks(&job), qexperts_fc1_tasks(&job), 0, 0};
        for (int i = 0; !status && i < 4; i++) {
            if (i == 2) tasks[2] = qexperts_acts_tasks(&job), tasks[3] = qexperts_fc2_tasks(&job);
            if (tasks[i]) status = parallel_for(pool, run_qexpert_step, (size_t)tasks[i], &steps[i]);
        }
    }
    qexperts_release(&job);
    return status;
}

typedef struct {
    const QWeight *w;
    const int64_t *ids;
    float *out;
} QGatherJob;

static void run_gather(void *data, size_t i) {
    QGatherJob *g = data;
    int64_t id = g->ids[i];
    qgather_column(g->w, id < 0 ? id + g->w->n : id, g->out + (int64_t)i * g->w->k);
}

static OrtStatus *compute_qgather(void *kernel, OrtKernelContext *context) {
    const QKernel *node = kernel;
    int64_t dims[3][MAX_RANK], y_dims[MAX_RANK];
    size_t rank[3];
    void *data[3], *y;
    OrtStatus *status = inputs(context, node->op, 3, dims, rank, data);
    if (status) return status;
    if (rank[0] + 1 > MAX_RANK || rank[1] != 3 || rank[2] != 3)
        return error(node->op, "expected ids [...], codes [G, KB, bytes], scales [G, KB, 16]");
    QWeight w;
    status = quantized_weight(node, "the table", node->k, node->n, dims[1], dims[2], data[1], data[2], &w);
    if (status) return status;
    int64_t count = 1;
    for (size_t i = 0; i < rank[0]; i++) count *= dims[0][i], y_dims[i] = dims[0][i];
    const int64_t *ids = data[0];
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < -node->n || ids[i] >= node->n) {
            char problem[128];
            snprintf(problem, sizeof(problem), "id %lld is outside [-%lld, %lld)", (long long)ids[i], (long long)node->n,
                     (long long)node->n);
            return error(node->op, problem);
        }
    y_dims[rank[0]] = node->k;
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, y_dims, rank[0] + 1,
                                                                               &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(node->op, "cannot allocate the rows");
    QGatherJob job = {&w, ids, y};
    return count ? parallel_for(pool_for(context, count * node->k * 16), run_gather, (size_t)count, &job) : NULL;
}

/* each registered op: its name, and its compute as one of the three above with the weights' (caches') type */
#define OP_FUNCTIONS(ID, COMPUTE, KIND, NAME)                                                                         \
    static OrtStatus *compute_##ID(void *kernel, OrtKernelContext *context) {                                        \
        return COMPUTE(context, KIND, NAME, isa_of(kernel));                                                          \
    }                                                                                                                 \
    static const char *name_##ID(const OrtCustomOp *op) {                                                            \
        (void)op;                                                                                                     \
        return NAME;                                                                                                  \
    }
OP_FUNCTIONS(f16, compute, STRIP_F16, "MatMulF16")
OP_FUNCTIONS(bf16, compute, STRIP_BF16, "MatMulBF16")
OP_FUNCTIONS(experts_f32, compute_routed_experts, STRIP_F32, "RoutedExperts")
OP_FUNCTIONS(experts_f16, compute_routed_experts, STRIP_F16, "RoutedExpertsF16")
OP_FUNCTIONS(experts_bf16, compute_routed_experts, STRIP_BF16, "RoutedExpertsBF16")
OP_FUNCTIONS(attention_f32, compute_latent_attention, STRIP_F32, "LatentAttention")
OP_FUNCTIONS(attention_f16, compute_latent_attention, STRIP_F16, "LatentAttentionF16")
OP_FUNCTIONS(attention_bf16, compute_latent_attention, STRIP_BF16, "LatentAttentionBF16")
OP_FUNCTIONS(long_f32, compute_latent_attention, STRIP_F32, "LatentAttentionLong")
OP_FUNCTIONS(long_f16, compute_latent_attention, STRIP_F16, "LatentAttentionLongF16")
OP_FUNCTIONS(long_bf16, compute_latent_attention, STRIP_BF16, "LatentAttentionLongBF16")
OP_FUNCTIONS(chunk_f32, compute_latent_attention, STRIP_F32, "LatentAttentionChunk")
OP_FUNCTIONS(chunk_f16, compute_latent_attention, STRIP_F16, "LatentAttentionChunkF16")
OP_FUNCTIONS(chunk_bf16, compute_latent_attention, STRIP_BF16, "LatentAttentionChunkBF16")
OP_FUNCTIONS(avx512_f32, compute_latent_attention, STRIP_F32, "LatentAttentionAvx512")
OP_FUNCTIONS(avx512_long_f32, compute_latent_attention, STRIP_F32, "LatentAttentionLongAvx512")
OP_FUNCTIONS(avx512_chunk_f32, compute_latent_attention, STRIP_F32, "LatentAttentionChunkAvx512")

static ONNXTensorElementDataType input_f16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType input_bf16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType input_float(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
/* LatentAttention's queries and bias are float32, its caches (inputs 2 and 3) in the caches' type */
static ONNXTensorElementDataType attention_f16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 2 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType attention_bf16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 2 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
/* RoutedExperts' X and dispatch are float32, its fc1 and fc2 (inputs 2 and 3) in the weights' type */
static ONNXTensorElementDataType experts_f16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i >= 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType experts_bf16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i >= 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
/* LatentAttentionQ8's latent (input 2) is int8, its rope cache (input 4) in the rope's type, the rest float32 */
static ONNXTensorElementDataType q8_input(size_t i, ONNXTensorElementDataType rope) {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : i == 4 ? rope : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType q8_f32(const OrtCustomOp *op, size_t i) { (void)op; return q8_input(i, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT); }
static ONNXTensorElementDataType q8_f16(const OrtCustomOp *op, size_t i) { (void)op; return q8_input(i, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16); }
static ONNXTensorElementDataType q8_bf16(const OrtCustomOp *op, size_t i) { (void)op; return q8_input(i, ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16); }
/* QMatMul* (A, codes, scales), QGather* (ids, codes, scales), QRoutedExperts* (X, dispatch, fc1 codes, fc1 scales, fc2
 * codes, fc2 scales) */
static ONNXTensorElementDataType quantized_type(int i) {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}
static ONNXTensorElementDataType qmatmul_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : quantized_type((int)i - 1);
}
static ONNXTensorElementDataType qgather_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : quantized_type((int)i - 1);
}
static ONNXTensorElementDataType qexperts_input(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i < 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : quantized_type((int)(i - 2) % 2);
}
static ONNXTensorElementDataType output_float(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t four(const OrtCustomOp *op) { (void)op; return 4; }
static size_t five(const OrtCustomOp *op) { (void)op; return 5; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static size_t six(const OrtCustomOp *op) { (void)op; return 6; }
static const char *name_qmatmul4(const OrtCustomOp *op) { (void)op; return "QMatMul4"; }
static const char *name_qmatmul6(const OrtCustomOp *op) { (void)op; return "QMatMul6"; }
static const char *name_qmatmul8(const OrtCustomOp *op) { (void)op; return "QMatMul8"; }
static const char *name_qbatchmatmul4(const OrtCustomOp *op) { (void)op; return "QBatchMatMul4"; }
static const char *name_qbatchmatmul8(const OrtCustomOp *op) { (void)op; return "QBatchMatMul8"; }
static const char *name_qexperts4(const OrtCustomOp *op) { (void)op; return "QRoutedExperts4"; }
static const char *name_qexperts8(const OrtCustomOp *op) { (void)op; return "QRoutedExperts8"; }
static const char *name_qgather4(const OrtCustomOp *op) { (void)op; return "QGather4"; }
static const char *name_qgather6(const OrtCustomOp *op) { (void)op; return "QGather6"; }
static const char *name_qgather8(const OrtCustomOp *op) { (void)op; return "QGather8"; }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return INPUT_OUTPUT_REQUIRED; }
static OrtMemType default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static OrtStatus *create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)a, (void)info;
    *kernel = (void *)(intptr_t)(mla_isa() + 1); /* isa_of's encoding */
    return NULL;
}
static void destroy(void *kernel) { (void)kernel; }
static int first_version(const OrtCustomOp *op) { (void)op; return 1; }
static int last_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t no_pairs(int **input_index, int **output_index) { *input_index = NULL, *output_index = NULL; return 0; }
static void release_pairs(int *input_index, int *output_index) { (void)input_index, (void)output_index; }

#define CPU_OP(NAME, INPUT, INPUTS, COMPUTE) KERNEL_OP(NAME, INPUT, INPUTS, create, COMPUTE, destroy)
#define KERNEL_OP(NAME, INPUT, INPUTS, CREATE, COMPUTE, DESTROY)                                                      \
    {                                                                                                                 \
        .version = ORT_ABI_VERSION, .GetName = NAME, .GetExecutionProviderType = cpu, .GetInputType = INPUT,          \
        .GetInputTypeCount = INPUTS, .GetOutputType = output_float, .GetOutputTypeCount = one, .KernelDestroy = DESTROY, \
        .GetInputCharacteristic = required, .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory, \
        .GetVariadicInputMinArity = min_arity, .GetVariadicInputHomogeneity = homogeneous,                            \
        .GetVariadicOutputMinArity = min_arity, .GetVariadicOutputHomogeneity = homogeneous, .CreateKernelV2 = CREATE, \
        .KernelComputeV2 = COMPUTE, .GetStartVersion = first_version, .GetEndVersion = last_version,                  \
        .GetMayInplace = no_pairs, .ReleaseMayInplace = release_pairs, .GetAliasMap = no_pairs,                       \
        .ReleaseAliasMap = release_pairs,                                                                             \
    }
static OrtCustomOp ops[] = {CPU_OP(name_f16, input_f16, two, compute_f16), CPU_OP(name_bf16, input_bf16, two, compute_bf16),
                            CPU_OP(name_experts_f32, input_float, four, compute_experts_f32),
                            CPU_OP(name_experts_f16, experts_f16, four, compute_experts_f16),
                            CPU_OP(name_experts_bf16, experts_bf16, four, compute_experts_bf16),
                            CPU_OP(name_attention_f32, input_float, five, compute_attention_f32),
                            CPU_OP(name_attention_f16, attention_f16, five, compute_attention_f16),
                            CPU_OP(name_attention_bf16, attention_bf16, five, compute_attention_bf16),
                            CPU_OP(name_long_f32, input_float, five, compute_long_f32),
                            CPU_OP(name_long_f16, attention_f16, five, compute_long_f16),
                            CPU_OP(name_long_bf16, attention_bf16, five, compute_long_bf16),
                            CPU_OP(name_chunk_f32, input_float, five, compute_chunk_f32),
                            CPU_OP(name_chunk_f16, attention_f16, five, compute_chunk_f16),
                            CPU_OP(name_chunk_bf16, attention_bf16, five, compute_chunk_bf16)};
/* registered only at ISA_AVX512 (RegisterCustomOps) */
static OrtCustomOp avx512_ops[] = {CPU_OP(name_avx512_f32, input_float, five, compute_avx512_f32),
                                   CPU_OP(name_avx512_long_f32, input_float, five, compute_avx512_long_f32),
                                   CPU_OP(name_avx512_chunk_f32, input_float, five, compute_avx512_chunk_f32)};
static OrtCustomOp quantized_ops[] = {
    KERNEL_OP(name_qmatmul4, qmatmul_input, three, create_quantized, compute_qmatmul, destroy_quantized),
    KERNEL_OP(name_qmatmul6, qmatmul_input, three, create_quantized, compute_qmatmul, destroy_quantized),
    KERNEL_OP(name_qmatmul8, qmatmul_input, three, create_quantized, compute_qmatmul, destroy_quantized),
    KERNEL_OP(name_qbatchmatmul4, qmatmul_input, three, create_quantized, compute_qbatchmatmul, destroy_quantized),
    KERNEL_OP(name_qbatchmatmul8, qmatmul_input, three, create_quantized, compute_qbatchmatmul, destroy_quantized),
    KERNEL_OP(name_qexperts4, qexperts_input, six, create_quantized, compute_qexperts, destroy_quantized),
    KERNEL_OP(name_qexperts8, qexperts_input, six, create_quantized, compute_qexperts, destroy_quantized),
    KERNEL_OP(name_qgather4, qgather_input, three, create_quantized, compute_qgather, destroy_quantized),
    KERNEL_OP(name_qgather6, qgather_input, three, create_quantized, compute_qgather, destroy_quantized),
    KERNEL_OP(name_qgather8, qgather_input, three, create_quantized, compute_qgather, destroy_quantized),
    KERNEL_OP(name_q8_f32, q8_f32, six, create, compute_q8_f32, destroy),
    KERNEL_OP(name_q8_f16, q8_f16, six, create, compute_q8_f16, destroy),
    KERNEL_OP(name_q8_bf16, q8_bf16, six, create, compute_q8_bf16, destroy),
    KERNEL_OP(name_long_q8_f32, q8_f32, six, create, compute_long_q8_f32, destroy),
    KERNEL_OP(name_long_q8_f16, q8_f16, six, create, compute_long_q8_f16, destroy),
    KERNEL_OP(name_long_q8_bf16, q8_bf16, six, create, compute_long_q8_bf16, destroy),
    KERNEL_OP(name_chunk_q8_f32, q8_f32, six, create, compute_chunk_q8_f32, destroy),
    KERNEL_OP(name_chunk_q8_f16, q8_f16, six, create, compute_chunk_q8_f16, destroy),
    KERNEL_OP(name_chunk_q8_bf16, q8_bf16, six, create, compute_chunk_q8_bf16, destroy)};

/* Every op has a plain C path, so the library registers on any x86-64 CPU; each kernel runs the path of the level
 * read as onnxruntime creates it (MLA_DEPLOY_ISA caps it: dispatch.h). The *Avx512 attention ops are registered only
 * where that level, read here, is ISA_AVX512. On an onnxruntime older than the ABI slots used it registers nothing
 * and the graphs run the ops' function bodies. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(ORT_ABI_VERSION);
    if (!api) return NULL;
    OrtCustomOpDomain *domain; /* lives as long as the process: sessions keep referring to it */
    OrtStatus *status = ORT_FN(api, OrtCreateCustomOpDomainFn, ORT_CreateCustomOpDomain)("mla_deploy", &domain);
    for (size_t i = 0; !status && i < sizeof(ops) / sizeof(ops[0]); i++)
        status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &ops[i]);
    for (size_t i = 0; !status && i < sizeof(quantized_ops) / sizeof(quantized_ops[0]); i++)
        status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &quantized_ops[i]);
    if (mla_isa() == ISA_AVX512)
        for (size_t i = 0; !status && i < sizeof(avx512_ops) / sizeof(avx512_ops[0]); i++)
            status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &avx512_ops[i]);
    return status ? status : ORT_FN(api, OrtAddCustomOpDomainFn, ORT_AddCustomOpDomain)(options, domain);
}
