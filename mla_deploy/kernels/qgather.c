/* qgather.h: one column of a quantized weight, dequantized. Column c of group g sits at byte 4 c + t of every
 * 64-byte piece of the group's runs (k = 4 q + t for int8; for int4 the low nibbles hold k = 8 p + t and the high
 * ones k = 8 p + 4 + t; int6 adds each quad's high 2 bits from the run's high part), so a column is read 4 bytes at
 * a time. */
#include "qgather.h"

void qgather_column(const QWeight *w, int64_t column, float *out) {
    const int64_t g = column / QCOLS, run = qweight_run_bytes(w);
    const int c = (int)(column % QCOLS), z = 1 << (w->bits - 1), block = w->block;
    for (int64_t j = 0; j < w->kb; j++) {
        const uint8_t *codes = w->codes + (g * w->kb + j) * run + 4 * c;
        float scale = qmatmul_half_to_float(w->scales[(g * w->kb + j) * QCOLS + c]);
        int64_t start = j * block, count = w->k - start < block ? w->k - start : block;
        float values[QMAX_BLOCK];
        for (int piece = 0; piece < block / (w->bits == 8 ? 4 : 8); piece++) {
            const uint8_t *b = codes + 64 * piece, *high = codes + 8 * block + 64 * (piece / 2); /* int6's high bits */
            for (int t = 0; t < 4; t++) {
                if (w->bits == 8) {
                    values[4 * piece + t] = (float)(b[t] - z) * scale;
                } else {
                    int lo = b[t] & 0x0F, hi = b[t] >> 4;
                    if (w->bits == 6) { /* quads 2 piece and 2 piece + 1: bits 2 (quad % 4) of the high piece */
                        lo |= ((high[t] >> (4 * (piece % 2))) & 3) << 4;
                        hi |= ((high[t] >> (4 * (piece % 2) + 2)) & 3) << 4;
                    }
                    values[8 * piece + t] = (float)(lo - z) * scale;
                    values[8 * piece + 4 + t] = (float)(hi - z) * scale;
                }
            }
        }
        for (int64_t i = 0; i < count; i++) out[start + i] = values[i];
    }
}
