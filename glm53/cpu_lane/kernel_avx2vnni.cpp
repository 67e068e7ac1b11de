// AVX2 with AVX-VNNI (Intel Alder Lake and later desktops, which have no AVX-512; Zen 5): as kernel_avx2.cpp, the
// byte sum of the mul1 hash in one vpdpbusd.
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
#define GLM53_LEVEL 1
#define GLM53_VNNI 1
#define GLM53_NS isa_avx2vnni
#include "kernel_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace glm53 {
const IsaOps kAvx2VnniOps = {"avx2vnni", isa_avx2vnni::decode_tile, isa_avx2vnni::gemv_cols, isa_avx2vnni::prep_block,
                         isa_avx2vnni::mid_block, isa_avx2vnni::out_block,
    isa_avx2vnni::gemv_cols_q, isa_avx2vnni::prep_block_q, isa_avx2vnni::mid_block_q};
}
#endif
