/* qgather.h: one column of a quantized weight, dequantized, its codes read one at a time by qweight_code (column c
 * of a group sits at byte 4 c + t of every 64-byte piece of the group's runs, so a column is a few KiB of reads). */
#include "qgather.h"

void qgather_column(const QWeight *w, int64_t column, float *out) {
    const int64_t g = column / QCOLS, run = qweight_run_bytes(w);
    const int c = (int)(column % QCOLS), z = 1 << (w->bits - 1), block = w->block;
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *codes = w->codes + (g * w->kb + j) * run;
        float scale = qmatmul_half_to_float(w->scales[(g * w->kb + j) * QCOLS + c]);
        int64_t start = j * block, count = w->k - start < block ? w->k - start : block;
        for (int kk = 0; kk < count; kk++)
            out[start + kk] = (float)(qweight_code(codes, w->bits, block, kk, c) - z) * scale;
    }
}
