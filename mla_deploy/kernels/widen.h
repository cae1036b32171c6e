/* What the kernels share: reading 8 or 16 values of a float32, float16 or bfloat16 array as float32 (AVX2 + F16C,
 * AVX-512), one value in plain C, and e^x 8 at a time. Each SIMD function carries its own target, so the library
 * builds for any x86-64 and dispatch.h picks what runs. Included by the .c files that use them. */
#ifndef MLA_DEPLOY_WIDEN_H
#define MLA_DEPLOY_WIDEN_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "strip_matmul.h"

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define KERNEL512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define INLINE512 static inline __attribute__((always_inline)) KERNEL512

/* 8 consecutive values at base[i] as float32; `kind` a StripKind */
INLINE __m256 load8(const void *base, int64_t i, int kind) {
    if (kind == STRIP_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == STRIP_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* 16 consecutive values at base[i] as float32 */
INLINE512 __m512 load16(const void *base, int64_t i, int kind) {
    if (kind == STRIP_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (kind == STRIP_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* the address of element i of a `kind` array */
static inline const void *element(const void *base, int64_t i, int kind) {
    return (const char *)base + i * strip_kind_bytes(kind);
}

/* base[i] as float32, in plain C: float16's subnormals are m 2^-24, its infinities and NaNs keep their bits */
static inline float stored_value(const void *base, int64_t i, int kind) {
    if (kind == STRIP_F32) return ((const float *)base)[i];
    uint32_t h = ((const uint16_t *)base)[i], bits;
    if (kind == STRIP_BF16) {
        bits = h << 16;
    } else {
        uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
        if (exponent == 0) return (sign ? -1.0f : 1.0f) * (float)mantissa * 0x1p-24f;
        bits = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x, 8 at a time: x = n ln 2 + r, a degree-6 polynomial for e^r on |r| <= ln 2 / 2 (Cephes' expf; relative error
 * ~2e-7), x clamped to [-87.3, 88.3] (e^-87.3 ~ 1e-38: a softmax's far tail, a SiLU's vanishing gate); e^NaN is
 * NaN, as expf's */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x)); /* a NaN stays NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts: r exact to float32 */
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

#endif
