/* The slice of onnxruntime's C ABI (onnxruntime_c_api.h, ORT_API_VERSION >= 17) that custom_ops.c uses,
 * declared here so the library builds from this project's files alone: onnxruntime's Python wheel ships no headers.
 *
 * OrtApi is a table of function pointers that onnxruntime only ever appends to, so a function's slot is fixed from
 * the release that added it on. The slots below are indices into that table (0 = CreateStatus), counted from the
 * upstream header's declaration order. tests/test_ort_abi.py checks each against the installed onnxruntime by what
 * it does (tests/ort_abi_probe.c calls every slot named here, through these numbers, and fails with any one of them
 * moved a place either way), and that the library calls no slot missing here: a slot added below needs a check in
 * the probe. tests/test_half_kernels.py checks that the library built on them registers, runs and matches numpy.
 */
#ifndef MLA_DEPLOY_ORT_ABI_H
#define MLA_DEPLOY_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtApi OrtApi; /* opaque here: reached through ort_fn() */

typedef enum { ORT_OK, ORT_FAIL, ORT_INVALID_ARGUMENT } OrtErrorCode;
typedef enum {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 = 3,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 = 16,
} ONNXTensorElementDataType;
typedef enum { INPUT_OUTPUT_REQUIRED = 0 } OrtCustomOpInputOutputCharacteristic;
typedef enum { OrtMemTypeDefault = 0 } OrtMemType;

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* OrtCustomOp as of version 17: every field is read by onnxruntime for an op of that version. */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    ONNXTensorElementDataType (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    ONNXTensorElementDataType (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    OrtMemType (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                 void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *op, OrtShapeInferContext *context);
    int (*GetStartVersion)(const struct OrtCustomOp *op);
    int (*GetEndVersion)(const struct OrtCustomOp *op);
    size_t (*GetMayInplace)(int **input_index, int **output_index);
    void (*ReleaseMayInplace)(int *input_index, int *output_index);
    size_t (*GetAliasMap)(int **input_index, int **output_index);
    void (*ReleaseAliasMap)(int *input_index, int *output_index);
} OrtCustomOp;

#define ORT_ABI_VERSION 17 /* the first release with KernelContext_ParallelFor */

/* OrtApi slots */
enum {
    ORT_CreateStatus = 0,
    ORT_CreateCustomOpDomain = 26,
    ORT_CustomOpDomain_Add = 27,
    ORT_AddCustomOpDomain = 28,
    ORT_GetTensorMutableData = 51,
    ORT_GetTensorElementType = 60,
    ORT_GetDimensionsCount = 61,
    ORT_GetDimensions = 62,
    ORT_GetTensorTypeAndShape = 65,
    ORT_KernelInfoGetAttribute_int64 = 86,
    ORT_KernelContext_GetInput = 90,
    ORT_KernelContext_GetOutput = 91,
    ORT_ReleaseStatus = 93,
    ORT_ReleaseTensorTypeAndShapeInfo = 99,
    ORT_KernelContext_ParallelFor = 274,
};

typedef OrtStatus *(*OrtCreateStatusFn)(OrtErrorCode code, const char *msg);
typedef OrtStatus *(*OrtCreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*OrtCustomOpDomainAddFn)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*OrtAddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*OrtGetTensorMutableDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*OrtGetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo *info, ONNXTensorElementDataType *out);
typedef OrtStatus *(*OrtGetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*OrtGetDimensionsFn)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t length);
typedef OrtStatus *(*OrtGetTensorTypeAndShapeFn)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*OrtKernelContextGetInputFn)(const OrtKernelContext *context, size_t index, const OrtValue **out);
typedef OrtStatus *(*OrtKernelContextGetOutputFn)(OrtKernelContext *context, size_t index, const int64_t *dims,
                                                  size_t count, OrtValue **out);
typedef void (*OrtReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo *info);
typedef OrtStatus *(*OrtKernelInfoGetAttributeInt64Fn)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef void (*OrtReleaseStatusFn)(OrtStatus *status);
typedef OrtStatus *(*OrtKernelContextParallelForFn)(const OrtKernelContext *context, void (*fn)(void *, size_t),
                                                    size_t total, size_t num_batch, void *user_data);

/* The function in slot `slot` of onnxruntime's table (an array of function pointers), as type `type`. */
typedef void (*OrtAnyFn)(void);
#define ORT_FN(api, type, slot) ((type)(((const OrtAnyFn *)(const void *)(api))[slot]))

#endif
