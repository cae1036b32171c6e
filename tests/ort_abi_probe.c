/* A custom-op library that calls every onnxruntime C API slot mla_deploy/kernels/ort_abi.h names, through that
 * header's slot numbers, with inputs whose results prove each is the function the header says (tests/test_ort_abi.py).
 *
 * Registration goes through CreateCustomOpDomain, CustomOpDomain_Add and AddCustomOpDomain: a session that then
 * resolves the op proves all three. Its kernel, SlotProbe (X double [2, 3, 7] -> Y double [PROBE_OUT]), writes what
 * the other slots return into Y: the element type, rank and dims of X (GetTensorTypeAndShape, GetTensorElementType,
 * GetDimensionsCount, GetDimensions), the sum of X read through GetTensorMutableData, which indices ParallelFor
 * visited, a status made by CreateStatus read back by GetErrorCode and GetErrorMessage (slots 1 and 2, fixed since
 * the first release), and the heap left over after PROBE_CYCLES of GetTensorTypeAndShape and
 * ReleaseTensorTypeAndShapeInfo (0 unless the release frees something else, or nothing). An X whose first value is
 * negative makes the kernel return CreateStatus(ORT_INVALID_ARGUMENT, PROBE_REFUSAL), which onnxruntime raises.
 * When onnxruntime creates the kernel, KernelInfoGetAttribute_int64 reads the node's integer attribute probe_value
 * (Y holds it) and a missing one gives a status that ReleaseStatus frees; the kernel writes the heap left over after
 * PROBE_CYCLES statuses made by CreateStatus and freed by ReleaseStatus (0 unless the release frees nothing).
 *
 * Built with -DSHIFT_SLOT=ORT_<name> -DSHIFT_BY=<n>, it calls that one slot n places off: the test checks that every
 * such library fails, so an off-by-one in ort_abi.h cannot pass.
 */
#include <malloc.h>
#include <string.h>

#include "ort_abi.h"

#ifdef SHIFT_SLOT
#define SLOT(s) ((s) == SHIFT_SLOT ? (s) + SHIFT_BY : (s))
#else
#define SLOT(s) (s)
#endif

enum { PROBE_GetErrorCode = 1, PROBE_GetErrorMessage = 2 }; /* not used by the library: only to read statuses back */
typedef OrtErrorCode (*ProbeGetErrorCodeFn)(const OrtStatus *status);
typedef const char *(*ProbeGetErrorMessageFn)(const OrtStatus *status);

#define PROBE_OUT 16
#define PROBE_TASKS 37
#define PROBE_CYCLES 20000
#define PROBE_DOUBLE ((ONNXTensorElementDataType)11)
#define PROBE_MESSAGE "mla-deploy slot probe"
#define PROBE_REFUSAL "slot probe: refused"

static const OrtApi *api;

#if __GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)
static double heap_in_use(void) { return (double)mallinfo2().uordblks; }
#else /* mallinfo2 is glibc 2.33's */
static double heap_in_use(void) { return (double)mallinfo().uordblks; }
#endif

static void mark(void *data, size_t i) { ((int *)data)[i] += 1; }

typedef struct {
    int64_t value;   /* the attribute probe_value */
    int missing_ok;  /* a missing attribute gave a status, released */
} ProbeKernel;

static OrtStatus *compute(void *kernel, OrtKernelContext *context) {
    const ProbeKernel *k = kernel;
    double y[PROBE_OUT] = {0};
    const OrtValue *x;
    if (ORT_FN(api, OrtKernelContextGetInputFn, SLOT(ORT_KernelContext_GetInput))(context, 0, &x)) return NULL;
    OrtTensorTypeAndShapeInfo *info;
    if (ORT_FN(api, OrtGetTensorTypeAndShapeFn, SLOT(ORT_GetTensorTypeAndShape))(x, &info)) return NULL;
    ONNXTensorElementDataType type = 0;
    size_t rank = 0;
    int64_t dims[8] = {0};
    ORT_FN(api, OrtGetTensorElementTypeFn, SLOT(ORT_GetTensorElementType))(info, &type);
    ORT_FN(api, OrtGetDimensionsCountFn, SLOT(ORT_GetDimensionsCount))(info, &rank);
    if (rank > 8) rank = 8;
    ORT_FN(api, OrtGetDimensionsFn, SLOT(ORT_GetDimensions))(info, dims, rank);
    ORT_FN(api, OrtReleaseTensorTypeAndShapeInfoFn, SLOT(ORT_ReleaseTensorTypeAndShapeInfo))(info);
    y[0] = type, y[1] = (double)rank, y[2] = (double)dims[0], y[3] = (double)dims[1], y[4] = (double)dims[2];

    void *data = NULL;
    if (ORT_FN(api, OrtGetTensorMutableDataFn, SLOT(ORT_GetTensorMutableData))((OrtValue *)x, &data) || !data) return NULL;
    const double *values = data;
    if (values[0] < 0)
        return ORT_FN(api, OrtCreateStatusFn, SLOT(ORT_CreateStatus))(ORT_INVALID_ARGUMENT, PROBE_REFUSAL);
    for (int64_t i = 0; i < dims[0] * dims[1] * dims[2] && i < 4096; i++) y[5] += values[i];

    int marks[PROBE_TASKS] = {0};
    OrtStatus *status =
        ORT_FN(api, OrtKernelContextParallelForFn, SLOT(ORT_KernelContext_ParallelFor))(context, mark, PROBE_TASKS, 0, marks);
    y[6] = status == NULL;
    for (int i = 0; i < PROBE_TASKS; i++) y[7] += marks[i] == 1;

    OrtStatus *made = ORT_FN(api, OrtCreateStatusFn, SLOT(ORT_CreateStatus))(ORT_INVALID_ARGUMENT, PROBE_MESSAGE);
    y[8] = ORT_FN(api, ProbeGetErrorCodeFn, PROBE_GetErrorCode)(made);
    y[9] = strcmp(ORT_FN(api, ProbeGetErrorMessageFn, PROBE_GetErrorMessage)(made), PROBE_MESSAGE) == 0;

    double before = heap_in_use();
    for (int i = 0; i < PROBE_CYCLES; i++) {
        if (ORT_FN(api, OrtGetTensorTypeAndShapeFn, SLOT(ORT_GetTensorTypeAndShape))(x, &info)) return NULL;
        ORT_FN(api, OrtReleaseTensorTypeAndShapeInfoFn, SLOT(ORT_ReleaseTensorTypeAndShapeInfo))(info);
    }
    y[10] = heap_in_use() - before;
    y[11] = (double)k->value, y[12] = k->missing_ok;
    before = heap_in_use();
    for (int i = 0; i < PROBE_CYCLES; i++)
        ORT_FN(api, OrtReleaseStatusFn, SLOT(ORT_ReleaseStatus))(
            ORT_FN(api, OrtCreateStatusFn, SLOT(ORT_CreateStatus))(ORT_INVALID_ARGUMENT, PROBE_MESSAGE));
    y[13] = heap_in_use() - before;

    int64_t shape[1] = {PROBE_OUT};
    OrtValue *out;
    if (ORT_FN(api, OrtKernelContextGetOutputFn, SLOT(ORT_KernelContext_GetOutput))(context, 0, shape, 1, &out)) return NULL;
    if (ORT_FN(api, OrtGetTensorMutableDataFn, SLOT(ORT_GetTensorMutableData))(out, &data) || !data) return NULL;
    memcpy(data, y, sizeof(y));
    return NULL;
}

static const char *name(const OrtCustomOp *op) { (void)op; return "SlotProbe"; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static ONNXTensorElementDataType doubles(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return PROBE_DOUBLE; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static OrtCustomOpInputOutputCharacteristic required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return INPUT_OUTPUT_REQUIRED; }
static OrtMemType default_memory(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return OrtMemTypeDefault; }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }
static ProbeKernel made; /* one node per session: a static kernel needs no release */
static OrtStatus *create(const OrtCustomOp *op, const OrtApi *a, const OrtKernelInfo *info, void **kernel) {
    (void)op, (void)a;
    made.value = -1;
    if (ORT_FN(api, OrtKernelInfoGetAttributeInt64Fn, SLOT(ORT_KernelInfoGetAttribute_int64))(info, "probe_value",
                                                                                              &made.value))
        made.value = -2;
    int64_t absent = 0;
    OrtStatus *status =
        ORT_FN(api, OrtKernelInfoGetAttributeInt64Fn, SLOT(ORT_KernelInfoGetAttribute_int64))(info, "absent", &absent);
    made.missing_ok = status != NULL;
    if (status) ORT_FN(api, OrtReleaseStatusFn, SLOT(ORT_ReleaseStatus))(status);
    *kernel = &made;
    return NULL;
}
static void destroy(void *kernel) { (void)kernel; }
static int first_version(const OrtCustomOp *op) { (void)op; return 1; }
static int last_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static size_t no_pairs(int **input_index, int **output_index) { *input_index = NULL, *output_index = NULL; return 0; }
static void release_pairs(int *input_index, int *output_index) { (void)input_index, (void)output_index; }

static OrtCustomOp probe = {
    .version = ORT_ABI_VERSION, .GetName = name, .GetExecutionProviderType = cpu, .GetInputType = doubles,
    .GetInputTypeCount = one, .GetOutputType = doubles, .GetOutputTypeCount = one, .KernelDestroy = destroy,
    .GetInputCharacteristic = required, .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory,
    .GetVariadicInputMinArity = min_arity, .GetVariadicInputHomogeneity = homogeneous,
    .GetVariadicOutputMinArity = min_arity, .GetVariadicOutputHomogeneity = homogeneous, .CreateKernelV2 = create,
    .KernelComputeV2 = compute, .GetStartVersion = first_version, .GetEndVersion = last_version,
    .GetMayInplace = no_pairs, .ReleaseMayInplace = release_pairs, .GetAliasMap = no_pairs, .ReleaseAliasMap = release_pairs,
};

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(ORT_ABI_VERSION);
    OrtCustomOpDomain *domain;
    OrtStatus *status = ORT_FN(api, OrtCreateCustomOpDomainFn, SLOT(ORT_CreateCustomOpDomain))("mla_deploy_probe", &domain);
    if (!status) status = ORT_FN(api, OrtCustomOpDomainAddFn, SLOT(ORT_CustomOpDomain_Add))(domain, &probe);
    return status ? status : ORT_FN(api, OrtAddCustomOpDomainFn, SLOT(ORT_AddCustomOpDomain))(options, domain);
}
