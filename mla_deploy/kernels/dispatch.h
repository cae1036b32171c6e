/* Which instruction set the kernels run, decided in one place for every op.
 *
 * Levels, each including the ones below it:
 *   ISA_SCALAR  plain C: any CPU (every op has a scalar reference path)
 *   ISA_AVX2    AVX2, FMA and F16C (x86-64 since Haswell / Zen 1)
 *   ISA_AVX512  AVX-512 F, BW, DQ, VL and VNNI (Ice Lake / Sapphire Rapids, Zen 4 and later)
 * AVX-512 BF16 is a separate flag (mla_cpu_has_avx512bf16), used only by paths that say so.
 *
 * The environment variable MLA_DEPLOY_ISA=scalar|avx2|avx512 caps the level (it never raises it past what the CPU
 * has), so tests force every path this CPU can run. It is read each time a kernel is created (at session load), so
 * one process can create sessions at several levels. */
#ifndef MLA_DEPLOY_DISPATCH_H
#define MLA_DEPLOY_DISPATCH_H

typedef enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 } Isa;

/* the best level this CPU has (cpuid, read once) */
Isa mla_cpu_isa(void);
/* mla_cpu_isa() capped by MLA_DEPLOY_ISA where it is set to a known level */
Isa mla_isa(void);
/* the level's name as MLA_DEPLOY_ISA spells it */
const char *mla_isa_name(Isa isa);
int mla_cpu_has_avx512bf16(void);

#endif
