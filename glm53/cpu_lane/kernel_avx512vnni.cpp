// AVX-512 with VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): as kernel_avx512.cpp, the byte sum of the mul1
// hash in one vpdpbusd instead of two multiply-adds (about 10% faster on Zen 5).
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (`__m512i __Y = __Y;`), which -Wall reports.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define GLM53_LEVEL 2
#define GLM53_VNNI 1
#define GLM53_NS isa_avx512vnni
#include "kernel_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace glm53 {
const IsaOps kAvx512VnniOps = {"avx512vnni", isa_avx512vnni::decode_tile, isa_avx512vnni::gemv_cols, isa_avx512vnni::prep_block,
                           isa_avx512vnni::mid_block, isa_avx512vnni::out_block,
    isa_avx512vnni::gemv_cols_q, isa_avx512vnni::prep_block_q, isa_avx512vnni::mid_block_q};
}
#endif
