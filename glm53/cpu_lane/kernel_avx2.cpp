// AVX2 + FMA + F16C path. The target pragma (not -mavx2 on the command line) keeps the rest of the library
// baseline x86-64, so one build runs on any x86-64 CPU and picks this path at run time.
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define GLM53_LEVEL 1
#define GLM53_VNNI 0
#define GLM53_NS isa_avx2
#include "kernel_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace glm53 {
const IsaOps kAvx2Ops = {"avx2", isa_avx2::decode_tile, isa_avx2::gemv_cols, isa_avx2::prep_block,
                         isa_avx2::mid_block, isa_avx2::out_block,
    isa_avx2::gemv_cols_q, isa_avx2::prep_block_q, isa_avx2::mid_block_q};
}
#endif
