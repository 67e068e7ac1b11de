// The CPU expert kernel's C ABI (loaded from Python with ctypes) and the interface between its generic driver
// (kernel.cpp, compiled for baseline x86-64) and the per-ISA code (kernel_impl.h, compiled once per ISA).
//
// Only C headers here: kernel_impl.h is compiled under `#pragma GCC target(...)`, and any C++ inline function or
// template it pulled in would be emitted with AVX instructions as a COMDAT symbol that the linker may pick for
// the baseline code too (a SIGILL on an older CPU). Plain structs and function pointers cannot leak that way.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One EXL3 linear, y = x W with W (in x out): trellis int16 (in/16, out/16, 16*K), suh fp16 (in), svh fp16 (out).
typedef struct Glm53Linear {
    const int16_t* trellis;
    const uint16_t* suh;
    const uint16_t* svh;
    int32_t in_features;
    int32_t out_features;
    int32_t k_bits;
    int32_t reserved;
} Glm53Linear;

// One routed expert applied to `rows` activation rows: out = down(swiglu(gate(x), up(x))), float32 row-major.
typedef struct Glm53Job {
    Glm53Linear gate;
    Glm53Linear up;
    Glm53Linear down;
    const float* x;     // (rows, hidden)
    float* out;         // (rows, hidden)
    int32_t rows;
    float swiglu_limit; // 0 disables the clamp
} Glm53Job;

// Codes are part of the ABI (kernel.py's ISA_CODES); new paths get new numbers.
enum { GLM53_ISA_SCALAR = 0, GLM53_ISA_AVX2 = 1, GLM53_ISA_AVX512 = 2, GLM53_ISA_AVX512VNNI = 3, GLM53_ISA_AVX2VNNI = 4 };
// OR'ed into the isa argument of glm53_run / glm53_isa_supported: the integer kernel of that ISA (kernel_impl.h,
// "The integer kernel") instead of the exact one. A build without it answers "not supported", so an older
// library (bench cpu-lane --baseline-lib) still runs its exact kernel under the same ABI.
enum { GLM53_KERNEL_INT = 0x100, GLM53_ISA_MASK = 0xFF };

#ifdef __cplusplus
}

namespace glm53 {

constexpr int kTileElems = 256;  // a 16x16 tile
constexpr int kGroups = 32;      // 8 consecutive trellis elements per group (one mma lane's fragment)
constexpr int kHad = 128;        // Hadamard block
constexpr int kTileBlock = 4;    // tiles decoded per column before the FMAs reuse them across rows
constexpr int kAccFloats = 128;  // accumulator floats per (row, tile column): 8 vectors of up to 16 lanes
constexpr uint32_t kMul1 = 0x83DCD12Du;
constexpr int kQBlock = 8;       // integer kernel: tiles down a column per activation scale (one 128-block)
constexpr int kXq = 48;          // integer kernel: int32 activation patterns per tile row (kernel_impl.h)

// Where each element's 16-bit trellis state sits, for one K (built once per K by kernel.cpp).
// SIMD paths: group g (elements 8g..8g+7) reads a 16-byte window (4 words from word base[g], or for the first
// `nwrap` groups the tail-biting window [w[n-2], w[n-1], w[0], w[1]]); `ctrl` is a pshufb control that puts the
// three stream bytes holding each element's window, most significant first, into bytes 3..1 of its dword, and
// `shift` then right-aligns the 16 bits. Scalar path: state = ((w[i0] << 32 | w[i1]) >> sh) & 0xFFFF.
struct DecodeTables {
    int k;
    int words;   // 32-bit words per tile: 8K
    int nwrap;
    int32_t base[kGroups];
    alignas(64) uint8_t ctrl[kGroups][32];
    alignas(64) uint32_t shift[kGroups][8];
    // AVX-512: when one 16-byte window holds both groups of a pair (2p, 2p+1), as for K <= 4, a single broadcast
    // load serves 16 elements; pair_ok says it does for this K, pair_nwrap how many pairs use the wrap window.
    int pair_ok;
    int pair_nwrap;
    int32_t pair_base[kGroups / 2];
    alignas(64) uint8_t pair_ctrl[kGroups / 2][64];
    uint16_t i0[kTileElems];
    uint16_t i1[kTileElems];
    uint8_t sh[kTileElems];
};

// mul1 weight for each byte sum b = 0..1020 of s * 0x83DCD12D: fp16(fp16(1024 + b) * 0x1EEE + 0xC931), exact.
extern float g_mul1_by_bytesum[1024];
constexpr float kMul1Inv = 1774.0f / 262144.0f;                  // fp16 0x1EEE = 1774 * 2^-18
constexpr float kMul1Bias = 1024.0f * kMul1Inv - 1329.0f / 128.0f;  // 1024 * k_inv + fp16 0xC931, exact in fp32
// The VNNI path makes b a float without a conversion: the bits 0x4B000000 + b read as 2^23 + b, and
// fma(2^23 + b, k_inv, kMul1Bias - 2^23 k_inv) is exactly b * k_inv + kMul1Bias (the bias is exact in fp32:
// -56771.453125 needs 22 significant bits; the fused result is exact, so its single rounding changes nothing).
constexpr int32_t kTwo23Bits = 0x4B000000;
constexpr float kMul1Bias23 = kMul1Bias - 8388608.0f * kMul1Inv;

struct GemvArgs {
    const DecodeTables* tab;
    const uint8_t* trellis;
    int tiles_k, tiles_n, tile_bytes;
    const float* xv;   // (rows, tiles_k, 32): per tile row, the 4 activation patterns a group multiplies
    int rows;
    int tn0, tn1;      // tile columns of this work unit
    float* acc;        // scratch: rows * (tn1 - tn0) * kAccFloats
    float* wbuf;       // scratch: kTileBlock * 256
    float* yraw;       // (rows, ystride): raw outputs before the output transform
    int ystride;
    const volatile int32_t* cancel;
    // The integer kernel: xv holds kXq int32 patterns per tile row (int16 activations, quantize_block), and qs,
    // per row and 128-block of the input (rows, tiles_k / 8, 2), the block's {scale * k_inv, scale * sum(q) * bias}.
    const float* qs;
};

struct IsaOps {
    const char* name;
    void (*decode_tile)(const DecodeTables&, const uint8_t* tile, float* w);  // 256 weights in element order
    void (*gemv_cols)(const GemvArgs&);
    // x (128) * suh -> Hadamard -> the xv patterns of the block's 8 tile rows (8 * 32 floats).
    void (*prep_block)(const float* x, const uint16_t* suh, float* xv);
    // The middle of one 128-block of the intermediate: gate/up output transforms, clamped SwiGLU, the down
    // projection's input transform, and its xv patterns.
    void (*mid_block)(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
                      const uint16_t* suh_d, float limit, float* xv);
    // Output transform of one 128-block: Hadamard(yraw) * svh -> out.
    void (*out_block)(const float* yraw, const uint16_t* svh, float* out);
    // The integer kernel (null where this ISA has none): the GEMV over int16 activations, and prep_block /
    // mid_block ending in the block's quantization (xq: 8 * kXq int32 patterns, qs: its 2 floats).
    void (*gemv_cols_q)(const GemvArgs&);
    void (*prep_block_q)(const float* x, const uint16_t* suh, int32_t* xq, float* qs);
    void (*mid_block_q)(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
                        const uint16_t* suh_d, float limit, int32_t* xq, float* qs);
};

extern const IsaOps kScalarOps;
#if defined(__x86_64__)
extern const IsaOps kAvx2Ops;
extern const IsaOps kAvx2VnniOps;
extern const IsaOps kAvx512Ops;
extern const IsaOps kAvx512VnniOps;
#endif

}  // namespace glm53
#endif
