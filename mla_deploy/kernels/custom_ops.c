/* onnxruntime's side of mla_deploy's kernels: the custom-op domain "mla_deploy" with
 *   MatMulF16  (A float32 [..., K], B float16 strips [N / 64, K, 64]) -> Y float32 [..., N]
 *   MatMulBF16 (the same with B bfloat16)
 *   RoutedExperts (X float32 [T, d], dispatch float32 [T, E], fc1 float32 [E, I' / 32, d, 64],
 *                  fc2 float32 [E, d' / 64, I', 64]) -> Y float32 [T, d]   (routed_experts.h)
 *   RoutedExpertsF16, RoutedExpertsBF16 (the same with fc1 and fc2 float16 or bfloat16)
 *   LatentAttention (q_latent float32 [b, h, d_c], q_rope float32 [b, h, d_r], latent cache [b, cap, d_c],
 *                    rope cache [b, cap, d_r], bias float32 [b, 1, 1, cap]) -> float32 [b, h, d_c]
 *                    (latent_attention.h; LatentAttentionF16 / BF16 with the caches in half precision;
 *                    LatentAttentionLong* the same kernels under other names, whose function bodies suit long caches)
 *   LatentAttentionQ8 (q_latent, q_rope, latent int8 [b, cap, d_c], latent_scale float32 [b, cap, 1],
 *                      rope float32 [b, cap, d_r], bias) -> float32 [b, h, d_c]   (latent_attention_q8.h;
 *                      Q8F16 / Q8BF16 with the rope cache in half precision; LatentAttentionLongQ8* likewise)
 * registered by RegisterCustomOps, which onnxruntime calls on SessionOptions.register_custom_ops_library. The
 * arithmetic is strip_matmul.c's, routed_experts.c's and latent_attention.c's; this file reads shapes, allocates the
 * outputs and splits the work over the session's intra-op threads. Every graph using these ops also carries them as
 * ONNX functions (export/layers.py), which onnxruntime runs where this library is not registered.
 */
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "latent_attention.h"
#include "latent_attention_q8.h"
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

static void run_strip(void *data, size_t s) { strip_matmul_strip(data, (int64_t)s); }

/* fn(data, 0 .. total - 1) on the session's intra-op threads; on this thread alone without a context */
static OrtStatus *parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t total, void *data) {
    if (total == 1 || !context) {
        for (size_t i = 0; i < total; i++) fn(data, i);
        return NULL;
    }
    return ORT_FN(api, OrtKernelContextParallelForFn, ORT_KernelContext_ParallelFor)(context, fn, total, 0, data);
}

static OrtStatus *compute(OrtKernelContext *context, StripKind kind, const char *op) {
    const OrtValue *a_value, *b_value;
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 0, &a_value);
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 1, &b_value);
    int64_t a_dims[MAX_RANK], b_dims[MAX_RANK], y_dims[MAX_RANK];
    size_t a_rank, b_rank;
    if (shape(a_value, a_dims, &a_rank) || a_rank < 1) return error(op, "A must have rank 1 to 8");
    if (shape(b_value, b_dims, &b_rank) || b_rank != 3 || b_dims[2] != STRIP)
        return error(op, "B must be strips [N / 64, K, 64]");
    if (a_dims[a_rank - 1] != b_dims[1]) return error(op, "A's last dimension must equal B's K");
    StripMatMul job = {.kind = kind, .k = b_dims[1], .n = b_dims[0] * STRIP, .m = 1};
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
    if (!status) status = parallel_for(context, run_strip, (size_t)b_dims[0], &job);
    if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a strip's partial sums");
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

static OrtStatus *compute_routed_experts(OrtKernelContext *context, StripKind kind, const char *op) {
    int64_t dims[4][MAX_RANK];
    size_t rank[4];
    void *data[4], *y;
    OrtStatus *status = inputs(context, op, 4, dims, rank, data);
    if (status) return status;
    if (rank[0] != 2 || rank[1] != 2 || rank[2] != 4 || rank[3] != 4)
        return error(op, "expected X [T, d], dispatch [T, E], fc1 [E, I'/32, d, 64], fc2 [E, d'/64, I', 64]");
    RoutedExperts job = {.kind = kind, .tokens = dims[0][0], .d = dims[0][1], .experts = dims[1][1],
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
    if (job.active) { /* gathering and packing copy a few rows: on this thread, between the two products */
        ExpertStep fc1 = {&job, routed_experts_fc1}, fc2 = {&job, routed_experts_fc2};
        OrtKernelContext *pool = pool_for(context, job.first[job.active] * 3 * job.inter * job.d);
        for (int64_t i = 0; i < job.active; i++) routed_experts_gather(&job, i);
        status = parallel_for(pool, run_expert_step, (size_t)(job.active * job.inter / GATE_UP), &fc1);
        for (int64_t i = 0; !status && i < job.active; i++) routed_experts_pack(&job, i);
        if (!status) status = parallel_for(pool, run_expert_step, (size_t)job.out_strips, &fc2);
        if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a strip's partial sums");
    }
    routed_experts_release(&job);
    return status;
}

static void run_latent_range(void *data, size_t task) { latent_attention_range(data, (int64_t)task); }

static OrtStatus *compute_latent_attention(OrtKernelContext *context, StripKind kind, const char *op) {
    int64_t dims[5][MAX_RANK];
    size_t rank[5];
    void *data[5], *y;
    OrtStatus *status = inputs(context, op, 5, dims, rank, data);
    if (status) return status;
    if (rank[0] != 3 || rank[1] != 3 || rank[2] != 3 || rank[3] != 3 || rank[4] < 1)
        return error(op, "expected q_latent [b, h, d_c], q_rope [b, h, d_r], latent [b, cap, d_c], rope [b, cap, d_r], "
                         "bias [b, 1, 1, cap]");
    LatentAttention job = {.kind = kind, .rows = dims[0][0], .heads = dims[0][1], .latent = dims[0][2],
                           .rope = dims[1][2], .capacity = dims[2][1]};
    int64_t bias_size = 1;
    for (size_t i = 0; i < rank[4]; i++) bias_size *= dims[4][i];
    if (dims[1][0] != job.rows || dims[1][1] != job.heads || dims[2][0] != job.rows || dims[2][2] != job.latent ||
        dims[3][0] != job.rows || dims[3][1] != job.capacity || dims[3][2] != job.rope)
        return error(op, "the queries and the caches disagree on the rows, the heads or the widths");
    if (dims[4][rank[4] - 1] != job.capacity || bias_size != job.rows * job.capacity)
        return error(op, "bias must hold one value per row and cache slot [b, 1, 1, cap]");
    if (job.latent % 16 || job.rope % 8) return error(op, "d_c must be a multiple of 16 and d_r of 8");
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], 3, &y_value) ||
        ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y))
        return error(op, "cannot allocate the output");
    job.q_latent = data[0], job.q_rope = data[1], job.latent_cache = data[2], job.rope_cache = data[3];
    job.bias = data[4], job.out = y;
    if (job.rows == 0 || job.heads == 0 || job.latent == 0) return NULL;
    if (job.capacity == 0) return error(op, "the cache has no slots");
    if (latent_attention_plan(&job)) return error(op, "out of memory for the partial results");
    status = parallel_for(pool_for(context, job.rows * job.capacity * job.heads * (job.latent + job.rope)),
                          run_latent_range, (size_t)(job.rows * job.splits), &job);
    for (int64_t r = 0; !status && r < job.rows; r++) latent_attention_combine(&job, r);
    if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a range's scores");
    latent_attention_release(&job);
    return status;
}

static void run_latent_range_q8(void *data, size_t task) { latent_attention_q8_range(data, (int64_t)task); }

/* the kernel's instruction-set level, read when onnxruntime created it (create_at_level): dispatch.h */
static Isa level_of(void *kernel) { return (Isa)((intptr_t)kernel - 1); }

static OrtStatus *compute_latent_attention_q8(void *kernel, OrtKernelContext *context, StripKind rope_kind,
                                              const char *op) {
    int64_t dims[6][MAX_RANK];
    size_t rank[6];
    void *data[6], *y;
    OrtStatus *status = inputs(context, op, 6, dims, rank, data);
    if (status) return status;
    if (rank[0] != 3 || rank[1] != 3 || rank[2] != 3 || rank[3] != 3 || rank[4] != 3 || rank[5] < 1)
        return error(op, "expected q_latent [b, h, d_c], q_rope [b, h, d_r], latent [b, cap, d_c], latent_scale "
                         "[b, cap, 1], rope [b, cap, d_r], bias [b, 1, 1, cap]");
    LatentAttentionQ8 job = {.isa = level_of(kernel), .rope_kind = rope_kind, .rows = dims[0][0], .heads = dims[0][1],
                             .latent = dims[0][2], .rope = dims[1][2], .capacity = dims[2][1]};
    int64_t bias_size = 1;
    for (size_t i = 0; i < rank[5]; i++) bias_size *= dims[5][i];
    if (dims[1][0] != job.rows || dims[1][1] != job.heads || dims[2][0] != job.rows || dims[2][2] != job.latent ||
        dims[4][0] != job.rows || dims[4][1] != job.capacity || dims[4][2] != job.rope)
        return error(op, "the queries and the caches disagree on the rows, the heads or the widths");
    if (dims[3][0] != job.rows || dims[3][1] != job.capacity || dims[3][2] != 1)
        return error(op, "latent_scale must hold one scale per row and cache slot [b, cap, 1]");
    if (dims[5][rank[5] - 1] != job.capacity || bias_size != job.rows * job.capacity)
        return error(op, "bias must hold one value per row and cache slot [b, 1, 1, cap]");
    if (job.latent % 16 || job.rope % 8) return error(op, "d_c must be a multiple of 16 and d_r of 8");
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, dims[0], 3, &y_value) ||
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
    for (int64_t r = 0; !status && r < job.rows; r++) latent_attention_q8_combine(&job, r);
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

/* each registered op: its name, and its compute as one of the three above with the weights' (caches') type */
#define OP_FUNCTIONS(ID, COMPUTE, KIND, NAME)                                                                         \
    static OrtStatus *compute_##ID(void *kernel, OrtKernelContext *context) {                                        \
        (void)kernel;                                                                                                 \
        return COMPUTE(context, KIND, NAME);                                                                          \
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
static ONNXTensorElementDataType output_float(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t four(const OrtCustomOp *op) { (void)op; return 4; }
static size_t five(const OrtCustomOp *op) { (void)op; return 5; }
static size_t six(const OrtCustomOp *op) { (void)op; return 6; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return INPUT_OUTPUT_REQUIRED; }
static OrtMemType default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static OrtStatus *create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)a, (void)info;
    *kernel = (void *)1; /* stateless */
    return NULL;
}
/* a kernel that holds its level (level_of's encoding: level + 1, never NULL) */
static OrtStatus *create_at_level(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)a, (void)info;
    *kernel = (void *)(intptr_t)(mla_isa() + 1);
    return NULL;
}
static void destroy(void *kernel) { (void)kernel; }
static int first_version(const OrtCustomOp *op) { (void)op; return 1; }
static int last_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t no_pairs(int **input_index, int **output_index) { *input_index = NULL, *output_index = NULL; return 0; }
static void release_pairs(int *input_index, int *output_index) { (void)input_index, (void)output_index; }

#define CPU_OP(NAME, INPUT, INPUTS, COMPUTE) CPU_OP_CREATED(NAME, INPUT, INPUTS, COMPUTE, create)
#define CPU_OP_CREATED(NAME, INPUT, INPUTS, COMPUTE, CREATE)                                                          \
    {                                                                                                                 \
        .version = ORT_ABI_VERSION, .GetName = NAME, .GetExecutionProviderType = cpu, .GetInputType = INPUT,          \
        .GetInputTypeCount = INPUTS, .GetOutputType = output_float, .GetOutputTypeCount = one, .KernelDestroy = destroy, \
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
                            CPU_OP(name_long_bf16, attention_bf16, five, compute_long_bf16)};
/* the ops with a plain C path beside their SIMD ones: registered at every level */
static OrtCustomOp q8_ops[] = {CPU_OP_CREATED(name_q8_f32, q8_f32, six, compute_q8_f32, create_at_level),
                               CPU_OP_CREATED(name_q8_f16, q8_f16, six, compute_q8_f16, create_at_level),
                               CPU_OP_CREATED(name_q8_bf16, q8_bf16, six, compute_q8_bf16, create_at_level),
                               CPU_OP_CREATED(name_long_q8_f32, q8_f32, six, compute_long_q8_f32, create_at_level),
                               CPU_OP_CREATED(name_long_q8_f16, q8_f16, six, compute_long_q8_f16, create_at_level),
                               CPU_OP_CREATED(name_long_q8_bf16, q8_bf16, six, compute_long_q8_bf16, create_at_level)};

/* Below the AVX2 level (a CPU without AVX2, FMA and F16C, or MLA_DEPLOY_ISA=scalar: dispatch.h) it registers only the
 * ops with a plain C path; on an onnxruntime older than the ABI slots used it registers nothing, and the graphs run
 * the ops' function bodies. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(ORT_ABI_VERSION);
    if (!api) return NULL;
    OrtCustomOpDomain *domain; /* lives as long as the process: sessions keep referring to it */
    OrtStatus *status = ORT_FN(api, OrtCreateCustomOpDomainFn, ORT_CreateCustomOpDomain)("mla_deploy", &domain);
    for (size_t i = 0; !status && mla_isa() >= ISA_AVX2 && i < sizeof(ops) / sizeof(ops[0]); i++)
        status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &ops[i]);
    for (size_t i = 0; !status && i < sizeof(q8_ops) / sizeof(q8_ops[0]); i++)
        status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &q8_ops[i]);
    return status ? status : ORT_FN(api, OrtAddCustomOpDomainFn, ORT_AddCustomOpDomain)(options, domain);
}
