#pragma once
// Weights in MXFP4 (OCP microscaling FP4), as gpt-oss stores its routed experts: a matrix
// [n][k] of 4-bit e2m1 codes, two a byte, with one e8m0 scale per 32 consecutive columns.
//
// Layout: row r's codes are the k / 2 bytes at blocks + r * ldb; column c is byte c / 2's low
// nibble when c is even, its high nibble when c is odd. Row r's scales are the k / 32 bytes at
// scales + r * lds; column c's scale is byte c / 32. (A checkpoint's X_blocks
// [experts][rows][k / 32][16] and X_scales [experts][rows][k / 32] are this layout with
// ldb = k / 2 and lds = k / 32.)
//
// Numerics: an e2m1 code is sign (bit 3), a 2-bit exponent (bits 2-1, bias 1) and a 1-bit
// mantissa (bit 0): the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent 0: 0 and the
// subnormal 0.5). An e8m0 scale byte s is 2^(s - 127); 0xff is NaN (the loader refuses it).
// weight[r][c] = e2m1(code) * 2^(scale - 127): at most two significant bits times a power of
// two, so it is exact in fp32 and in bf16 (down to the smallest, 0.5 * 2^-127 = 2^-128, a
// subnormal of both) unless it exceeds their range: with scale bytes 253 and 254 the largest
// codes pass 2^128 and become +-inf (no checkpoint comes near: scales sit around 2^-10 to 2^0).
//
// The MoE expert kernels (kernels/moe.h) read such weights packed: the decode form widens a
// lane's 16 bytes (32 columns, one scale block) in registers two codes at a time
// (mxfp4_e2m1_pair_fp16: code * 2^-14 as fp16, exact, then to fp32), sums the block's 32
// products in fp32 and multiplies the sum once by 2^14 * scale; the grouped form widens weight
// tiles into bf16 (exact, above) for the tensor cores. mxfp4_widen_ref is the CPU twin of that
// widening.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/error.h"

#if defined(__CUDACC__)
#define SPARK_MXFP4_HD __host__ __device__ __forceinline__
#else
#define SPARK_MXFP4_HD inline
#endif

namespace spark::kernels {

/// Columns one scale covers (16 bytes of codes).
inline constexpr int kMxfp4BlockK = 32;

/// An MXFP4 weight [n][k] in device (or, for the twins, host) memory.
struct Mxfp4Weight {
  const uint8_t* blocks = nullptr;  // row r's codes at blocks + r * ldb
  size_t ldb = 0;                   // bytes per row, >= k / 2
  const uint8_t* scales = nullptr;  // row r's e8m0 scales at scales + r * lds
  size_t lds = 0;                   // scale bytes per row, >= k / 32
};

/// The value of e2m1 code `code` (its low 4 bits): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
inline float mxfp4_e2m1_value(uint8_t code) {
  const int e = (code >> 1) & 3, m = code & 1;
  // Exponent 0: the subnormal m * 0.5; else (1 + m / 2) * 2^(e - 1).
  const float mag =
      e == 0 ? 0.5f * static_cast<float>(m) : std::ldexp(1.f + 0.5f * static_cast<float>(m), e - 1);
  return (code & 8) ? -mag : mag;
}

/// Two e2m1 codes of the 8 in `w` (code n in bits 4n .. 4n + 3), codes k and k + 4 for k in
/// 0 .. 3, as two fp16 values (code k in the low 16 bits, code k + 4 in the high): each is
/// exactly the code's value times 2^-14. The code's exponent and mantissa bits land on the
/// fp16's two lowest exponent bits and its highest mantissa bit, so exponent 0 is the fp16
/// subnormal 0.5 * 2^-14 and exponent e > 0 is (1 + m / 2) * 2^(e - 1) * 2^-14; bit 3 lands
/// on the sign. Five integer operations widen two codes; the sum of a block's products is
/// multiplied back by kMxfp4Fp16Unscale.
SPARK_MXFP4_HD uint32_t mxfp4_e2m1_pair_fp16(uint32_t w, int k) {
  const uint32_t mag = (k < 3 ? w << (9 - 4 * k) : w >> 3) & 0x0e000e00u;
  return mag | ((w << (12 - 4 * k)) & 0x80008000u);
}

/// All 8 codes of `w` as four fp16 pairs of the same values (code * 2^-14), in the pairs the
/// tensor-core decode kernels feed the mma: h[0] = (code 0, code 2), h[1] = (4, 6),
/// h[2] = (1, 3), h[3] = (5, 7) (first code in the low 16 bits). The fp16's high byte is
/// s000eem0 and its low byte 0: the even codes' bytes and the odd codes' bytes are built in
/// one word each, then placed by byte permutes; 11 integer operations for 8 codes.
SPARK_MXFP4_HD void mxfp4_e2m1x8_fp16(uint32_t w, uint32_t* h) {
  const uint32_t even = ((w << 1) & 0x0e0e0e0eu) | ((w << 4) & 0x80808080u);
  const uint32_t odd = ((w >> 3) & 0x0e0e0e0eu) | (w & 0x80808080u);
#if defined(__CUDA_ARCH__)
  h[0] = __byte_perm(even, 0u, 0x1404);
  h[1] = __byte_perm(even, 0u, 0x3424);
  h[2] = __byte_perm(odd, 0u, 0x1404);
  h[3] = __byte_perm(odd, 0u, 0x3424);
#else
  const auto place = [](uint32_t v, int lo, int hi) {
    return (((v >> (8 * lo)) & 0xffu) << 8) | (((v >> (8 * hi)) & 0xffu) << 24);
  };
  h[0] = place(even, 0, 1);
  h[1] = place(even, 2, 3);
  h[2] = place(odd, 0, 1);
  h[3] = place(odd, 2, 3);
#endif
}

/// What mxfp4_e2m1_pair_fp16's values are multiplied by to give the codes' values: 2^14.
inline constexpr float kMxfp4Fp16Unscale = 16384.f;

/// The value of e8m0 scale byte `s`: 2^(s - 127), NaN for 0xff.
inline double mxfp4_scale_value(uint8_t s) {
  return s == 0xff ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, s - 127);
}

/// out[r][c] (row stride ldo floats) = the weight's rows [row0, row0 + rows), columns
/// [0, k), exact in float (see the numerics above; NaN where a scale byte is 0xff).
void mxfp4_widen_ref(const Mxfp4Weight& w, size_t row0, size_t rows, size_t k, float* out,
                     size_t ldo);

/// Checks an MXFP4 weight of k columns that the kernels read 16 bytes at a time: blocks and
/// scales not null, k a multiple of 32, ldb >= k / 2, lds >= k / 32, blocks and ldb multiples
/// of 16 bytes. `name` names the weight in the message.
Status mxfp4_weight_check(const Mxfp4Weight& w, size_t k, const char* name);

}  // namespace spark::kernels
