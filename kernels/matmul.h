#pragma once
// Matrix products of a linear layer: out[m][n] = sum_k a[m][k] * w[n][k] (+ bias[n])
// (+ out[m][n] when accumulating), BF16 in, FP32 accumulation, bf16 or fp32 out. Two
// backends: cuBLASLt, loaded at run time with dlopen (libcublasLt.so.13) so the binaries
// start without it, and a kernel of our own for decode shapes (m <= 32 rows, memory-bound:
// one pass over the weight with 16-byte loads). Matmul::run picks per shape (see
// Matmul::choose). matmul_ref is the CPU twin.
#include <cstddef>
#include <memory>
#include <string>

#include "core/error.h"
#include "kernels/dtype.h"
#include "kernels/fp8.h"
#include "kernels/launch.h"
#include "kernels/rope.h"

namespace spark::kernels {

/// Which implementation runs a product.
enum class MatmulBackend : uint8_t { automatic, cublaslt, own };

/// "auto", "cublaslt" or "own".
const char* matmul_backend_name(MatmulBackend b);

/// Most rows the own (decode) kernel takes.
inline constexpr size_t kMatmulOwnMaxRows = 32;

/// One product; pointers are device pointers, strides in elements.
struct MatmulArgs {
  const void* a = nullptr;  // [m][k] bf16, row stride lda
  size_t lda = 0;
  const void* w = nullptr;  // [n][k] bf16 (a linear layer's weight), row stride ldw
  size_t ldw = 0;
  void* out = nullptr;  // [m][n] of out_dtype, row stride ldo
  DType out_dtype = DType::bf16;
  size_t ldo = 0;
  size_t m = 0, n = 0, k = 0;
  const void* bias = nullptr;  // optional [n] bf16
  bool accumulate = false;     // out += product (a residual add), instead of out = product
  MatmulBackend backend = MatmulBackend::automatic;
  // Own kernel only: a gate/up product with SwiGLU in its epilogue. w holds 2n rows (gate
  // row i, then up row n + i; bias likewise 2n), and out[m][i] = silu(g) * u where g and u
  // are the two products rounded to out_dtype first, exactly as the product into a
  // [gate | up] buffer followed by swiglu would give. Not with accumulate.
  bool swiglu = false;
  // Streaming form only (m <= kMatmulGemvMaxRows): the product's input is RMSNorm of a, row
  // by row, times norm_w ([k] bf16): out = rsqrt(mean_k(a^2) + norm_eps) *
  // sum_k w[n][k] * a[k] * norm_w[k], in fp32 with nothing rounded before the output (the
  // separate norm would round the normalised row to bf16 first). Each warp reads the whole
  // row of a, so it sums the squares itself: no pass and no barrier before the product.
  const void* norm_w = nullptr;
  float norm_eps = 0.f;
  // The same norm with its weight already folded into w (w[n][k] * norm_w[k] stored, one
  // bf16 rounding per weight): only the 1 / rms scale is applied (norm_w stays null). The
  // streaming form, and the tensor-core form up to kMatmulQkvRopeMaxRows rows (its block's
  // warps split k, each sums the squares of its share and the sums meet with the products').
  bool norm_unit = false;
};

/// Whether a product runs over RMSNorm of its input (norm_w, or norm_unit).
inline bool matmul_has_norm(const MatmulArgs& a) {
  return a.norm_w != nullptr || a.norm_unit;
}

/// Most products matmul_own_group_cuda_device runs in one launch.
inline constexpr int kMatmulMaxGroup = 3;

/// Most rows the own kernel's streaming path takes (one warp per output row, fp32 FMA);
/// from kMatmulGemvMaxRows + 1 to kMatmulOwnMaxRows rows it runs on the tensor cores.
inline constexpr size_t kMatmulGemvMaxRows = 4;

/// Which form of the own kernel runs (the benchmark times them side by side; the engine
/// uses automatic): the streaming form at 1-2 rows (and for a norm with its weight at 3-4),
/// else the tensor-core form; or one of them forced (the streaming form with R output rows
/// per warp and U 512-byte steps of each weight row in flight per lane, at most
/// kMatmulGemvMaxRows rows; mma with its automatic shape, see matmul_own_mma_cuda_device).
enum class OwnVariant : uint8_t {
  automatic,
  mma,
  gemv_r1_u8,
  gemv_r2_u4,
  gemv_r2_u8,
  gemv_r1_u4,
  gemv_r2_u2
};

/// "auto", "mma", "gemv r1 u8", ...
const char* own_variant_name(OwnVariant v);

/// The q, k and v products of a decode step with RoPE and the KV write in their epilogue:
/// what matmul_own_group_cuda_device(parts, 3) and then rope_cuda_device(rope) with its KV
/// write give, bit for bit, in one launch (the streaming form, m <= kMatmulGemvMaxRows).
/// Each warp computes the two rows of one rotation pair (i, i + head_dim/2) of a head and
/// rotates them in registers; k's rotated rows and v's rows also go to their cache slots.
/// parts 0, 1, 2 write rope's q, k and v (n = heads * head_dim, ldo = rope's stride);
/// rope.n_tokens = m; the KV write is set; whole heads rotate (no partial rotary). Per-head
/// norms (rope.q_norm / k_norm, Qwen3) where matmul_qkv_rope_head_norms(m, head_dim): the
/// launch is then a cluster of head_dim / 16 blocks per head, which meet in distributed
/// shared memory to sum each head's squares in rope_kernel's order, so the bits are still
/// those of the products and then rope_cuda_device with its norms.
/// Up to kMatmulQkvRopeMaxRows rows: automatic runs the streaming form at 1-2 rows (and for
/// a norm with its weight at 3-4), else the tensor-core form, whose warps hold eight pairs of
/// one head's rows; `variant` forces gemv_r2_u4 or mma (the benchmark, the tests).
Status matmul_qkv_rope_cuda_device(const MatmulArgs* parts, const RopeArgs& rope, void* stream,
                                   OwnVariant variant = OwnVariant::automatic);

/// Whether matmul_qkv_rope_cuda_device takes per-head norms for m rows of head_dim: 1-2 rows
/// (the streaming form), head_dim 32, 64 or 128, and a GPU with thread block clusters
/// (sm_90 and later, the fallbacks not forced).
bool matmul_qkv_rope_head_norms(size_t m, size_t head_dim);

/// Most rows of matmul_qkv_rope_cuda_device (and of a norm inside the tensor-core form).
inline constexpr size_t kMatmulQkvRopeMaxRows = 8;

/// Reference product on floats, accumulated in double, result rounded to `store`.
void matmul_ref(const float* a, const float* w, float* out, size_t m, size_t n, size_t k,
                const float* bias, bool accumulate, DType store);

/// Reference of a product over RMSNorm of a (MatmulArgs::norm_w): each row of a scaled by
/// 1 / sqrt(mean(a^2) + eps) and by norm_w in double, unrounded, then matmul_ref's product.
void matmul_norm_ref(const float* a, const float* norm_w, float eps, const float* w, float* out,
                     size_t m, size_t n, size_t k, const float* bias, bool accumulate, DType store);

/// Checks MatmulArgs (non-null, strides >= widths, k a multiple of 8 and 16-byte aligned
/// rows for the own kernel).
Status matmul_check_args(const MatmulArgs& a);

/// The own decode-shaped kernel directly (m <= kMatmulOwnMaxRows), on `stream`.
Status matmul_own_cuda_device(const MatmulArgs& a, void* stream);

/// Up to kMatmulMaxGroup products of the same m (the q, k and v projections of one input)
/// with the own kernel in one launch: each block computes rows of one of them.
Status matmul_own_group_cuda_device(const MatmulArgs* parts, int n_parts, void* stream,
                                    OwnVariant variant = OwnVariant::automatic);

/// The tensor-core form with its shape forced (the benchmark's sweep, the tests):
/// `row_tiles` tiles of 16 weight rows a warp (1, 2 or 4; 1 above 8 rows), so one load of A
/// feeds that many tiles, and `k_warps` warps a block splitting k (8 or 16); 0 leaves either
/// to the automatic choice.
Status matmul_own_mma_cuda_device(const MatmulArgs* parts, int n_parts, void* stream, int row_tiles,
                                  int k_warps);

/// Whether products of m rows over weights of `total_nk` elements in all (a group's sum)
/// go to one own launch rather than separate products: m <= 2 (the streaming form, as fast
/// as cuBLASLt on any weight), or m <= 8 and at most 32 Mi weight elements, where the
/// tensor-core form with one launch beats cuBLASLt's 25-55% on the 1024 x 4096 and
/// 4096 x 4096 shapes with three.
bool matmul_group_prefers_own(size_t m, size_t total_nk);

/// A product on the FP8 tensor cores: out[m][n] (bf16, row stride ldo) = sum over 128-column
/// blocks kb of a_scales[kb * m + i] * w's block scale * sum_k a[i][k] * w.q[j][k] (+ bias[j])
/// (+ out[i][j] when accumulating): rows quantized by fp8_quantize_rows_cuda_device (with
/// scale_ld == m) against an FP8 weight kept as stored (kernels/fp8.h).
struct Fp8TcArgs {
  const uint8_t* a = nullptr;  // [m][k] e4m3, row stride lda bytes
  size_t lda = 0;
  const float* a_scales = nullptr;  // [ceil(k / 128)][m]
  Fp8Weight w;                      // fp8_tc_weight_ok(w, k)
  void* out = nullptr;              // [m][n] bf16, row stride ldo
  size_t ldo = 0;
  size_t m = 0, n = 0, k = 0;
  const void* bias = nullptr;  // optional [n] bf16
  bool accumulate = false;
};

/// Checks Fp8TcArgs (non-null pointers, strides >= widths, the weight's layout, m a
/// multiple of kFp8TcRowAlign, 16-byte aligned operands).
Status fp8_tc_check(const Fp8TcArgs& a);

/// A cuBLASLt handle, its workspace and the algorithms chosen per shape, for the current
/// device. Not thread-safe: one per engine thread. Products it runs can be captured in a
/// CUDA graph once each shape has run once outside capture (the algorithm is chosen then).
class Matmul {
 public:
  /// Loads libcublasLt.so.13 and allocates `workspace_bytes` of device workspace.
  /// Errc::unsupported naming the library (and the fix) when it cannot be loaded.
  static Result<std::unique_ptr<Matmul>> create(size_t workspace_bytes = size_t{32} << 20);
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  /// Runs one product on `stream` with args.backend (automatic: choose()).
  Status run(const MatmulArgs& args, void* stream);
  /// Runs an FP8 product on the tensor cores (cuBLASLt's block-scaled FP8: 128-element
  /// vector scales for the rows, 128 x 128 block scales for the weight; Hopper). Where the
  /// library has no algorithm for it (a GPU without them, a shape it does not take):
  /// Errc::unsupported, remembered per shape, and the caller takes another path.
  Status run_fp8(const Fp8TcArgs& args, void* stream);
  /// The backend automatic picks for this shape: the one measured faster on the H200
  /// (bench/kernels): own for m <= 2 on any weight and for m <= 8 on weights of at most
  /// 64 Mi elements (up to 4096 x 14336), else cuBLASLt. (A rule of the shape alone, defined
  /// once for every build: matmul_ref.cc.)
  static MatmulBackend choose(size_t m, size_t n, size_t k);
  /// Where the library was loaded from, e.g. "/usr/local/cuda/lib64/libcublasLt.so.13".
  const std::string& library_path() const;

 private:
  struct Impl;
  explicit Matmul(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spark::kernels
