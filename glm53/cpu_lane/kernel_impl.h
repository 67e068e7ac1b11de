// The per-ISA part of the CPU expert kernel: trellis decode, the decode-and-accumulate GEMV over a range of tile
// columns, and the small 128-wide transforms around it. Included once per ISA by kernel_scalar.cpp,
// kernel_avx2[vnni].cpp and kernel_avx512[vnni].cpp with GLM53_LEVEL (0, 1, 2), GLM53_VNNI and GLM53_NS defined,
// the SIMD ones after a target pragma, so the plain loops here are also auto-vectorised for that ISA. C headers
// only (see kernel_api.h).
//
// Data flow for one linear (DESIGN section 2): x -> H(x * suh) -> x W^ -> H(.) * svh, H = blockwise 128x128
// Sylvester Hadamard / sqrt(128). W^ is never materialised: each 16x16 tile is decoded into 256 fp32 weights in
// the trellis' element order t, used at once for every activation row, and dropped. Element t = 8g + j of a tile
// sits at row 2(g%4) + (j&1) + 8((j>>1)&1), column g/4 + 8(j>>2). So the 8 weights of group g multiply the
// activation pattern p = g%4 (x[r0], x[r0+1], x[r0+8], x[r0+9], repeated; r0 = 2p) and add into the accumulator
// of column pair c = g/4: lanes 0-3 belong to column c, lanes 4-7 to column c+8. A tile costs 32 vector FMAs per
// activation row with 8 accumulators in registers; the lanes are summed once per column, at the end.
#include <math.h>
#include <string.h>
#if GLM53_LEVEL >= 1
#include <immintrin.h>
#endif
#include "kernel_api.h"

namespace glm53 {
namespace GLM53_NS {
namespace {

constexpr float kHadScale = 0.08838834764831845f;  // 1 / sqrt(128)
// Software prefetch, this many tile blocks down the same column: a unit reads a few tiles per tile row at a large
// stride (the row of tiles of the whole linear), which the hardware prefetchers do not follow.
constexpr int kPrefetchBlocks = 2;

// ---------------------------------------------------------------------------------------------------------------
// fp16 vectors (suh, svh) -> fp32

inline float half_to_float(uint16_t h) {
    // Shift the 15 exponent+mantissa bits into fp32 position and rescale by 2^112 (the exponent bias gap): exact
    // for normals and subnormals. Inf/NaN keep an all-ones exponent.
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7FFFu;
    uint32_t bits = em << 13;
    float f;
    memcpy(&f, &bits, 4);
    f *= 5.192296858534828e33f;  // 2^112
    memcpy(&bits, &f, 4);
    if (em >= 0x7C00u) bits = 0x7F800000u | (em & 0x3FFu) << 13;
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

inline void halves(const uint16_t* h, float* f, int n) {
#if GLM53_LEVEL >= 1
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#else
    for (int i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// The 128-wide transforms

inline void fwht128(float* v) {
    for (int h = 1; h < kHad; h <<= 1)
        for (int i = 0; i < kHad; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

// The 8 tile rows of one 128-block -> their activation patterns (see the header comment), 8 x 32 floats.
inline void build_xv(const float* xh, float* xv) {
    for (int q = 0; q < 8; ++q) {
        const float* s = xh + 16 * q;
        float* d = xv + 32 * q;
        for (int p = 0; p < 4; ++p) {
            const float a = s[2 * p], b = s[2 * p + 1], c = s[2 * p + 8], e = s[2 * p + 9];
            float* o = d + 8 * p;
            o[0] = a; o[1] = b; o[2] = c; o[3] = e;
            o[4] = a; o[5] = b; o[6] = c; o[7] = e;
        }
    }
}

void prep_block(const float* x, const uint16_t* suh, float* xv) {
    float s[kHad], t[kHad];
    halves(suh, s, kHad);
    for (int i = 0; i < kHad; ++i) t[i] = x[i] * s[i] * kHadScale;
    fwht128(t);
    build_xv(t, xv);
}

void mid_block(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
               const uint16_t* suh_d, float limit, float* xv) {
    float g[kHad], u[kHad], s[kHad];
    memcpy(g, graw, sizeof g);
    memcpy(u, uraw, sizeof u);
    fwht128(g);
    fwht128(u);
    halves(svh_g, s, kHad);
    for (int i = 0; i < kHad; ++i) g[i] *= s[i] * kHadScale;
    halves(svh_u, s, kHad);
    for (int i = 0; i < kHad; ++i) u[i] *= s[i] * kHadScale;
    halves(suh_d, s, kHad);
    for (int i = 0; i < kHad; ++i) {
        // exllamav3's clamped SwiGLU: min(silu(g), limit) * clamp(u, -limit, limit) (the gate is clamped after
        // the activation). Comparisons, not fminf/fmaxf, so a NaN stays a NaN instead of becoming the limit.
        float a = g[i] / (1.0f + expf(-g[i]));
        float v = u[i];
        if (limit > 0.0f) {
            a = a > limit ? limit : a;
            v = v > limit ? limit : (v < -limit ? -limit : v);
        }
        g[i] = a * v * s[i] * kHadScale;
    }
    fwht128(g);
    build_xv(g, xv);
}

void out_block(const float* yraw, const uint16_t* svh, float* out) {
    float t[kHad], s[kHad];
    memcpy(t, yraw, sizeof t);
    fwht128(t);
    halves(svh, s, kHad);
    for (int i = 0; i < kHad; ++i) out[i] = t[i] * s[i] * kHadScale;
}

// ---------------------------------------------------------------------------------------------------------------
// Trellis decode (256 weights of one tile, in element order) and the accumulation of decoded tiles into one
// (row, tile column) accumulator block. Two ways to combine them: decode a few tiles into a buffer and reuse it
// for every row (rows > 1), or FMA each group as it is decoded, with the accumulators in registers (one row: the
// decode step, where the buffer round trip would be pure overhead).

#if GLM53_LEVEL == 0

inline void decode_tile_impl(const DecodeTables& T, const uint8_t* tile, float* w) {
    uint32_t words[64];
    memcpy(words, tile, 4 * (size_t)T.words);  // little-endian words (x86, arm64)
    for (int t = 0; t < kTileElems; ++t) {
        const uint64_t m = (uint64_t)words[T.i0[t]] << 32 | words[T.i1[t]];
        const uint32_t x = ((uint32_t)(m >> T.sh[t]) & 0xFFFFu) * kMul1;
        w[t] = g_mul1_by_bytesum[(x & 0xFF) + (x >> 8 & 0xFF) + (x >> 16 & 0xFF) + (x >> 24)];
    }
}

// acc: 8 column pairs x 8 lanes (lanes 0-3: column c, 4-7: column c+8).
inline void accumulate(float* acc, const float* xv, const float* w, int nb) {
    for (int b = 0; b < nb; ++b, xv += 32, w += kTileElems)
        for (int c = 0; c < 8; ++c)
            for (int p = 0; p < 4; ++p)
                for (int j = 0; j < 8; ++j) acc[8 * c + j] += w[32 * c + 8 * p + j] * xv[8 * p + j];
}

inline void decode_accumulate1(const DecodeTables& T, const uint8_t* tile, const float* xv, float* acc, float* wbuf) {
    decode_tile_impl(T, tile, wbuf);
    accumulate(acc, xv, wbuf, 1);
}

// All rows of one tile column over a block of decoded tiles. acc: row r's block at acc + r * acc_stride; xv: row
// r's patterns at xv + r * xv_stride.
inline void accumulate_rows(float* acc, size_t acc_stride, const float* xv, size_t xv_stride, const float* w, int nb,
                            int rows) {
    for (int r = 0; r < rows; ++r) accumulate(acc + r * acc_stride, xv + r * xv_stride, w, nb);
}

inline void reduce(const float* acc, float* y) {
    for (int c = 0; c < 8; ++c) {
        y[c] = (acc[8 * c] + acc[8 * c + 1]) + (acc[8 * c + 2] + acc[8 * c + 3]);
        y[c + 8] = (acc[8 * c + 4] + acc[8 * c + 5]) + (acc[8 * c + 6] + acc[8 * c + 7]);
    }
}

#elif GLM53_LEVEL == 1

inline __m128i wrap_window(const DecodeTables& T, const uint8_t* tile) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 4 * (T.words - 2))),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile)));
}

// The decode's constants, made once per tile and hidden from the optimiser (an empty asm that "changes" them), so
// they stay in registers: otherwise GCC rematerialises each one (mov + vpbroadcastd) for every group.
struct Consts {
    __m256i m16, mul, ones8, b0;  // b0: the byte sum's start (2^23's bits with VNNI, else the madd's ones16)
    __m256 kinv, kbias;
};

inline Consts consts() {
#if GLM53_VNNI
    Consts c{_mm256_set1_epi32(0xFFFF), _mm256_set1_epi32((int)kMul1), _mm256_set1_epi8(1),
             _mm256_set1_epi32(kTwo23Bits), _mm256_set1_ps(kMul1Inv), _mm256_set1_ps(kMul1Bias23)};
#else
    Consts c{_mm256_set1_epi32(0xFFFF), _mm256_set1_epi32((int)kMul1), _mm256_set1_epi8(1), _mm256_set1_epi16(1),
             _mm256_set1_ps(kMul1Inv), _mm256_set1_ps(kMul1Bias)};
#endif
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.b0), "+v"(c.kinv), "+v"(c.kbias));
    return c;
}

// Group g's 8 weights. mul1: x = s * 0x83DCD12D, b = the byte sum of x (two widening multiply-adds),
// w = fp16(b * k_inv + (1024 k_inv + k_bias)). The fp32 FMA is exact (|value| < 2^20 units of 2^-18), so the
// single fp16 rounding is exactly the GPU kernel's __hfma rounding: the weights are bit-identical to exllamav3's.
// Only groups 0 and 1 can wrap (kernel.cpp checks); the others broadcast their window straight from memory (one
// load, no shuffle).
inline __m256 group_values(const DecodeTables& T, const Consts& k, const uint8_t* tile, __m128i wrap, int g) {
    const __m128i* at = reinterpret_cast<const __m128i*>(tile + 4 * T.base[g]);
    const __m256i win = g >= 2 ? _mm256_broadcastsi128_si256(_mm_loadu_si128(at))
                               : _mm256_broadcastsi128_si256(g < T.nwrap ? wrap : _mm_loadu_si128(at));
    const __m256i d = _mm256_shuffle_epi8(win, _mm256_load_si256(reinterpret_cast<const __m256i*>(T.ctrl[g])));
    const __m256i s =
        _mm256_and_si256(_mm256_srlv_epi32(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(T.shift[g]))), k.m16);
    const __m256i x = _mm256_mullo_epi32(s, k.mul);
#if GLM53_VNNI
    // AVX-VNNI (Alder Lake and later, Zen 5): the byte sum in one vpdpbusd onto the bits of 2^23, read as a float.
    const __m256 v = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_dpbusd_avx_epi32(k.b0, x, k.ones8)), k.kinv, k.kbias);
#else
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(x, k.ones8), k.b0);
    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), k.kinv, k.kbias);
#endif
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, 0));  // 0: round to nearest even
}

inline void decode_tile_impl(const DecodeTables& T, const uint8_t* tile, float* w) {
    const Consts k = consts();
    const __m128i wrap = wrap_window(T, tile);
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) _mm256_storeu_ps(w + 8 * g, group_values(T, k, tile, wrap, g));
}

inline void accumulate(float* acc, const float* xv, const float* w, int nb) {
    __m256 s[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) s[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int b = 0; b < nb; ++b, xv += 32, w += kTileElems) {
        const __m256 x0 = _mm256_loadu_ps(xv), x1 = _mm256_loadu_ps(xv + 8);
        const __m256 x2 = _mm256_loadu_ps(xv + 16), x3 = _mm256_loadu_ps(xv + 24);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            const float* wc = w + 32 * c;
            s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(wc), x0, s[c]);
            s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(wc + 8), x1, s[c]);
            s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(wc + 16), x2, s[c]);
            s[c] = _mm256_fmadd_ps(_mm256_loadu_ps(wc + 24), x3, s[c]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 8 * c, s[c]);
}

// One row: the same as decode + accumulate. (Fusing them, as the AVX-512 path does, needs 18 live vectors: with
// 16 registers the spills made it slower.)
inline void decode_accumulate1(const DecodeTables& T, const uint8_t* tile, const float* xv, float* acc, float* wbuf) {
    decode_tile_impl(T, tile, wbuf);
    accumulate(acc, xv, wbuf, 1);
}

// All rows of one tile column over a block of decoded tiles. acc: row r's block at acc + r * acc_stride; xv: row
// r's patterns at xv + r * xv_stride.
inline void accumulate_rows(float* acc, size_t acc_stride, const float* xv, size_t xv_stride, const float* w, int nb,
                            int rows) {
    for (int r = 0; r < rows; ++r) accumulate(acc + r * acc_stride, xv + r * xv_stride, w, nb);
}

inline void reduce(const float* acc, float* y) {
    for (int c = 0; c < 8; ++c) {
        y[c] = (acc[8 * c] + acc[8 * c + 1]) + (acc[8 * c + 2] + acc[8 * c + 3]);
        y[c + 8] = (acc[8 * c + 4] + acc[8 * c + 5]) + (acc[8 * c + 6] + acc[8 * c + 7]);
    }
}

#else  // GLM53_LEVEL == 2: two groups per 512-bit vector

inline __m128i wrap_window(const DecodeTables& T, const uint8_t* tile) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 4 * (T.words - 2))),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile)));
}

inline __m128i window(const uint8_t* tile, int base) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 4 * base));
}

// As in the AVX2 path: constants kept in registers.
struct Consts {
    __m512i m16, mul, ones8, b0;  // b0: the byte sum's start (2^23's bits with VNNI, else the madd's ones16)
    __m512 kinv, kbias;
};

inline Consts consts() {
#if GLM53_VNNI
    Consts c{_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)kMul1), _mm512_set1_epi8(1),
             _mm512_set1_epi32(kTwo23Bits), _mm512_set1_ps(kMul1Inv), _mm512_set1_ps(kMul1Bias23)};
#else
    Consts c{_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)kMul1), _mm512_set1_epi8(1),
             _mm512_set1_epi16(1), _mm512_set1_ps(kMul1Inv), _mm512_set1_ps(kMul1Bias)};
#endif
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.b0), "+v"(c.kinv), "+v"(c.kbias));
    return c;
}

// Groups 2p and 2p+1 (16 weights), as group_values in the AVX2 path.
inline __m512 pair_values(const DecodeTables& T, const Consts& k, const uint8_t* tile, __m128i wrap, int p) {
    __m512i d;
    if (T.pair_ok) {  // only pair 0 can wrap (kernel.cpp checks)
        const __m128i src = p > 0 ? window(tile, T.pair_base[p]) : T.pair_nwrap ? wrap : window(tile, T.pair_base[0]);
        d = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(src), _mm512_load_si512(T.pair_ctrl[p]));
    } else {
        const int g = 2 * p;
        const __m128i s0 = g >= 2 || g >= T.nwrap ? window(tile, T.base[g]) : wrap;
        const __m128i s1 = g + 1 >= 2 || g + 1 >= T.nwrap ? window(tile, T.base[g + 1]) : wrap;
        const __m512i win = _mm512_inserti64x4(_mm512_broadcast_i32x4(s0), _mm256_broadcastsi128_si256(s1), 1);
        d = _mm512_shuffle_epi8(win, _mm512_load_si512(T.ctrl[g]));
    }
    const __m512i s = _mm512_and_si512(_mm512_srlv_epi32(d, _mm512_load_si512(T.shift[2 * p])), k.m16);
    const __m512i x = _mm512_mullo_epi32(s, k.mul);
#if GLM53_VNNI
    // The byte sum in one instruction, accumulated onto the bits of 2^23, so it reads as the float 2^23 + b
    // with no conversion (kernel_api.h: kMul1Bias23).
    const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_dpbusd_epi32(k.b0, x, k.ones8)), k.kinv, k.kbias);
#else
    const __m512i b = _mm512_madd_epi16(_mm512_maddubs_epi16(x, k.ones8), k.b0);
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), k.kinv, k.kbias);
#endif
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, 0));
}

inline void decode_tile_impl(const DecodeTables& T, const uint8_t* tile, float* w) {
    const Consts k = consts();
    const __m128i wrap = wrap_window(T, tile);
#pragma GCC unroll 4
    for (int p = 0; p < kGroups / 2; ++p) _mm512_storeu_ps(w + 16 * p, pair_values(T, k, tile, wrap, p));
}

// acc: 8 column pairs x 16 lanes: groups 4c and 4c+1 (patterns 0, 1) in one vector, 4c+2 and 4c+3 (patterns 2,
// 3) in the next FMA; lanes 0-3 and 8-11 belong to column c, 4-7 and 12-15 to column c+8.
inline void accumulate(float* acc, const float* xv, const float* w, int nb) {
    __m512 s[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) s[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int b = 0; b < nb; ++b, xv += 32, w += kTileElems) {
        const __m512 x01 = _mm512_loadu_ps(xv), x23 = _mm512_loadu_ps(xv + 16);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            s[c] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32 * c), x01, s[c]);
            s[c] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32 * c + 16), x23, s[c]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm512_storeu_ps(acc + 16 * c, s[c]);
}

// Two rows at once: each weight vector is loaded once for both (loads, not FMAs, bound the one-row loop at 8 rows).
inline void accumulate2(float* acc0, float* acc1, const float* xv0, const float* xv1, const float* w, int nb) {
    __m512 s0[8], s1[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
        s0[c] = _mm512_loadu_ps(acc0 + 16 * c);
        s1[c] = _mm512_loadu_ps(acc1 + 16 * c);
    }
    for (int b = 0; b < nb; ++b, xv0 += 32, xv1 += 32, w += kTileElems) {
        const __m512 a01 = _mm512_loadu_ps(xv0), a23 = _mm512_loadu_ps(xv0 + 16);
        const __m512 b01 = _mm512_loadu_ps(xv1), b23 = _mm512_loadu_ps(xv1 + 16);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            const __m512 w01 = _mm512_loadu_ps(w + 32 * c), w23 = _mm512_loadu_ps(w + 32 * c + 16);
            s0[c] = _mm512_fmadd_ps(w23, a23, _mm512_fmadd_ps(w01, a01, s0[c]));
            s1[c] = _mm512_fmadd_ps(w23, b23, _mm512_fmadd_ps(w01, b01, s1[c]));
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
        _mm512_storeu_ps(acc0 + 16 * c, s0[c]);
        _mm512_storeu_ps(acc1 + 16 * c, s1[c]);
    }
}

inline void accumulate_rows(float* acc, size_t acc_stride, const float* xv, size_t xv_stride, const float* w, int nb,
                            int rows) {
    int r = 0;
    for (; r + 1 < rows; r += 2)
        accumulate2(acc + r * acc_stride, acc + (r + 1) * acc_stride, xv + r * xv_stride, xv + (r + 1) * xv_stride, w, nb);
    if (r < rows) accumulate(acc + r * acc_stride, xv + r * xv_stride, w, nb);
}

inline void decode_accumulate1(const DecodeTables& T, const uint8_t* tile, const float* xv, float* acc, float*) {
    const Consts k = consts();
    const __m128i wrap = wrap_window(T, tile);
    const __m512 x01 = _mm512_loadu_ps(xv), x23 = _mm512_loadu_ps(xv + 16);
    __m512 s[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) s[c] = _mm512_loadu_ps(acc + 16 * c);
#pragma GCC unroll 16
    for (int p = 0; p < kGroups / 2; ++p) s[p >> 1] = _mm512_fmadd_ps(pair_values(T, k, tile, wrap, p), p & 1 ? x23 : x01, s[p >> 1]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm512_storeu_ps(acc + 16 * c, s[c]);
}

inline void reduce(const float* acc, float* y) {
    for (int c = 0; c < 8; ++c) {
        const float* a = acc + 16 * c;
        y[c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[8] + a[9]) + (a[10] + a[11]));
        y[c + 8] = ((a[4] + a[5]) + (a[6] + a[7])) + ((a[12] + a[13]) + (a[14] + a[15]));
    }
}

#endif

void decode_tile(const DecodeTables& T, const uint8_t* tile, float* w) { decode_tile_impl(T, tile, w); }

// Decode-and-accumulate for tile columns [tn0, tn1) of one linear. Tiles are taken kTileBlock rows at a time
// down each column, walking the columns left to right, so a thread reads kTileBlock sequential streams (one per
// tile row) and the accumulators of a (row, column) are loaded and stored once per block.
void gemv_cols(const GemvArgs& a) {
    const DecodeTables& T = *a.tab;
    const int ncol = a.tn1 - a.tn0;
    const size_t rstride = (size_t)a.tiles_n * (size_t)a.tile_bytes;
    memset(a.acc, 0, sizeof(float) * (size_t)a.rows * (size_t)ncol * kAccFloats);
    for (int tk0 = 0; tk0 < a.tiles_k; tk0 += kTileBlock) {
        if (*a.cancel) return;
        const int nb = a.tiles_k - tk0 < kTileBlock ? a.tiles_k - tk0 : kTileBlock;
        for (int c = 0; c < ncol; ++c) {
            const uint8_t* tile = a.trellis + (size_t)tk0 * rstride + (size_t)(a.tn0 + c) * (size_t)a.tile_bytes;
            if (tk0 + kPrefetchBlocks * kTileBlock < a.tiles_k)
                for (int b = 0; b < nb; ++b) {
                    const uint8_t* ahead = tile + (size_t)(b + kPrefetchBlocks * kTileBlock) * rstride;
                    __builtin_prefetch(ahead);
                    __builtin_prefetch(ahead + a.tile_bytes - 1);
                    for (int off = 64; off < a.tile_bytes - 1; off += 64) __builtin_prefetch(ahead + off);
                }
            if (a.rows == 1) {
                for (int b = 0; b < nb; ++b)
                    decode_accumulate1(T, tile + (size_t)b * rstride, a.xv + (size_t)(tk0 + b) * 32,
                                       a.acc + (size_t)c * kAccFloats, a.wbuf);
                continue;
            }
            for (int b = 0; b < nb; ++b) decode_tile_impl(T, tile + (size_t)b * rstride, a.wbuf + (size_t)b * kTileElems);
            accumulate_rows(a.acc + (size_t)c * kAccFloats, (size_t)ncol * kAccFloats, a.xv + (size_t)tk0 * 32,
                            (size_t)a.tiles_k * 32, a.wbuf, nb, a.rows);
        }
    }
    for (int r = 0; r < a.rows; ++r)
        for (int c = 0; c < ncol; ++c)
            reduce(a.acc + ((size_t)r * ncol + c) * kAccFloats, a.yraw + (size_t)r * a.ystride + 16 * (a.tn0 + c));
}

}  // namespace
}  // namespace GLM53_NS
}  // namespace glm53
