/* onnxruntime's side of mla_deploy's kernels: the custom-op domain "mla_deploy" with
 *   MatMulF16  (A float32 [..., K], B float16 strips [N / 64, K, 64]) -> Y float32 [..., N]
 *   MatMulBF16 (the same with B bfloat16),
 * registered by RegisterCustomOps, which onnxruntime calls on SessionOptions.register_custom_ops_library. The
 * arithmetic is half_matmul.c's; this file reads shapes, allocates Y, packs A and splits the strips over the
 * session's intra-op threads. Every graph using these ops also carries them as ONNX functions (export/layers.py),
 * which onnxruntime runs where this library is not registered.
 */
#include <stdlib.h>
#include <string.h>

#include "half_matmul.h"
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
    HalfMatMul *job;
    const float *a;
    float *packed;
} Packing;

static void run_pack(void *data, size_t g) {
    Packing *p = data;
    half_matmul_pack(p->job, p->a, p->packed, (int64_t)g);
}

static void run_strip(void *data, size_t s) { half_matmul_strip(data, (int64_t)s); }

static OrtStatus *parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t total, void *data) {
    if (total == 1) {
        fn(data, 0);
        return NULL;
    }
    return ORT_FN(api, OrtKernelContextParallelForFn, ORT_KernelContext_ParallelFor)(context, fn, total, 0, data);
}

static OrtStatus *compute(OrtKernelContext *context, HalfKind kind, const char *op) {
    const OrtValue *a_value, *b_value;
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 0, &a_value);
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 1, &b_value);
    int64_t a_dims[MAX_RANK], b_dims[MAX_RANK], y_dims[MAX_RANK];
    size_t a_rank, b_rank;
    if (shape(a_value, a_dims, &a_rank) || a_rank < 1) return error(op, "A must have rank 1 to 8");
    if (shape(b_value, b_dims, &b_rank) || b_rank != 3 || b_dims[2] != STRIP)
        return error(op, "B must be strips [N / 64, K, 64]");
    if (a_dims[a_rank - 1] != b_dims[1]) return error(op, "A's last dimension must equal B's K");
    HalfMatMul job = {.kind = kind, .k = b_dims[1], .n = b_dims[0] * STRIP, .m = 1};
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
    job.group = half_matmul_group_rows(job.m), job.b = b, job.y = y, job.a = a;
    float *packed = NULL;
    OrtStatus *status = NULL;
    if (job.m > 1) {
        if (!(packed = malloc(sizeof(float) * half_matmul_packed_size(job.m, job.k))))
            return error(op, "out of memory packing A");
        Packing packing = {&job, a, packed};
        status = parallel_for(context, run_pack, (size_t)half_matmul_groups(job.m), &packing);
        job.a = packed;
    }
    if (!status) status = parallel_for(context, run_strip, (size_t)b_dims[0], &job);
    if (!status && __atomic_load_n(&job.failed, __ATOMIC_RELAXED)) status = error(op, "out of memory for a strip's partial sums");
    free(packed);
    return status;
}

static OrtStatus *compute_f16(void *kernel, OrtKernelContext *context) {
    (void)kernel;
    return compute(context, HALF_F16, "MatMulF16");
}
static OrtStatus *compute_bf16(void *kernel, OrtKernelContext *context) {
    (void)kernel;
    return compute(context, HALF_BF16, "MatMulBF16");
}

static const char *name_f16(const OrtCustomOp *op) { (void)op; return "MatMulF16"; }
static const char *name_bf16(const OrtCustomOp *op) { (void)op; return "MatMulBF16"; }
static ONNXTensorElementDataType input_f16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType input_bf16(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType output_float(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
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
static void destroy(void *kernel) { (void)kernel; }
static int first_version(const OrtCustomOp *op) { (void)op; return 1; }
static int last_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t no_pairs(int **input_index, int **output_index) { *input_index = NULL, *output_index = NULL; return 0; }
static void release_pairs(int *input_index, int *output_index) { (void)input_index, (void)output_index; }

#define HALF_MATMUL_OP(NAME, INPUT, COMPUTE)                                                                          \
    {                                                                                                                 \
        .version = ORT_ABI_VERSION, .GetName = NAME, .GetExecutionProviderType = cpu, .GetInputType = INPUT,          \
        .GetInputTypeCount = two, .GetOutputType = output_float, .GetOutputTypeCount = one, .KernelDestroy = destroy, \
        .GetInputCharacteristic = required, .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory, \
        .GetVariadicInputMinArity = min_arity, .GetVariadicInputHomogeneity = homogeneous,                            \
        .GetVariadicOutputMinArity = min_arity, .GetVariadicOutputHomogeneity = homogeneous, .CreateKernelV2 = create, \
        .KernelComputeV2 = COMPUTE, .GetStartVersion = first_version, .GetEndVersion = last_version,                  \
        .GetMayInplace = no_pairs, .ReleaseMayInplace = release_pairs, .GetAliasMap = no_pairs,                       \
        .ReleaseAliasMap = release_pairs,                                                                             \
    }
static OrtCustomOp ops[] = {HALF_MATMUL_OP(name_f16, input_f16, compute_f16),
                            HALF_MATMUL_OP(name_bf16, input_bf16, compute_bf16)};

/* On a CPU without AVX2, FMA and F16C, or an onnxruntime older than the ABI slots used, it registers nothing and the
 * graphs run the ops' function bodies. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(ORT_ABI_VERSION);
    if (!api || !half_matmul_supported()) return NULL;
    OrtCustomOpDomain *domain; /* lives as long as the process: sessions keep referring to it */
    OrtStatus *status = ORT_FN(api, OrtCreateCustomOpDomainFn, ORT_CreateCustomOpDomain)("mla_deploy", &domain);
    for (size_t i = 0; !status && i < sizeof(ops) / sizeof(ops[0]); i++)
        status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &ops[i]);
    return status ? status : ORT_FN(api, OrtAddCustomOpDomainFn, ORT_AddCustomOpDomain)(options, domain);
}
