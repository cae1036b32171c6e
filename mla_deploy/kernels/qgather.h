/* Rows of a quantized embedding read where they lie: out[i] = column ids[i] of W [K, N] in qmatmul.h's layout,
 * dequantized. A tied embedding is the head's W = Eᵀ [d, V] (column v is token v's row), so the embedding and the
 * head share one copy of the codes; a separate embedding table is stored the same way. Plain C: each id reads its
 * column's bytes of its group's runs, a few KiB per token. custom_ops.c wires it to onnxruntime as QGather. */
#ifndef MLA_DEPLOY_QGATHER_H
#define MLA_DEPLOY_QGATHER_H

#include <stdint.h>

#include "qmatmul.h"

/* out [K] = W[:, column] dequantized: (code - z) · scale, float32 (exact) */
void qgather_column(const QWeight *w, int64_t column, float *out);

#endif
