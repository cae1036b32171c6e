/* dispatch.h: the CPU's level from cpuid, capped by MLA_DEPLOY_ISA. */
#include "dispatch.h"

#include <stdlib.h>
#include <string.h>

static const char *const NAMES[] = {"scalar", "avx2", "avx512"};

Isa mla_cpu_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return ISA_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512;
    return ISA_AVX2;
}

Isa mla_isa(void) {
    Isa cpu = mla_cpu_isa();
    const char *cap = getenv("MLA_DEPLOY_ISA");
    for (int level = ISA_SCALAR; cap && level <= ISA_AVX512; level++)
        if (!strcmp(cap, NAMES[level])) return (Isa)level < cpu ? (Isa)level : cpu;
    return cpu;
}

const char *mla_isa_name(Isa isa) { return NAMES[isa]; }

/* mla_isa() for Python (mla_deploy.kernels.isa): the level of a kernel created at this point */
__attribute__((visibility("default"))) int MlaDeployIsa(void) { return (int)mla_isa(); }

int mla_cpu_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}
