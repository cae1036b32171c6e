/* What the kernels share: their target (AVX2, FMA, F16C; the library registers nothing on a CPU without them) and
 * reading 8 values of a float32, float16 or bfloat16 array as float32. Included by the .c files that use them. */
#ifndef MLA_DEPLOY_WIDEN_H
#define MLA_DEPLOY_WIDEN_H

#include <immintrin.h>
#include <stdint.h>

#include "strip_matmul.h"

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline)) KERNEL

/* 8 consecutive values at base[i] as float32; `kind` a StripKind */
INLINE __m256 load8(const void *base, int64_t i, int kind) {
    if (kind == STRIP_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == STRIP_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* the address of element i of a `kind` array */
INLINE const void *element(const void *base, int64_t i, int kind) {
    return (const char *)base + i * strip_kind_bytes(kind);
}

#endif
