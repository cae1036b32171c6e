/* The instruction-set targets of the quantized kernels (qmatmul.c, qexperts.c, qgather.c): functions carry their
 * target as an attribute, so the library builds for plain x86-64 and runs each path only where dispatch.h's level
 * allows it. */
#ifndef MLA_DEPLOY_QUANT_SIMD_H
#define MLA_DEPLOY_QUANT_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define INLINE_AVX2 static inline __attribute__((always_inline)) TARGET_AVX2
#define INLINE_AVX512 static inline __attribute__((always_inline)) TARGET_AVX512

/* four bytes as one 32-bit lane (any alignment) */
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

#endif
