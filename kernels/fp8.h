#pragma once
// Products over FP8 weights kept as the checkpoint stores them: e4m3 (OCP "fn": no
// infinities, 0x7f/0xff NaN, largest 448) with one fp32 scale per block of 128 columns and
// `1 << row_shift` rows, so that w[n][k] = fp8(n, k) * scales[(n >> row_shift) * scale_ld +
// k / 128]. Checkpoints use 128 x 128 blocks (row_shift 7); a weight whose row segments do
// not start on a 128-row boundary (a small model's fused [gate | up]) is kept with one scale
// row per weight row (row_shift 0), the same numbers.
//
// Decode (up to kFp8GemvMaxRows rows): one pass over the weight's bytes, each value widened
// in registers, products in fp32, each 128-column block's partial sum multiplied by its
// scale, the row's sum in fp32, rounded once to the output type. Prefill, two ways:
//  - on the FP8 tensor cores (Hopper: cuBLASLt's block-scaled product, Matmul::run_fp8 in
//    kernels/matmul.h): the activations quantized per row and 128 columns
//    (fp8_quantize_rows_cuda_device), as the checkpoints' authors run them, the products of
//    each 128-column block in fp32 times the two blocks' scales. Against the product of the
//    quantized activations (exact) it differs by the output's rounding and the sums' (
//    |out - yq| <= 2^-8 |yq| + 2^-9 sum_k |aq[k] w[n][k]|: cuBLASLt adds some shapes'
//    partial sums in bf16); against
//    the exact product, each activation's rounding adds at most 2^-4 |a[k]| + 2^-10 scale
//    (half a unit in e4m3's last place, or in its subnormals) times |w[n][k]|.
//  - the weight dequantized into a bf16 workspace (fp8_dequantize_cuda_device) and multiplied
//    there by the bf16 product (kernels/matmul.h); the difference from the exact product is
//    bf16's rounding of each dequantized weight (none where the scale is a power of two:
//    e4m3's 4 significant bits fit bf16's 8).
//
// fp8_matmul_ref / fp8_dequantize_ref / fp8_quantize_rows_ref are the CPU twins.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"

namespace spark::kernels {

/// Columns a scale covers.
inline constexpr int kFp8BlockK = 128;
/// Most rows the decode kernel takes.
inline constexpr size_t kFp8GemvMaxRows = 8;

/// An FP8 weight [n][k] in device (or, for the twins, host) memory.
struct Fp8Weight {
  const uint8_t* q = nullptr;  // [n][k] e4m3, row stride ldq bytes
  size_t ldq = 0;
  const float* scales = nullptr;  // [(n - 1 >> row_shift) + 1][scale_ld]
  size_t scale_ld = 0;            // >= ceil(k / 128)
  int row_shift = 7;              // scale row of weight row r: r >> row_shift (7 or 0)
};

/// out[m][n] = sum_k a[m][k] * w[n][k] (+ bias[n]) (+ out[m][n] when accumulating).
struct Fp8MatmulArgs {
  const void* a = nullptr;  // [m][k] bf16, row stride lda
  size_t lda = 0;
  Fp8Weight w;
  void* out = nullptr;  // [m][n] of out_dtype, row stride ldo
  DType out_dtype = DType::bf16;
  size_t ldo = 0;
  size_t m = 0, n = 0, k = 0;
  const void* bias = nullptr;  // optional [n] bf16 (2n with swiglu)
  bool accumulate = false;
  // A gate/up product with SwiGLU in the epilogue: w holds 2n rows (gate row i, then up
  // row n + i) and out[m][i] = silu(g) * u, g and u rounded to out_dtype first (what the
  // product into a [gate | up] buffer followed by swiglu gives). Not with accumulate.
  bool swiglu = false;
  // The product's input is RMSNorm of a, row by row, times norm_w ([k] bf16, 16-byte
  // aligned): out = rsqrt(mean_k(a^2) + norm_eps) * sum_k w[n][k] * a[k] * norm_w[k], in
  // fp32 with nothing rounded before the output (as MatmulArgs::norm_w for bf16 weights).
  const void* norm_w = nullptr;
  float norm_eps = 0.f;
};

/// The most products fp8_gemv_group_cuda_device takes in one launch.
inline constexpr size_t kFp8GemvMaxGroup = 3;

/// Checks Fp8MatmulArgs (non-null pointers, strides >= widths, k a multiple of 16, 16-byte
/// aligned rows of a and q and norm_w, scale_ld >= ceil(k / 128), row_shift 0 or 7).
Status fp8_matmul_check(const Fp8MatmulArgs& a);

/// The decode product (m <= kFp8GemvMaxRows) on `stream`.
Status fp8_gemv_cuda_device(const Fp8MatmulArgs& a, void* stream);
/// Up to kFp8GemvMaxGroup decode products over the same input (a, lda, m, k and the norm
/// equal; no swiglu) in one launch: the q, k and v projections of a step.
Status fp8_gemv_group_cuda_device(const Fp8MatmulArgs* parts, int n, void* stream);

/// The q, k and v decode products (parts 0, 1, 2: the same a, lda, m, k and norm; plain)
/// with the RoPE epilogue of matmul_qkv_rope_cuda_device (kernels/matmul.h): each part must
/// write rope's q, k, v (n_heads or n_kv_heads x head_dim columns, their strides); q and k
/// are rotated in place of the plain store, and k's and v's rows go to the cache slots, bit
/// for bit fp8_gemv_group_cuda_device followed by rope_cuda_device (with its KV write). Up to
/// kMatmulQkvRopeMaxRows rows; whole rotary only; per-head norms (Qwen3) where
/// matmul_qkv_rope_head_norms(m, head_dim).
Status fp8_qkv_rope_cuda_device(const Fp8MatmulArgs* parts, const RopeArgs& rope, void* stream);

/// out[n][k] (bf16, row stride ldo) = the dequantized weight rows [row0, row0 + rows) of
/// `w` (k columns), rounded to bf16: the prefill's operand.
Status fp8_dequantize_cuda_device(const Fp8Weight& w, size_t row0, size_t rows, size_t k, void* out,
                                  size_t ldo, void* stream);

/// Checks fp8_dequantize_cuda_device's arguments (k > 0, non-null pointers, w.ldq and
/// ldo >= k, scale_ld >= ceil(k / 128), row_shift 0 or 7).
Status fp8_dequantize_check(const Fp8Weight& w, size_t row0, size_t rows, size_t k, const void* out,
                            size_t ldo);

/// Activation rows quantized for the FP8 tensor cores: block kb (columns [128 kb, 128 kb +
/// 128)) of row m has scale = amax / 448 (its largest |value| over e4m3's largest; 1 for a
/// block of zeros) and codes e4m3(x / scale), rounded to nearest even (fp32 division, IEEE
/// rounded); the scale is stored at scales[kb * scale_ld + m]: rows contiguous, as cuBLASLt
/// reads a 128-element vector scale of the product's activation operand.
struct Fp8Rows {
  uint8_t* q = nullptr;  // [m][k] e4m3, row stride ldq bytes
  size_t ldq = 0;
  float* scales = nullptr;  // [ceil(k / 128)][scale_ld]
  size_t scale_ld = 0;      // >= m
};

/// Checks fp8_quantize_rows' arguments (non-null pointers, lda and ldq >= k, scale_ld >= m,
/// k a multiple of 8, a's rows 16-byte aligned).
Status fp8_quantize_rows_check(const void* a, size_t lda, size_t m, size_t k, const Fp8Rows& out);

/// Quantizes a ([m][k] bf16, row stride lda) into `out` on `stream`.
Status fp8_quantize_rows_cuda_device(const void* a, size_t lda, size_t m, size_t k,
                                     const Fp8Rows& out, void* stream);

/// The twin of fp8_quantize_rows_cuda_device on host memory (a bf16 as uint16_t): the same
/// codes and scales, bit for bit.
void fp8_quantize_rows_ref(const uint16_t* a, size_t lda, size_t m, size_t k, const Fp8Rows& out);

/// Rows the tensor-core FP8 product takes a multiple of (cuBLASLt finds no block-scaled
/// algorithm otherwise: measured on an H100); the others run the decode kernel.
inline constexpr size_t kFp8TcRowAlign = 4;

/// The row stride, in scales, of a weight's 128 x 128 block scales that the tensor-core
/// product reads: ceil(k / 128) rounded up to a multiple of 4 (cuBLASLt's layout; the loader
/// keeps every FP8 matrix so, the padding zero).
inline size_t fp8_tc_scale_ld(size_t k) {
  return ((k + kFp8BlockK - 1) / kFp8BlockK + 3) / 4 * 4;
}

/// Whether weight `w` (k columns) is laid out as the tensor-core product reads it: 128 x 128
/// blocks, scale_ld == fp8_tc_scale_ld(k), rows of k bytes (ldq == k), k a multiple of 16,
/// q and scales 16-byte aligned.
bool fp8_tc_weight_ok(const Fp8Weight& w, size_t k);

/// The twin of fp8_gemv_cuda_device on host memory (a and bias bf16 as uint16_t, out of
/// out_dtype): in double over exactly widened weights, rounded as the device rounds.
void fp8_matmul_ref(const Fp8MatmulArgs& host_args);

/// The twin of fp8_dequantize_cuda_device on host memory.
void fp8_dequantize_ref(const Fp8Weight& w, size_t row0, size_t rows, size_t k, uint16_t* out,
                        size_t ldo);

}  // namespace spark::kernels
