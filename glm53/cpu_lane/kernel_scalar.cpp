// The portable path: baseline compiler flags, no intrinsics. Also the reference the SIMD paths are tested against.
#define GLM53_LEVEL 0
#define GLM53_NS isa_scalar
#include "kernel_impl.h"

namespace glm53 {
const IsaOps kScalarOps = {"scalar", isa_scalar::decode_tile, isa_scalar::gemv_cols, isa_scalar::prep_block,
                           isa_scalar::mid_block, isa_scalar::out_block,
    isa_scalar::gemv_cols_q, isa_scalar::prep_block_q, isa_scalar::mid_block_q};
}
