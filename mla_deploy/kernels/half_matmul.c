/* mla_deploy.MatMulF16: Y[..., N] = A[..., K] @ W[K, N] for a float16 weight W and float32 A and Y, W stored as
 * strips of 64 columns, B[N / 64, K, 64] (B[s, k, j] = W[k, 64 s + j]): each strip one contiguous stream.
 *
 * onnxruntime's CPU provider has no float16 MatMul on a CPU without AVX512-FP16, so a float16 export computes in
 * float32 and a plain MatMul would multiply by a float32 copy of each weight that onnxruntime makes at load: every
 * decode step would read twice the bytes the file holds. This kernel reads the float16 weight as stored and widens
 * it in registers (F16C, 8 values per instruction). The graph carries the op as a function too (re-layout + Cast +
 * MatMul), which onnxruntime runs wherever this library is not registered (export/layers.py).
 *
 * Work is split by strip over the session's own intra-op threads (KernelContext_ParallelFor), and A's rows into
 * balanced groups of at most 6, packed [K, 6]. One row (a decode step): eight 8-wide accumulators walk the strip.
 * A few rows (batched decode): per group and 16 columns, 6x16 accumulators over all of K straight from float16.
 * More rows (prefill): per 256 rows of the strip, the block is widened once into a float32 panel that stays in L1
 * while every group passes over it, with partial sums in a per-strip buffer.
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define STRIP 64 /* output columns per task */
#define PANEL 16 /* columns of one register block */
#define MR 6     /* rows of one register block */
#define KC 256   /* depth of one pass over B */
#define FEW_ROWS 12 /* up to this many rows, B is read as float16 in each group's pass */

static const OrtApi *api;

typedef struct {
    const float *a;    /* A: [k] for one row; for more, groups of `group` rows packed [k, MR] each */
    const uint16_t *b; /* [n / 64, k, 64] float16 */
    float *y;          /* [m, n] */
    int64_t m, k, n;
    int64_t group;     /* rows per packed group: at most MR, balanced (8 rows: 4 + 4, not 6 + 2) */
} Job;

static OrtStatus *error(const char *message) { return ORT_FN(api, OrtCreateStatusFn, ORT_CreateStatus)(ORT_INVALID_ARGUMENT, message); }

KERNEL static void widen(const uint16_t *h, float *f, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < count; i++) f[i] = _cvtsh_ss(h[i]);
}

/* Group g of A [m, k]'s rows (`group` rows each) packed [k, MR] (rows past the group's end 0) */
static void pack_group(const Job *job, const float *a, int64_t g) {
    float *packed = (float *)job->a + g * MR * job->k;
    for (int64_t r = 0; r < MR; r++) {
        int64_t source = g * job->group + r, i = 0;
        if (r >= job->group || source >= job->m) {
            for (i = 0; i < job->k; i++) packed[i * MR + r] = 0.0f;
            continue;
        }
        for (const float *row = a + source * job->k; i < job->k; i++) packed[i * MR + r] = row[i];
    }
}

typedef struct {
    const Job *job;
    const float *a;
} Packing;

static void run_pack(void *data, size_t g) { pack_group(((Packing *)data)->job, ((Packing *)data)->a, (int64_t)g); }

/* y[64 s, 64 s + 64) of one row: a[k] @ strip[k, 64] */
KERNEL static void row_strip(const float *a, const uint16_t *strip, float *y, int64_t k) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    const uint16_t *p = strip;
    for (int64_t i = 0; i < k; i++, p += STRIP) {
        __m256 ai = _mm256_broadcast_ss(a + i);
        for (int j = 0; j < 8; j++)
            acc[j] = _mm256_fmadd_ps(ai, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j))), acc[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(y + 8 * j, acc[j]);
}

/* c[mr, 16] (+)= a[kc, mr] @ b[kc, 16]: a packed row-block (MR per k), b rows STRIP apart, c rows STRIP apart */
#define WIDE(b) _mm256_loadu_ps(b)
#define HALF(b) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)))
#define BLOCK(NAME, B_TYPE, LOAD)                                                                                       \
    static inline __attribute__((always_inline)) KERNEL void NAME(int mr, const float *a, const B_TYPE *b,            \
                                                                  int64_t ldb, int64_t kc, float *c, int first) {     \
        __m256 lo[MR], hi[MR];                                                                                        \
        for (int r = 0; r < mr; r++) {                                                                                \
            lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP);                                     \
            hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP + 8);                                 \
        }                                                                                                             \
        for (int64_t i = 0; i < kc; i++, a += MR, b += ldb) {                                                         \
            __m256 b0 = LOAD(b), b1 = LOAD(b + 8);                                                                    \
            for (int r = 0; r < mr; r++) {                                                                            \
                __m256 ar = _mm256_broadcast_ss(a + r);                                                               \
                lo[r] = _mm256_fmadd_ps(ar, b0, lo[r]);                                                               \
                hi[r] = _mm256_fmadd_ps(ar, b1, hi[r]);                                                               \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < mr; r++) {                                                                                \
            _mm256_storeu_ps(c + r * STRIP, lo[r]);                                                                   \
            _mm256_storeu_ps(c + r * STRIP + 8, hi[r]);                                                               \
        }                                                                                                             \
    }
BLOCK(block, float, WIDE)      /* b widened beforehand (many rows: each weight is used by many groups) */
BLOCK(block_h, uint16_t, HALF) /* b read as float16 (a few rows: each weight is used once or twice) */

#define BLOCK_ROWS(NAME, BLOCK, B_TYPE)                                                                       \
    KERNEL static void NAME(int mr, const float *a, const B_TYPE *b, int64_t ldb, int64_t kc, float *c,         \
                            int first) {                                                                        \
        switch (mr) { /* a constant row count per case: the accumulators stay in registers */                   \
            case 6: BLOCK(6, a, b, ldb, kc, c, first); break;                                                        \
            case 5: BLOCK(5, a, b, ldb, kc, c, first); break;                                                        \
            case 4: BLOCK(4, a, b, ldb, kc, c, first); break;                                                        \
            case 3: BLOCK(3, a, b, ldb, kc, c, first); break;                                                        \
            case 2: BLOCK(2, a, b, ldb, kc, c, first); break;                                                        \
            default: BLOCK(1, a, b, ldb, kc, c, first); break;                                                       \
        }                                                                                                       \
    }
BLOCK_ROWS(block_rows, block, float)
BLOCK_ROWS(block_rows_h, block_h, uint16_t)

/* y[:, 64 s, 64 s + 64) of a few rows: each group of rows over all of K at once, straight from the float16 strip */
KERNEL static void few_rows_strip(const Job *job, const uint16_t *strip, int64_t col) {
    float c[MR * STRIP];
    for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
        int mr = job->m - r0 < job->group ? (int)(job->m - r0) : (int)job->group;
        const float *a = job->a + r0 / job->group * MR * job->k;
        for (int64_t p = 0; p < STRIP; p += PANEL) block_rows_h(mr, a, strip + p, STRIP, job->k, c + p, 1);
        for (int r = 0; r < mr; r++) memcpy(job->y + (r0 + r) * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
    }
}

/* y[:, 64 s, 64 s + 64) of every row. Per block of KC rows of the strip: the block widened once into `b`, panel by
 * panel [64 / 16, KC, 16]; each panel (16 KiB, in L1) then meets every group of rows; partial sums in `c` [m, 64]. */
KERNEL static void rows_strip(const Job *job, const uint16_t *strip, int64_t col, float *c, float *b) {
    for (int64_t k0 = 0; k0 < job->k; k0 += KC) {
        int64_t kc = job->k - k0 < KC ? job->k - k0 : KC;
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t i = 0; i < kc; i++) widen(strip + (k0 + i) * STRIP + p * PANEL, b + (p * kc + i) * PANEL, PANEL);
        for (int64_t p = 0; p < STRIP / PANEL; p++)
            for (int64_t r0 = 0; r0 < job->m; r0 += job->group) {
                int mr = job->m - r0 < job->group ? (int)(job->m - r0) : (int)job->group;
                const float *a = job->a + r0 / job->group * MR * job->k + k0 * MR; /* this group, from row k0 */
                block_rows(mr, a, b + p * kc * PANEL, PANEL, kc, c + r0 * STRIP + p * PANEL, k0 == 0);
            }
    }
    for (int64_t r = 0; r < job->m; r++) memcpy(job->y + r * job->n + col, c + r * STRIP, sizeof(float) * STRIP);
}

static void run_strip(void *data, size_t s) {
    const Job *job = data;
    const uint16_t *strip = job->b + (int64_t)s * job->k * STRIP;
    if (job->m == 1) {
        row_strip(job->a, strip, job->y + s * STRIP, job->k);
    } else if (job->m <= FEW_ROWS) {
        few_rows_strip(job, strip, (int64_t)s * STRIP);
    } else {
        float *c = malloc(sizeof(float) * (job->m * STRIP + KC * STRIP));
        if (c) rows_strip(job, strip, (int64_t)s * STRIP, c, c + job->m * STRIP);
        free(c); /* malloc failing for this little: nothing sane is left to do */
    }
}

/* ---- onnxruntime's side ---- */

static int64_t shape(const OrtValue *value, int64_t *dims, size_t *rank) {
    OrtTensorTypeAndShapeInfo *info;
    if (ORT_FN(api, OrtGetTensorTypeAndShapeFn, ORT_GetTensorTypeAndShape)(value, &info)) return -1;
    ORT_FN(api, OrtGetDimensionsCountFn, ORT_GetDimensionsCount)(info, rank);
    if (*rank > 8) *rank = 8;
    ORT_FN(api, OrtGetDimensionsFn, ORT_GetDimensions)(info, dims, *rank);
    ORT_FN(api, OrtReleaseTensorTypeAndShapeInfoFn, ORT_ReleaseTensorTypeAndShapeInfo)(info);
    return 0;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    (void)kernel;
    const OrtValue *a_value, *b_value;
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 0, &a_value);
    ORT_FN(api, OrtKernelContextGetInputFn, ORT_KernelContext_GetInput)(context, 1, &b_value);
    int64_t a_dims[8], b_dims[8];
    size_t a_rank, b_rank;
    if (shape(a_value, a_dims, &a_rank) || shape(b_value, b_dims, &b_rank)) return error("MatMulF16: unreadable shape");
    if (b_rank != 3 || b_dims[2] != STRIP) return error("MatMulF16: B must be strips [N / 64, K, 64]");
    if (a_rank < 1 || a_dims[a_rank - 1] != b_dims[1]) return error("MatMulF16: A's last dimension must equal B's K");
    Job job = {.k = b_dims[1], .n = b_dims[0] * STRIP, .m = 1};
    for (size_t i = 0; i + 1 < a_rank; i++) job.m *= a_dims[i];
    int64_t y_dims[8];
    memcpy(y_dims, a_dims, sizeof(int64_t) * a_rank);
    y_dims[a_rank - 1] = job.n;
    OrtValue *y_value;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, ORT_KernelContext_GetOutput)(context, 0, y_dims, a_rank, &y_value))
        return error("MatMulF16: cannot allocate Y");
    void *a, *b, *y;
    ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)((OrtValue *)a_value, &a);
    ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)((OrtValue *)b_value, &b);
    ORT_FN(api, OrtGetTensorMutableDataFn, ORT_GetTensorMutableData)(y_value, &y);
    if (job.m == 0 || job.n == 0) return NULL;
    if (job.k == 0) { /* an empty sum */
        memset(y, 0, sizeof(float) * job.m * job.n);
        return NULL;
    }
    int64_t groups = (job.m + MR - 1) / MR;
    job.group = (job.m + groups - 1) / groups;
    float *packed = job.m == 1 ? NULL : malloc(sizeof(float) * groups * MR * job.k);
    if (job.m > 1 && !packed) return error("MatMulF16: out of memory packing A");
    job.a = job.m == 1 ? a : packed, job.b = b, job.y = y;
    OrtStatus *status = NULL;
    Packing packing = {&job, a};
    if (job.m > 1 && groups == 1)
        run_pack(&packing, 0);
    else if (job.m > 1)
        status = ORT_FN(api, OrtKernelContextParallelForFn, ORT_KernelContext_ParallelFor)(context, run_pack,
                                                                                           (size_t)groups, 0, &packing);
    size_t strips = (size_t)b_dims[0];
    if (!status && strips == 1)
        run_strip(&job, 0);
    else if (!status)
        status = ORT_FN(api, OrtKernelContextParallelForFn, ORT_KernelContext_ParallelFor)(context, run_strip, strips,
                                                                                           0, &job);
    free(packed);
    return status;
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulF16"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static ONNXTensorElementDataType op_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType op_output_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
static size_t op_inputs(const OrtCustomOp *op) { (void)op; return 2; }
static size_t op_outputs(const OrtCustomOp *op) { (void)op; return 1; }
static OrtCustomOpInputOutputCharacteristic op_required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return INPUT_OUTPUT_REQUIRED; }
static OrtMemType op_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static int op_min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int op_homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static OrtStatus *op_create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)a, (void)info;
    *kernel = (void *)1; /* stateless */
    return NULL;
}
static void op_destroy(void *kernel) { (void)kernel; }
static int op_start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int op_end_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t op_no_pairs(int **input_index, int **output_index) { *input_index = NULL, *output_index = NULL; return 0; }
static void op_release_pairs(int *input_index, int *output_index) { (void)input_index, (void)output_index; }

static OrtCustomOp matmul_f16 = {
    .version = ORT_ABI_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_input_type,
    .GetInputTypeCount = op_inputs,
    .GetOutputType = op_output_type,
    .GetOutputTypeCount = op_outputs,
    .KernelDestroy = op_destroy,
    .GetInputCharacteristic = op_required,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_memory,
    .GetVariadicInputMinArity = op_min_arity,
    .GetVariadicInputHomogeneity = op_homogeneous,
    .GetVariadicOutputMinArity = op_min_arity,
    .GetVariadicOutputHomogeneity = op_homogeneous,
    .CreateKernelV2 = op_create,
    .KernelComputeV2 = compute,
    .GetStartVersion = op_start_version,
    .GetEndVersion = op_end_version,
    .GetMayInplace = op_no_pairs,
    .ReleaseMayInplace = op_release_pairs,
    .GetAliasMap = op_no_pairs,
    .ReleaseAliasMap = op_release_pairs,
};

/* onnxruntime calls this on SessionOptions.register_custom_ops_library. On a CPU without AVX2, FMA and F16C it
 * registers nothing, and the graphs run the op's function body instead. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(ORT_ABI_VERSION);
    if (!api) return NULL; /* an onnxruntime older than the slots above: the function bodies run */
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return NULL;
    OrtCustomOpDomain *domain;
    OrtStatus *status = ORT_FN(api, OrtCreateCustomOpDomainFn, ORT_CreateCustomOpDomain)("mla_deploy", &domain);
    if (status) return status;
    if ((status = ORT_FN(api, OrtCustomOpDomainAddFn, ORT_CustomOpDomain_Add)(domain, &matmul_f16))) return status;
    return ORT_FN(api, OrtAddCustomOpDomainFn, ORT_AddCustomOpDomain)(options, domain);
}
