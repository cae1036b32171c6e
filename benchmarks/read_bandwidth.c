/* How fast this machine's cores can stream memory at all: a plain read loop (512-bit loads, four independent
 * chains, nothing computed, the lines asked for PREFETCH_BYTES ahead as the kernels do) over 256 MiB split between
 * THREADS threads, five runs. The ceiling a bandwidth-bound decode step is held to; onnxruntime's MatMul probe
 * (mla_deploy.bench.bandwidth) measures a real product instead.
 *
 *   gcc -O3 -pthread benchmarks/read_bandwidth.c -o /tmp/read_bandwidth && /tmp/read_bandwidth [THREADS]
 *   (-DPREFETCH_BYTES=0: the hardware prefetchers alone)
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef PREFETCH_BYTES /* as the quantized kernels ask for their weights (qmatmul.c); -DPREFETCH_BYTES=0: none */
#define PREFETCH_BYTES 2048
#endif

typedef struct {
    const char *p;
    long n;
    long long sum;
} Slice;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) static void *read_slice(void *arg) {
    Slice *s = arg;
    __m512i a = _mm512_setzero_si512(), b = a;
    for (long i = 0; i < s->n; i += 256) {
        for (int line = 0; line < 256; line += 64) _mm_prefetch(s->p + i + PREFETCH_BYTES + line, _MM_HINT_T0);
        a = _mm512_xor_si512(a, _mm512_xor_si512(_mm512_load_si512(s->p + i), _mm512_load_si512(s->p + i + 128)));
        b = _mm512_xor_si512(b, _mm512_xor_si512(_mm512_load_si512(s->p + i + 64), _mm512_load_si512(s->p + i + 192)));
    }
    s->sum = _mm512_reduce_add_epi64(_mm512_xor_si512(a, b));
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "THREADS must be 1 to 64\n");
        return 2;
    }
    if (!__builtin_cpu_supports("avx512f")) {
        fprintf(stderr, "this loop reads with AVX-512 loads, which this CPU lacks\n");
        return 2;
    }
    long bytes = 256L << 20, slice = bytes / threads / 256 * 256;
    char *p = aligned_alloc(64, (size_t)bytes);
    for (long i = 0; i < bytes; i++) p[i] = (char)i; /* every page real, none the shared zero page */
    for (int run = 0; run < 5; run++) {
        pthread_t t[64];
        Slice s[64];
        double start = now();
        for (int i = 0; i < threads; i++) {
            s[i] = (Slice){.p = p + i * slice, .n = slice};
            pthread_create(&t[i], NULL, read_slice, &s[i]);
        }
        for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
        printf("%d thread(s): %.1f GB/s\n", threads, (double)(slice * threads) / (now() - start) / 1e9);
    }
    free(p);
    return 0;
}
