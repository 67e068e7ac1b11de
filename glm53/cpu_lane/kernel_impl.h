// The per-ISA part of the CPU expert kernel: trellis decode, the decode-and-accumulate GEMV over a range of tile
// columns, and the small 128-wide transforms around it. Included once per ISA by kernel_scalar.cpp,
// kernel_avx2[vnni].cpp and kernel_avx512[vnni].cpp with GLM53_LEVEL (0, 1, 2), GLM53_VNNI and GLM53_NS defined,
// the SIMD ones after a target pragma, so the plain loops here are also auto-vectorised for that ISA. C headers
// only (see kernel_api.h).
//
// Data flow for one linear (glm53/exl3ref.py describes EXL3): x -> H(x * suh) -> x W^ -> H(.) * svh, H = blockwise 128x128
// Sylvester Hadamard / sqrt(128). W^ is never materialised: each 16x16 tile is decoded into 256 fp32 weights in
// the trellis' element order t, used at once for every activation row, and dropped. Element t = 8g + j of a tile
// sits at row 2(g%4) + (j&1) + 8((j>>1)&1), column g/4 + 8(j>>2). So the 8 weights of group g multiply the
// activation pattern p = g%4 (x[r0], x[r0+1], x[r0+8], x[r0+9], repeated; r0 = 2p) and add into the accumulator
// of column pair c = g/4: lanes 0-3 belong to column c, lanes 4-7 to column c+8. A tile costs 32 (AVX2) or 16
// (AVX-512) vector FMAs per activation row into 8 column-pair accumulators; the lanes are summed once per column,
// at the end.
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

// x (128) * suh -> Hadamard: the block's transformed activations t.
inline void prep_transform(const float* x, const uint16_t* suh, float* t) {
    float s[kHad];
    halves(suh, s, kHad);
    for (int i = 0; i < kHad; ++i) t[i] = x[i] * s[i] * kHadScale;
    fwht128(t);
}

// One 128-block of the intermediate -> the down projection's transformed activations g.
inline void mid_transform(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
                          const uint16_t* suh_d, float limit, float* g) {
    float u[kHad], s[kHad];
    memcpy(g, graw, sizeof u);
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
}

void prep_block(const float* x, const uint16_t* suh, float* xv) {
    float t[kHad];
    prep_transform(x, suh, t);
    build_xv(t, xv);
}

void mid_block(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
               const uint16_t* suh_d, float limit, float* xv) {
    float g[kHad];
    mid_transform(graw, uraw, svh_g, svh_u, suh_d, limit, g);
    build_xv(g, xv);
}

// The integer kernel's activations: one 128-block of transformed activations t -> int16 values
// q = round(t / scale), scale = max|t| / 32767, in two layouts per tile row (kXq = 48 int32): first each value
// twice in an int32 (low and high half), in the xv pattern layout (build_xv: 4 patterns x 8 lanes), then the 16
// int32 of the paired layout (two patterns' values in the halves of one int32, see gemv_rows_q), and
// qs = {scale * k_inv, scale * sum(q) * bias}: the block adds
// k_inv * scale * sum(b * q) + bias * scale * sum(q) to each output, b the weights' byte sums (see "The integer
// kernel" below). 16 bits because 8 (exllamav3's CPU kernel, ~1% error) is far above the GPU kernel's own error;
// 16-bit values need one vpmaddwd per 8 weights (AVX2) where 8-bit ones would need two instructions too.
// A block holding a NaN or an infinity gets a NaN scale, so the outputs it reaches are NaN, as in the exact
// kernel; a block below 2^-100 counts as zero (its contribution is below fp32's resolution of any output).
constexpr float kQMax = 32767.0f;
constexpr float kQTiny = 7.888609052210118e-31f;  // 2^-100

inline void quantize_block(const float* t, int32_t* xq, float* qs) {
    float amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < kHad; ++i) {
        const float a = fabsf(t[i]);
        bad |= !(a <= 3.4028234663852886e38f);  // NaN or inf
        amax = a > amax ? a : amax;
    }
    int32_t q[kHad];
    int32_t sum = 0;
    if (bad || amax < kQTiny) {
        memset(q, 0, sizeof q);
        qs[0] = qs[1] = bad ? __builtin_nanf("") : 0.0f;
    } else {
        const float scale = amax / kQMax, inv = kQMax / amax;
        for (int i = 0; i < kHad; ++i) {
            // t * inv rounds to at most 32767 * (1 + 2^-23): lrintf (round to nearest even) stays in range.
            const int32_t v = (int32_t)lrintf(t[i] * inv);
            q[i] = v > 32767 ? 32767 : (v < -32767 ? -32767 : v);
            sum += q[i];
        }
        qs[0] = scale * kMul1Inv;
        qs[1] = (float)sum * scale * kMul1Bias;  // |sum| <= 128 * 32767 < 2^24: exact as a float
    }
    for (int qq = 0; qq < 8; ++qq) {
        const int32_t* s = q + 16 * qq;
        int32_t* d = xq + kXq * qq;
        uint32_t pat[4][8];  // pattern p, lane j (build_xv)
        for (int p = 0; p < 4; ++p) {
            const int32_t v[4] = {s[2 * p], s[2 * p + 1], s[2 * p + 8], s[2 * p + 9]};
            for (int j = 0; j < 8; ++j) pat[p][j] = (uint32_t)v[j & 3] & 0xFFFFu;
        }
        for (int p = 0; p < 4; ++p)
            for (int j = 0; j < 8; ++j) d[8 * p + j] = (int32_t)(pat[p][j] | pat[p][j] << 16);
        // Paired: AVX2 pairs the vectors of patterns (0, 1) and (2, 3), AVX-512 (whose vectors hold patterns 0 and
        // 1, or 2 and 3, in their halves) the vectors of (0 | 1, 2 | 3): the low half takes the first pattern.
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 8; ++j) {
#if GLM53_LEVEL == 2
                const int lo = h, hi = h + 2;
#else
                const int lo = 2 * h, hi = 2 * h + 1;
#endif
                d[32 + 8 * h + j] = (int32_t)(pat[lo][j] | pat[hi][j] << 16);
            }
    }
}

void prep_block_q(const float* x, const uint16_t* suh, int32_t* xq, float* qs) {
    float t[kHad];
    prep_transform(x, suh, t);
    quantize_block(t, xq, qs);
}

void mid_block_q(const float* graw, const float* uraw, const uint16_t* svh_g, const uint16_t* svh_u,
                 const uint16_t* suh_d, float limit, int32_t* xq, float* qs) {
    float g[kHad];
    mid_transform(graw, uraw, svh_g, svh_u, suh_d, limit, g);
    quantize_block(g, xq, qs);
}

void out_block(const float* yraw, const uint16_t* svh, float* out) {
    float t[kHad], s[kHad];
    memcpy(t, yraw, sizeof t);
    fwht128(t);
    halves(svh, s, kHad);
    for (int i = 0; i < kHad; ++i) out[i] = t[i] * s[i] * kHadScale;
}

// ---------------------------------------------------------------------------------------------------------------
// Trellis decode and the decode-and-accumulate GEMV.
//
// The scalar path decodes a few tiles into a buffer and runs every row over it. The SIMD paths never store a
// decoded weight: a tile's weights are decoded into registers (a "vector" below: one group of 8 weights for AVX2,
// a pair of groups for AVX-512) and each is applied at once to every row of the row group, whose accumulators stay
// in registers for a block of kBlockK tiles down the column. So the decode is paid once per tile whatever the
// rows, and an extra row costs its FMAs (one per vector) and the load of its activation pattern. With more rows
// a visit covers fewer column pairs (the accumulators are rows x pairs registers), and the tile is visited once
// per column-pair group: the decode is split between visits, never repeated.
//
// Every (row, column pair) accumulator sees the same FMAs in the same order (tile by tile down the column; within
// a tile, the pattern vectors in order) whatever the row count, the grouping or the thread, so a row's result
// does not depend on which other rows share its call.

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

inline void reduce(const float* acc, float* y) {
    for (int c = 0; c < 8; ++c) {
        y[c] = (acc[8 * c] + acc[8 * c + 1]) + (acc[8 * c + 2] + acc[8 * c + 3]);
        y[c + 8] = (acc[8 * c + 4] + acc[8 * c + 5]) + (acc[8 * c + 6] + acc[8 * c + 7]);
    }
}

void decode_tile(const DecodeTables& T, const uint8_t* tile, float* w) { decode_tile_impl(T, tile, w); }

// Tiles are taken kTileBlock rows at a time down each column, walking the columns left to right; each block is
// decoded once into wbuf and every row runs over it.
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
            for (int b = 0; b < nb; ++b)
                decode_tile_impl(T, tile + (size_t)b * rstride, a.wbuf + (size_t)b * kTileElems);
            for (int r = 0; r < a.rows; ++r)
                accumulate(a.acc + ((size_t)r * ncol + c) * kAccFloats, a.xv + ((size_t)r * a.tiles_k + tk0) * 32,
                           a.wbuf, nb);
        }
    }
    for (int r = 0; r < a.rows; ++r)
        for (int c = 0; c < ncol; ++c)
            reduce(a.acc + ((size_t)r * ncol + c) * kAccFloats, a.yraw + (size_t)r * a.ystride + 16 * (a.tn0 + c));
}

// The integer kernel, scalar: the byte sums of a tile's weights dotted with the int16 activations in int32,
// lane by lane as the AVX2 path adds them (element t = 8g + j into lane j of column pair g / 4), each lane's
// block sum scaled into its float accumulator once per 128-block: the same sums in the same order as the AVX2
// path, so the two agree bit for bit.
inline void tile_bytesums(const DecodeTables& T, const uint8_t* tile, int32_t* b) {
    uint32_t words[64];
    memcpy(words, tile, 4 * (size_t)T.words);
    for (int t = 0; t < kTileElems; ++t) {
        const uint64_t m = (uint64_t)words[T.i0[t]] << 32 | words[T.i1[t]];
        const uint32_t x = ((uint32_t)(m >> T.sh[t]) & 0xFFFFu) * kMul1;
        b[t] = (int32_t)((x & 0xFF) + (x >> 8 & 0xFF) + (x >> 16 & 0xFF) + (x >> 24));
    }
}

// The sum of a row's per-block bias terms (qs[1] of each block), in block order.
inline float row_bias(const float* qs, int nblk) {
    float s = 0.0f;
    for (int b = 0; b < nblk; ++b) s += qs[2 * b + 1];
    return s;
}

constexpr int kMaxRowsQ = 8;

void gemv_cols_q(const GemvArgs& a) {
    const DecodeTables& T = *a.tab;
    const int ncol = a.tn1 - a.tn0, nblk = a.tiles_k / kQBlock;
    const size_t rstride = (size_t)a.tiles_n * (size_t)a.tile_bytes;
    const size_t xrow = (size_t)a.tiles_k * kXq;
    const int32_t* xq = reinterpret_cast<const int32_t*>(a.xv);
    int32_t* bs = reinterpret_cast<int32_t*>(a.wbuf);
    int32_t iacc[kMaxRowsQ][64];
    for (int r0 = 0; r0 < a.rows; r0 += kMaxRowsQ) {
        const int rows = a.rows - r0 < kMaxRowsQ ? a.rows - r0 : kMaxRowsQ;
        for (int c = 0; c < ncol; ++c) {
            for (int blk = 0; blk < nblk; ++blk) {
                if (*a.cancel) return;
                memset(iacc, 0, sizeof iacc);
                for (int b = 0; b < kQBlock; ++b) {
                    const int tk = blk * kQBlock + b;
                    tile_bytesums(T, a.trellis + (size_t)tk * rstride + (size_t)(a.tn0 + c) * (size_t)a.tile_bytes, bs);
                    for (int r = 0; r < rows; ++r) {
                        const int32_t* x = xq + (size_t)(r0 + r) * xrow + (size_t)tk * kXq;
                        for (int t = 0; t < kTileElems; ++t) {
                            const int g = t >> 3, j = t & 7;
                            iacc[r][8 * (g >> 2) + j] += bs[t] * (int32_t)(int16_t)(x[8 * (g & 3) + j] & 0xFFFF);
                        }
                    }
                }
                for (int r = 0; r < rows; ++r) {
                    const float sc = a.qs[((size_t)(r0 + r) * nblk + blk) * 2];
                    float* f = a.acc + ((size_t)(r0 + r) * ncol + c) * kAccFloats;
                    for (int l = 0; l < 64; ++l) {
                        const float m = (float)iacc[r][l] * sc;
                        f[l] = blk ? f[l] + m : m;
                    }
                }
            }
        }
    }
    for (int r = 0; r < a.rows; ++r) {
        const float bias = row_bias(a.qs + (size_t)r * nblk * 2, nblk);
        for (int c = 0; c < ncol; ++c) {
            float* y = a.yraw + (size_t)r * a.ystride + 16 * (a.tn0 + c);
            reduce(a.acc + ((size_t)r * ncol + c) * kAccFloats, y);
            for (int i = 0; i < 16; ++i) y[i] += bias;
        }
    }
}

#else  // SIMD

inline __m128i wrap_window(const DecodeTables& T, const uint8_t* tile) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile + 4 * (T.words - 2))),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tile)));
}

inline __m128i window(const uint8_t* tile, int base) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 4 * base));
}

// The weights' fp16 rounding, done in fp32 (Veltkamp's split: c = v * (2^13 + 1), v rounded to 24 - 13 = 11
// significant bits is c - (c - v)). The mul1 values are exact in fp32 (kernel_api.h), and for every one of the
// 1021 byte sums this gives exactly fp16(v), ties to even included (the tests decode a trellis that reaches every
// byte sum against the reference). A multiply and two subtractions: cheaper than a cvtps2ph/cvtph2ps round trip
// where the conversions run at one per cycle (Zen 5: the decode ~13% faster). Needs IEEE fp32 arithmetic: no
// -ffast-math, which would fold c - (c - v) into v, and c rounded on its own (not contracted into an FMA).
constexpr float kSplit = 8193.0f;

#if GLM53_LEVEL == 1

using V = __m256;
using VI = __m256i;
constexpr int kLanes = 8;
constexpr int kXv = 4;  // pattern vectors per row and tile: decoded vector i multiplies pattern i % 4
constexpr int kBatch = 4;  // vectors decoded together (in stages, so their long dependency chains overlap)

inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vzero() { return _mm256_setzero_ps(); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

// The decode's constants, made once per call and hidden from the optimiser (an empty asm that "changes" them), so
// they stay in registers: otherwise GCC rematerialises each one (mov + vpbroadcastd) for every group.
struct Consts {
    __m256i m16, mul, ones8, b0;  // b0: the byte sum's start (2^23's bits with VNNI, else the madd's ones16)
    __m256 kinv, kbias, split;
};

inline Consts consts() {
#if GLM53_VNNI
    Consts c{_mm256_set1_epi32(0xFFFF), _mm256_set1_epi32((int)kMul1), _mm256_set1_epi8(1),
             _mm256_set1_epi32(kTwo23Bits), _mm256_set1_ps(kMul1Inv), _mm256_set1_ps(kMul1Bias23),
             _mm256_set1_ps(kSplit)};
#else
    Consts c{_mm256_set1_epi32(0xFFFF), _mm256_set1_epi32((int)kMul1), _mm256_set1_epi8(1), _mm256_set1_epi16(1),
             _mm256_set1_ps(kMul1Inv), _mm256_set1_ps(kMul1Bias), _mm256_set1_ps(kSplit)};
#endif
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.b0), "+v"(c.kinv), "+v"(c.kbias), "+v"(c.split));
    return c;
}

// Vector g = group g: its 8 16-bit states, one per 32-bit lane. Only groups 0 and 1 can wrap (kernel.cpp checks);
// the others broadcast their window straight from memory (one load, no shuffle). (kPair: for the AVX-512 path's
// sake; a group always has its own window here.)
// (vec_windows: the three stream bytes of each state, before the shift.)
template <bool kPair>
inline VI vec_windows(const DecodeTables& T, const uint8_t* tile, __m128i wrap, int g) {
    const __m128i* at = reinterpret_cast<const __m128i*>(tile + 4 * T.base[g]);
    const __m256i win = g >= 2 ? _mm256_broadcastsi128_si256(_mm_loadu_si128(at))
                               : _mm256_broadcastsi128_si256(g < T.nwrap ? wrap : _mm_loadu_si128(at));
    return _mm256_shuffle_epi8(win, _mm256_load_si256(reinterpret_cast<const __m256i*>(T.ctrl[g])));
}

template <bool kPair>
inline VI vec_states(const DecodeTables& T, VI m16, const uint8_t* tile, __m128i wrap, int g) {
    return _mm256_and_si256(_mm256_srlv_epi32(vec_windows<kPair>(T, tile, wrap, g),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(T.shift[g]))),
                            m16);
}

inline VI shift_vec(const DecodeTables& T) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(T.shift[0])); }

// States -> weights. mul1: x = s * 0x83DCD12D, b = the byte sum of x, w = fp16(b * k_inv + (1024 k_inv + k_bias)).
// The fp32 FMA is exact (|value| < 2^20 units of 2^-18), so the single fp16 rounding is exactly the GPU kernel's
// __hfma rounding: the weights are bit-identical to exllamav3's.
inline V state_values(const Consts& k, VI s) {
    const __m256i x = _mm256_mullo_epi32(s, k.mul);
#if GLM53_VNNI
    // AVX-VNNI (Alder Lake and later, Zen 5): the byte sum in one vpdpbusd onto the bits of 2^23, read as a float.
    const __m256 v = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_dpbusd_avx_epi32(k.b0, x, k.ones8)), k.kinv, k.kbias);
#else
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(x, k.ones8), k.b0);
    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), k.kinv, k.kbias);
#endif
    __m256 c = _mm256_mul_ps(v, k.split);
    __asm__("" : "+v"(c));  // c must be rounded: GCC would contract c - v into fma(v, split, -v)
    return _mm256_sub_ps(c, _mm256_sub_ps(c, v));
}

// acc: 8 column pairs, vector cp at acc + cp * stride (lanes 0-3: column cp, 4-7: column cp + 8).
inline void reduce(const float* acc, size_t stride, float* y) {
    for (int c = 0; c < 8; ++c) {
        const float* a = acc + c * stride;
        y[c] = (a[0] + a[1]) + (a[2] + a[3]);
        y[c + 8] = (a[4] + a[5]) + (a[6] + a[7]);
    }
}

#else  // GLM53_LEVEL == 2: a vector is a pair of groups

using V = __m512;
using VI = __m512i;
constexpr int kLanes = 16;
constexpr int kXv = 2;  // vector p (groups 2p, 2p+1) multiplies pattern vector p % 2 (patterns 0,1 or 2,3)
constexpr int kBatch = 8;  // (8 is ~6% faster than 4 at one row on Zen 5; AVX2 has half the registers)

inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vzero() { return _mm512_setzero_ps(); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

// As in the AVX2 path: constants kept in registers.
struct Consts {
    __m512i m16, mul, ones8, b0;  // b0: the byte sum's start (2^23's bits with VNNI, else the madd's ones16)
    __m512 kinv, kbias, split;
};

inline Consts consts() {
#if GLM53_VNNI
    Consts c{_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)kMul1), _mm512_set1_epi8(1),
             _mm512_set1_epi32(kTwo23Bits), _mm512_set1_ps(kMul1Inv), _mm512_set1_ps(kMul1Bias23),
             _mm512_set1_ps(kSplit)};
#else
    Consts c{_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)kMul1), _mm512_set1_epi8(1),
             _mm512_set1_epi16(1), _mm512_set1_ps(kMul1Inv), _mm512_set1_ps(kMul1Bias), _mm512_set1_ps(kSplit)};
#endif
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.b0), "+v"(c.kinv), "+v"(c.kbias), "+v"(c.split));
    return c;
}

// Vector p = groups 2p and 2p+1 (16 states). kPair (T.pair_ok): one 16-byte window holds both groups, and only
// pair 0 can wrap (kernel.cpp checks).
template <bool kPair>
inline VI vec_windows(const DecodeTables& T, const uint8_t* tile, __m128i wrap, int p) {
    __m512i d;
    if (kPair) {
        const __m128i src = p > 0 ? window(tile, T.pair_base[p]) : T.pair_nwrap ? wrap : window(tile, T.pair_base[0]);
        d = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(src), _mm512_load_si512(T.pair_ctrl[p]));
    } else {
        const int g = 2 * p;
        const __m128i s0 = g >= 2 || g >= T.nwrap ? window(tile, T.base[g]) : wrap;
        const __m128i s1 = g + 1 >= 2 || g + 1 >= T.nwrap ? window(tile, T.base[g + 1]) : wrap;
        const __m512i win = _mm512_inserti64x4(_mm512_broadcast_i32x4(s0), _mm256_broadcastsi128_si256(s1), 1);
        d = _mm512_shuffle_epi8(win, _mm512_load_si512(T.ctrl[g]));
    }
    return d;
}

template <bool kPair>
inline VI vec_states(const DecodeTables& T, VI m16, const uint8_t* tile, __m128i wrap, int p) {
    return _mm512_and_si512(_mm512_srlv_epi32(vec_windows<kPair>(T, tile, wrap, p), _mm512_load_si512(T.shift[2 * p])),
                            m16);
}

inline VI shift_vec(const DecodeTables& T) { return _mm512_load_si512(T.shift[0]); }  // groups 0 and 1

// As state_values in the AVX2 path.
inline V state_values(const Consts& k, VI s) {
    const __m512i x = _mm512_mullo_epi32(s, k.mul);
#if GLM53_VNNI
    // The byte sum in one instruction, accumulated onto the bits of 2^23, so it reads as the float 2^23 + b
    // with no conversion (kernel_api.h: kMul1Bias23).
    const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_dpbusd_epi32(k.b0, x, k.ones8)), k.kinv, k.kbias);
#else
    const __m512i b = _mm512_madd_epi16(_mm512_maddubs_epi16(x, k.ones8), k.b0);
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), k.kinv, k.kbias);
#endif
    __m512 c = _mm512_mul_ps(v, k.split);
    __asm__("" : "+v"(c));  // c must be rounded: GCC would contract c - v into fma(v, split, -v)
    return _mm512_sub_ps(c, _mm512_sub_ps(c, v));
}

// acc: 8 column pairs, vector cp at acc + cp * stride: groups 4cp and 4cp+1 (patterns 0, 1) and 4cp+2, 4cp+3
// (patterns 2, 3) were added into it; lanes 0-3 and 8-11 belong to column cp, 4-7 and 12-15 to column cp + 8.
inline void reduce(const float* acc, size_t stride, float* y) {
    for (int c = 0; c < 8; ++c) {
        const float* a = acc + c * stride;
        y[c] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[8] + a[9]) + (a[10] + a[11]));
        y[c + 8] = ((a[4] + a[5]) + (a[6] + a[7])) + ((a[12] + a[13]) + (a[14] + a[15]));
    }
}

#endif

constexpr int kVecs = kTileElems / kLanes;  // decoded vectors per tile; vector i adds into column pair i / kXv
constexpr int kBlockK = 16;                 // tiles down a column per accumulator load/store
constexpr int kMaxRows = 8;                 // rows per group (more rows: several groups, each decoding again)
// Software prefetch, this many tiles down the same column: a unit reads a few tiles per tile row at a large
// stride (the row of tiles of the whole linear), which the hardware prefetchers do not follow.
constexpr int kPrefetchTiles = 2 * kBlockK;

// Vectors i0 .. i0 + N - 1 of one tile, decoded in stages (every state first, then every hash), so the long
// per-vector dependency chains (load, shuffle, shift, multiply, byte sum, FMA, rounding) run side by side.
template <int N, bool kPair>
inline void decode_vecs(const DecodeTables& T, const Consts& k, const uint8_t* tile, __m128i wrap, int i0, V* w) {
    VI st[N];
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) st[j] = vec_states<kPair>(T, k.m16, tile, wrap, i0 + j);
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) w[j] = state_values(k, st[j]);
}

template <bool kPair>
void decode_tile_as(const DecodeTables& T, const uint8_t* tile, float* w) {
    const Consts k = consts();
    const __m128i wrap = wrap_window(T, tile);
#pragma GCC unroll 8
    for (int i = 0; i < kVecs; i += kBatch) {
        V v[kBatch];
        decode_vecs<kBatch, kPair>(T, k, tile, wrap, i, v);
#pragma GCC unroll 16
        for (int j = 0; j < kBatch; ++j) vstore(w + (i + j) * kLanes, v[j]);
    }
}

void decode_tile(const DecodeTables& T, const uint8_t* tile, float* w) {
#if GLM53_LEVEL == 2
    if (!T.pair_ok) return decode_tile_as<false>(T, tile, w);
#endif
    decode_tile_as<true>(T, tile, w);
}

// Column pairs per visit of a tile for R rows: R x pairs accumulators in registers (AVX-512: 32 registers, AVX2:
// 16, with 7 for the decode's constants).
template <int R>
constexpr int pairs_per_visit() {
#if GLM53_LEVEL == 2
    return R == 1 ? 8 : R == 2 ? 4 : 2;
#else
    return R == 1 ? 4 : R == 2 ? 2 : 1;
#endif
}

// Decode one tile ahead: the next tile's weights are decoded before this tile's FMAs are issued. With many rows,
// FMAs waiting on a long decode chain otherwise fill the scheduler, and the next decode cannot start early (5-7%
// at 3-8 rows on Zen 5; slower at 1-2 rows, and AVX2 has no registers for the second set).
template <int R>
constexpr bool decode_ahead() {
    return GLM53_LEVEL == 2 && R >= 3;
}

inline void prefetch_tiles(const uint8_t* tile, ptrdiff_t rstride, int tile_bytes, int n) {
    for (int b = 0; b < n; ++b, tile += rstride) {
        __builtin_prefetch(tile);
        __builtin_prefetch(tile + tile_bytes - 1);
        for (int off = 64; off < tile_bytes - 1; off += 64) __builtin_prefetch(tile + off);
    }
}

// Rows r0 .. r0 + R - 1 over the unit's tile columns. The group's accumulators start at acc + r0 * ncol *
// kAccFloats, laid out [column][column pair][row], kLanes floats each. The rows' patterns for a block are first
// copied next to each other (xb: [tile][row][32]), so every FMA addresses them at a constant offset from one
// pointer (in the caller's buffer the rows lie a whole input apart: an address register per row, which at 8 rows
// spilled).
template <int R, bool kPair>
void gemv_rows(const GemvArgs& a, int r0) {
    constexpr int CP = pairs_per_visit<R>();
    constexpr int NV = CP * kXv;  // vectors decoded per visit
    constexpr int NB = NV < kBatch ? NV : kBatch;
    constexpr bool kAhead = decode_ahead<R>();
    alignas(64) float xb[kBlockK * R * 32];
    const DecodeTables& T = *a.tab;
    const Consts k = consts();
    const ptrdiff_t ncol = a.tn1 - a.tn0;
    const ptrdiff_t rstride = (ptrdiff_t)a.tiles_n * a.tile_bytes;
    const ptrdiff_t xrow = (ptrdiff_t)a.tiles_k * 32;
    const float* xv = a.xv + r0 * xrow;
    float* acc = a.acc + r0 * ncol * kAccFloats;
    for (ptrdiff_t tk0 = 0; tk0 < a.tiles_k; tk0 += kBlockK) {
        if (*a.cancel) return;
        const ptrdiff_t nb = a.tiles_k - tk0 < kBlockK ? a.tiles_k - tk0 : kBlockK;
        const ptrdiff_t npf = a.tiles_k - (tk0 + kPrefetchTiles) < nb ? a.tiles_k - (tk0 + kPrefetchTiles) : nb;
        for (ptrdiff_t b = 0; b < nb; ++b)
            for (int r = 0; r < R; ++r)
                memcpy(xb + (b * R + r) * 32, xv + r * xrow + (tk0 + b) * 32, 32 * sizeof(float));
        const uint8_t* col = a.trellis + tk0 * rstride + a.tn0 * (ptrdiff_t)a.tile_bytes;
        float* ac = acc;
        for (ptrdiff_t c = 0; c < ncol; ++c, col += a.tile_bytes, ac += 8 * R * kLanes) {
            if (npf > 0) prefetch_tiles(col + kPrefetchTiles * rstride, rstride, a.tile_bytes, (int)npf);
#pragma GCC unroll 8
            for (int g = 0; g < 8 / CP; ++g) {
                float* ag = ac + g * CP * R * kLanes;
                V s[CP][R];
#pragma GCC unroll 8
                for (int q = 0; q < CP; ++q)
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) s[q][r] = tk0 ? vload(ag + (q * R + r) * kLanes) : vzero();
                const uint8_t* tile = col;
                const float* x = xb;
                if constexpr (kAhead) {
                    V w[NV], next[NV];
                    const __m128i wrap = g == 0 ? wrap_window(T, tile) : _mm_setzero_si128();
#pragma GCC unroll 16
                    for (int j0 = 0; j0 < NV; j0 += NB)
                        decode_vecs<NB, kPair>(T, k, tile, wrap, g * NV + j0, next + j0);
                    for (ptrdiff_t b = 0; b < nb; ++b, tile += rstride, x += R * 32) {
#pragma GCC unroll 16
                        for (int j = 0; j < NV; ++j) w[j] = next[j];
                        if (b + 1 < nb) {
                            const uint8_t* after = tile + rstride;
                            const __m128i wrap2 = g == 0 ? wrap_window(T, after) : _mm_setzero_si128();
#pragma GCC unroll 16
                            for (int j0 = 0; j0 < NV; j0 += NB)
                                decode_vecs<NB, kPair>(T, k, after, wrap2, g * NV + j0, next + j0);
                        }
#pragma GCC unroll 16
                        for (int j = 0; j < NV; ++j)
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r)
                                s[j / kXv][r] = vfma(w[j], vload(x + r * 32 + j % kXv * kLanes), s[j / kXv][r]);
                    }
                } else {
                    for (ptrdiff_t b = 0; b < nb; ++b, tile += rstride, x += R * 32) {
                        const __m128i wrap = g == 0 ? wrap_window(T, tile) : _mm_setzero_si128();
#pragma GCC unroll 16
                        for (int j0 = 0; j0 < NV; j0 += NB) {
                            V w[NB];
                            decode_vecs<NB, kPair>(T, k, tile, wrap, g * NV + j0, w);
#pragma GCC unroll 16
                            for (int j = 0; j < NB; ++j) {
                                const int q = (j0 + j) / kXv, h = (j0 + j) % kXv;
#pragma GCC unroll 8
                                for (int r = 0; r < R; ++r)
                                    s[q][r] = vfma(w[j], vload(x + r * 32 + h * kLanes), s[q][r]);
                            }
                        }
                    }
                }
#pragma GCC unroll 8
                for (int q = 0; q < CP; ++q)
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) vstore(ag + (q * R + r) * kLanes, s[q][r]);
            }
        }
    }
}

template <bool kPair>
void gemv_group(const GemvArgs& a, int r0, int rows) {
    switch (rows) {
        case 1: return gemv_rows<1, kPair>(a, r0);
        case 2: return gemv_rows<2, kPair>(a, r0);
        case 3: return gemv_rows<3, kPair>(a, r0);
        case 4: return gemv_rows<4, kPair>(a, r0);
        case 5: return gemv_rows<5, kPair>(a, r0);
        case 6: return gemv_rows<6, kPair>(a, r0);
        case 7: return gemv_rows<7, kPair>(a, r0);
        default: return gemv_rows<8, kPair>(a, r0);
    }
}

// Decode-and-accumulate for tile columns [tn0, tn1) of one linear, rows in groups of up to kMaxRows. Each group
// walks the unit's columns block by block (kBlockK tiles down each column, the columns left to right), so a thread
// reads kBlockK sequential streams, one per tile row.
void gemv_cols(const GemvArgs& a) {
    const int ncol = a.tn1 - a.tn0;
    for (int r0 = 0; r0 < a.rows; r0 += kMaxRows) {
        const int rows = a.rows - r0 < kMaxRows ? a.rows - r0 : kMaxRows;
#if GLM53_LEVEL == 2
        if (!a.tab->pair_ok)
            gemv_group<false>(a, r0, rows);
        else
#endif
            gemv_group<true>(a, r0, rows);
        if (*a.cancel) return;
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < ncol; ++c)
                reduce(a.acc + (size_t)r0 * ncol * kAccFloats + ((size_t)c * 8 * rows + r) * kLanes,
                       (size_t)rows * kLanes, a.yraw + (size_t)(r0 + r) * a.ystride + 16 * (a.tn0 + c));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The integer kernel.
//
// mul1 makes a weight an affine function of an integer: w = fp16(k_inv * b + bias), b the byte sum of
// s * 0x83DCD12D. Dropping the fp16 rounding (|error| <= half an fp16 ulp of w, ~3e-4 of w's RMS), a block's
// dot product is sum_t w_t a_t ~ k_inv * sum_t b_t a_t + bias * sum_t a_t, and with the block's activations a
// quantized to int16 (a = scale * q, quantize_block) the first sum is exact integer arithmetic:
// vpmaddubsw(x, 1) makes the two 16-bit halves of b (bytes 0+1 and 2+3, <= 510 each: no saturation) and
// vpmaddwd against (q, q) adds them times q into one int32 (vpdpwssd with AVX-VNNI: the accumulate included).
// So a vector of 8 weights costs 5 decode instructions (window shuffle, shift, mask, multiply, byte-pair sum)
// once, and 2 per row (1 with VNNI), where the exact kernel spends 11 per vector and 1 per row. From kPairRows
// rows on, two vectors of a column pair are paired first: their full byte sums b, b' as the two int16 halves of
// one int32 (2 vpmaddwd, a shift, an or), dotted with (q, q') in one vpmaddwd per row: 2 more instructions per
// pair once, and 2 per row for the pair instead of 4 (at 8 rows 30 instructions per 16 weights instead of 42;
// the exact kernel's 38). The same integer products land in the same lanes either way.
//
// int32 bounds: a lane adds 4 products per tile (AVX2; AVX-512: 2), |b q| <= 1020 * 32767, so a 128-block of
// 8 tiles stays below 32 * 1020 * 32767 < 2^31. After each block the lanes are converted to float, times the
// block's scale (qs[0]), and added to the float accumulators (in memory between blocks, like the exact kernel's
// between its tile blocks); the reduction adds each row's bias term (sum of qs[1]) to every output.
//
// Every ISA ends a block with the same 8 int32 lanes per column pair (lane j: the products of elements j of the
// pair's 4 groups; AVX-512 adds its two halves first, which holds the same sum, still below 2^31), and from there
// the same float operations in the same order as the scalar path: the integer kernel gives the same bits on every
// ISA and thread count (the tests check it wherever they run).
//
// Error (tests/cpu_lane/test_cpu_lane_kernel.py measures it): ~3.5e-4 RMS relative to float64 maths, almost all
// from the dropped fp16 rounding of the weights (int16 activations add ~1e-5); a GPU-like fp16 computation of
// the same expert is ~7.5e-4 off.

// shift: every group's shifts are the same (a group starts 8K bits, K bytes, after the last, so each element's
// offset within its bytes depends on its place in the group alone; kernel.cpp checks), held in a register.
struct QConsts {
    VI m16, mul, ones8, shift;
};

constexpr int kPairRows = 3;  // rows from which vectors are paired (gemv_rows_q)

constexpr int kQLanes = 8;  // float accumulator lanes per (row, column pair), whatever the ISA

#if GLM53_LEVEL == 1
inline QConsts qconsts(const DecodeTables& T) {
    QConsts c{_mm256_set1_epi32(0xFFFF), _mm256_set1_epi32((int)kMul1), _mm256_set1_epi8(1), shift_vec(T)};
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.shift));
    return c;
}
inline VI izero() { return _mm256_setzero_si256(); }
inline VI iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i lanes8(VI acc) { return acc; }
// States -> the 16-bit byte-pair sums of their hashes.
inline VI state_pairsums(const QConsts& k, VI d) {
    const VI s = _mm256_and_si256(_mm256_srlv_epi32(d, k.shift), k.m16);
    return _mm256_maddubs_epi16(_mm256_mullo_epi32(s, k.mul), k.ones8);
}
inline VI idot(VI acc, VI p, VI x) {
#if GLM53_VNNI
    return _mm256_dpwssd_avx_epi32(acc, p, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, x));
#endif
}
// Two vectors' byte-pair sums -> their byte sums b (low half) and b' (high half) of each int32 (b <= 1020).
inline VI pair_sums(VI a, VI b) {
    const VI ones16 = _mm256_set1_epi16(1);
    return _mm256_or_si256(_mm256_madd_epi16(a, ones16), _mm256_slli_epi32(_mm256_madd_epi16(b, ones16), 16));
}
#else
inline QConsts qconsts(const DecodeTables& T) {
    QConsts c{_mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)kMul1), _mm512_set1_epi8(1), shift_vec(T)};
    __asm__("" : "+v"(c.m16), "+v"(c.mul), "+v"(c.ones8), "+v"(c.shift));
    return c;
}
inline VI izero() { return _mm512_setzero_si512(); }
inline VI iload(const int32_t* p) { return _mm512_loadu_si512(p); }
// Lane j + lane j + 8: the four groups of a column pair, as the AVX2 lanes hold them.
inline __m256i lanes8(VI acc) {
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
}
inline VI state_pairsums(const QConsts& k, VI d) {
    const VI s = _mm512_and_si512(_mm512_srlv_epi32(d, k.shift), k.m16);
    return _mm512_maddubs_epi16(_mm512_mullo_epi32(s, k.mul), k.ones8);
}
inline VI idot(VI acc, VI p, VI x) {
#if GLM53_VNNI
    return _mm512_dpwssd_epi32(acc, p, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, x));
#endif
}
inline VI pair_sums(VI a, VI b) {
    const VI ones16 = _mm512_set1_epi16(1);
    return _mm512_or_si512(_mm512_madd_epi16(a, ones16), _mm512_slli_epi32(_mm512_madd_epi16(b, ones16), 16));
}
#endif

template <int N, bool kPair>
inline void decode_pairsums(const DecodeTables& T, const QConsts& k, const uint8_t* tile, __m128i wrap, int i0,
                            VI* p) {
    VI st[N];
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) st[j] = vec_windows<kPair>(T, tile, wrap, i0 + j);
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) p[j] = state_pairsums(k, st[j]);
}

// Column pairs per visit of a tile for R rows (R x pairs int32 accumulators in registers, 4 for the constants).
template <int R>
constexpr int qpairs_per_visit() {
#if GLM53_LEVEL == 2
    return R == 1 ? 8 : R == 2 ? 4 : 2;
#else
    return R == 1 ? 4 : R == 2 ? 2 : 1;
#endif
}

constexpr int kQPrefetchTiles = 4 * kQBlock;  // the exact kernel's distance (32 tiles)

// As gemv_rows, one 128-block (kQBlock tiles) down the columns at a time.
template <int R, bool kPair>
void gemv_rows_q(const GemvArgs& a, int r0) {
    constexpr int CP = qpairs_per_visit<R>();
    constexpr int NV = CP * kXv;
    constexpr int NB = NV < kBatch ? NV : kBatch;
    constexpr bool kPaired = R >= kPairRows;
    constexpr int XW = kPaired ? 16 : 32;  // int32 of a row's patterns per tile (the paired or the plain layout)
    constexpr int XO = kPaired ? 32 : 0;   // their offset in the kXq
    static_assert(NB % 2 == 0 && NV % NB == 0, "vectors are paired within a decode batch");
    alignas(64) int32_t xb[kQBlock * R * XW];
    const DecodeTables& T = *a.tab;
    const QConsts k = qconsts(T);
    const ptrdiff_t ncol = a.tn1 - a.tn0;
    const ptrdiff_t rstride = (ptrdiff_t)a.tiles_n * a.tile_bytes;
    const ptrdiff_t xrow = (ptrdiff_t)a.tiles_k * kXq;
    const ptrdiff_t nblk = a.tiles_k / kQBlock;
    const int32_t* xq = reinterpret_cast<const int32_t*>(a.xv) + r0 * xrow;
    const float* qs = a.qs + r0 * nblk * 2;
    float* acc = a.acc + r0 * ncol * kAccFloats;
    for (ptrdiff_t blk = 0; blk < nblk; ++blk) {
        if (*a.cancel) return;
        const ptrdiff_t tk0 = blk * kQBlock;
        const ptrdiff_t left = a.tiles_k - (tk0 + kQPrefetchTiles);
        const int npf = left < kQBlock ? (int)left : kQBlock;
        for (int b = 0; b < kQBlock; ++b)
            for (int r = 0; r < R; ++r)
                memcpy(xb + (b * R + r) * XW, xq + r * xrow + (tk0 + b) * kXq + XO, XW * sizeof(int32_t));
        const uint8_t* col = a.trellis + tk0 * rstride + a.tn0 * (ptrdiff_t)a.tile_bytes;
        float* ac = acc;
        for (ptrdiff_t c = 0; c < ncol; ++c, col += a.tile_bytes, ac += 8 * R * kQLanes) {
            if (npf > 0) prefetch_tiles(col + kQPrefetchTiles * rstride, rstride, a.tile_bytes, npf);
#pragma GCC unroll 8
            for (int g = 0; g < 8 / CP; ++g) {
                VI s[CP][R];
#pragma GCC unroll 8
                for (int q = 0; q < CP; ++q)
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) s[q][r] = izero();
                const uint8_t* tile = col;
                const int32_t* x = xb;
                for (int b = 0; b < kQBlock; ++b, tile += rstride, x += R * XW) {
                    const __m128i wrap = g == 0 ? wrap_window(T, tile) : _mm_setzero_si128();
#pragma GCC unroll 16
                    for (int j0 = 0; j0 < NV; j0 += NB) {
                        VI p[NB];
                        decode_pairsums<NB, kPair>(T, k, tile, wrap, g * NV + j0, p);
                        if constexpr (kPaired) {
                            // Vectors 2m, 2m + 1: one column pair's (AVX2: patterns 0, 1 or 2, 3; AVX-512: its
                            // two vectors), against the paired layout's half m % (kXv / 2) (quantize_block).
#pragma GCC unroll 16
                            for (int j = 0; j < NB; j += 2) {
                                const int q = (j0 + j) / kXv, h = (j0 + j) % kXv / 2;
                                const VI pk = pair_sums(p[j], p[j + 1]);
#pragma GCC unroll 8
                                for (int r = 0; r < R; ++r) s[q][r] = idot(s[q][r], pk, iload(x + r * XW + h * kLanes));
                            }
                        } else {
#pragma GCC unroll 16
                            for (int j = 0; j < NB; ++j) {
                                const int q = (j0 + j) / kXv, h = (j0 + j) % kXv;
#pragma GCC unroll 8
                                for (int r = 0; r < R; ++r)
                                    s[q][r] = idot(s[q][r], p[j], iload(x + r * XW + h * kLanes));
                            }
                        }
                    }
                }
                float* ag = ac + g * CP * R * kQLanes;
#pragma GCC unroll 8
                for (int q = 0; q < CP; ++q)
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        float* d = ag + (q * R + r) * kQLanes;
                        __m256 m = _mm256_mul_ps(_mm256_cvtepi32_ps(lanes8(s[q][r])),
                                                 _mm256_broadcast_ss(qs + (r * nblk + blk) * 2));
                        __asm__("" : "+v"(m));  // rounded before the add, as the scalar path does (no FMA)
                        _mm256_storeu_ps(d, blk ? _mm256_add_ps(_mm256_loadu_ps(d), m) : m);
                    }
            }
        }
    }
}

template <bool kPair>
void gemv_group_q(const GemvArgs& a, int r0, int rows) {
    switch (rows) {
        case 1: return gemv_rows_q<1, kPair>(a, r0);
        case 2: return gemv_rows_q<2, kPair>(a, r0);
        case 3: return gemv_rows_q<3, kPair>(a, r0);
        case 4: return gemv_rows_q<4, kPair>(a, r0);
        case 5: return gemv_rows_q<5, kPair>(a, r0);
        case 6: return gemv_rows_q<6, kPair>(a, r0);
        case 7: return gemv_rows_q<7, kPair>(a, r0);
        default: return gemv_rows_q<8, kPair>(a, r0);
    }
}

void gemv_cols_q(const GemvArgs& a) {
    const int ncol = a.tn1 - a.tn0, nblk = a.tiles_k / kQBlock;
    for (int r0 = 0; r0 < a.rows; r0 += kMaxRows) {
        const int rows = a.rows - r0 < kMaxRows ? a.rows - r0 : kMaxRows;
#if GLM53_LEVEL == 2
        if (!a.tab->pair_ok)
            gemv_group_q<false>(a, r0, rows);
        else
#endif
            gemv_group_q<true>(a, r0, rows);
        if (*a.cancel) return;
        for (int r = 0; r < rows; ++r) {
            const float* q = a.qs + (size_t)(r0 + r) * nblk * 2;
            float bias = 0.0f;
            for (int b = 0; b < nblk; ++b) bias += q[2 * b + 1];
            for (int c = 0; c < ncol; ++c) {
                const float* f = a.acc + (size_t)r0 * ncol * kAccFloats + ((size_t)c * 8 * rows + r) * kQLanes;
                float* y = a.yraw + (size_t)(r0 + r) * a.ystride + 16 * (a.tn0 + c);
                for (int cp = 0; cp < 8; ++cp, f += (size_t)rows * kQLanes) {  // as the scalar reduce
                    y[cp] = (f[0] + f[1]) + (f[2] + f[3]) + bias;
                    y[cp + 8] = (f[4] + f[5]) + (f[6] + f[7]) + bias;
                }
            }
        }
    }
}

#endif

}  // namespace
}  // namespace GLM53_NS
}  // namespace glm53
