/* One core's rate of the quantized kernels (mla_deploy/kernels/qmatmul.c) against the core's own vpdpbusd peak,
 * timed in thread CPU time, so that other processes sharing the machine change the figures little:
 *
 *   gcc -O3 -std=gnu11 -Imla_deploy/kernels benchmarks/qmatmul_core.c mla_deploy/kernels/qmatmul.c \
 *       mla_deploy/kernels/dispatch.c -lm -o /tmp/qmatmul_core
 *   /tmp/qmatmul_core [bits block level rows K N isa]...   (isa: 0 scalar, 1 avx2, 2 avx512)
 *
 * With no arguments it runs V2-Lite's o projection (K 2048, N 2048) and a 64 MiB weight (N 16384) at 1, 8 and 512
 * rows, int4 and int8, block 32, accuracy level 4, on the best path. The peak is 16 independent 512-bit vpdpbusd
 * chains (64 int8 multiply-adds each); the weights are random bytes, which the arithmetic does not care about.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "qmatmul.h"

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* int8 multiply-adds per second of one core's vpdpbusd (0 without AVX-512 VNNI) */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni_peak(void) {
    __m512i acc[16], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
    long iterations = 50000000;
    double start = cpu_seconds();
    for (long it = 0; it < iterations; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    double seconds = cpu_seconds() - start;
    __m512i sum = acc[0];
    for (int i = 1; i < 16; i++) sum = _mm512_add_epi32(sum, acc[i]);
    volatile int keep = _mm512_reduce_add_epi32(sum);
    (void)keep;
    return 16.0 * 64.0 * (double)iterations / seconds;
}

static void run(double peak, int bits, int block, int level, long m, long k, long n, Isa isa) {
    QWeight w = {.bits = bits, .block = block, .k = k, .n = n, .kb = (k + block - 1) / block, .groups = (n + 15) / 16};
    long run_bytes = 2L * block * bits, lda = w.kb * block;
    uint8_t *codes = malloc((size_t)(w.groups * w.kb * run_bytes));
    uint16_t *scales = malloc((size_t)(w.groups * w.kb * QCOLS) * sizeof(uint16_t));
    float *a = malloc(sizeof(float) * (size_t)(m * k)), *y = malloc(sizeof(float) * (size_t)(m * n));
    float *padded = calloc((size_t)(m * lda), sizeof(float)), *a_scale = malloc(sizeof(float) * (size_t)(m * w.kb));
    int8_t *q = malloc((size_t)(m * lda));
    int32_t *offset = malloc(sizeof(int32_t) * (size_t)(m * w.kb));
    for (long i = 0; i < w.groups * w.kb * run_bytes; i++) codes[i] = (uint8_t)rand();
    for (long i = 0; i < w.groups * w.kb * QCOLS; i++) scales[i] = (uint16_t)(0x2000 + (rand() & 0x3ff));
    for (long i = 0; i < m * k; i++) a[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    w.codes = codes, w.scales = scales;
    QActs acts = {.level = level, .lda = lda, .q = q, .scale = a_scale, .offset = offset, .f = padded};
    double best = 1e30, best_rows = 1e30;
    for (int rep = 0; rep < (m * k * n > (1L << 32) ? 3 : 7); rep++) {
        double start = cpu_seconds();
        for (long r = 0; r < m; r++) {
            if (level == 4) qmatmul_quantize_row(isa, a + r * k, k, block, 1 << (bits - 1), q + r * lda, a_scale + r * w.kb,
                                                 offset + r * w.kb);
            else qmatmul_pad_row(a + r * k, k, lda, padded + r * lda);
        }
        double rows_done = cpu_seconds();
        qmatmul_rows_groups(isa, &w, &acts, 0, m, 0, w.groups, y, n);
        double done = cpu_seconds();
        if (done - rows_done < best) best = done - rows_done;
        if (rows_done - start < best_rows) best_rows = rows_done - start;
    }
    double macs = (double)m * (double)k * (double)n, bytes = (double)(w.groups * w.kb * (run_bytes + 2 * QCOLS));
    printf("int%d block %3d level %d %s M %4ld K %5ld N %6ld: %9.3f ms  %6.1f GOP/s", bits, block, level,
           mla_isa_name(isa), m, k, n, best * 1e3, 2 * macs / best / 1e9);
    if (peak > 0 && level == 4 && isa == ISA_AVX512) printf("  %3.0f %% of vpdpbusd peak", 100 * macs / best / peak);
    printf("  %5.1f GB/s of weights  (+%.3f ms quantizing A)\n", bytes / best / 1e9, best_rows * 1e3);
    free(codes), free(scales), free(a), free(y), free(padded), free(a_scale), free(q), free(offset);
}

int main(int argc, char **argv) {
    Isa isa = mla_isa();
    double peak = isa == ISA_AVX512 ? vnni_peak() : 0;
    if (peak > 0) printf("one core: %.1f G int8 multiply-adds/s (vpdpbusd, 64 per instruction)\n", peak / 1e9);
    if (argc > 1) {
        for (int i = 1; i + 6 < argc; i += 7)
            run(peak, atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]), atol(argv[i + 3]), atol(argv[i + 4]),
                atol(argv[i + 5]), (Isa)atoi(argv[i + 6]));
        return 0;
    }
    for (int bits = 4; bits <= 8; bits += 4)
        for (int s = 0; s < 2; s++)
            for (int r = 0; r < 3; r++) {
                long rows[] = {1, 8, 512};
                run(peak, bits, 32, 4, rows[r], 2048, s ? 32768 * 8 / bits : 2048, isa);
            }
    return 0;
}
