// AVX-512 (F, BW, VL, DQ) path: two trellis groups per vector. Chosen at run time where the CPU has it and the
// start-up calibration finds it faster (on some cores 512-bit code lowers the clock).
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (`__m512i __Y = __Y;`), which -Wall reports.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define GLM53_LEVEL 2
#define GLM53_VNNI 0
#define GLM53_NS isa_avx512
#include "kernel_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace glm53 {
const IsaOps kAvx512Ops = {"avx512", isa_avx512::decode_tile, isa_avx512::gemv_cols, isa_avx512::prep_block,
                           isa_avx512::mid_block, isa_avx512::out_block,
    isa_avx512::gemv_cols_q, isa_avx512::prep_block_q, isa_avx512::mid_block_q};
}
#endif
