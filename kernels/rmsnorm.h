#pragma once
// RMSNorm: y[r][i] = x[r][i] / sqrt(mean_i(x[r]^2) + eps) * w[i], row by row.
// rmsnorm_ref is the plain C++ reference twin (and the CPU path) of the CUDA kernel in
// rmsnorm.cu. The CUDA entry points need no CUDA headers in the caller; in a build without
// CUDA they return Errc::unsupported ("built without CUDA").
#include <cstddef>

#include "core/error.h"
#include "kernels/bf16.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// Reference RMSNorm over `rows` rows of `dim` floats; accumulates in double.
void rmsnorm_ref(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps);

/// Reference BF16 RMSNorm: widens to float, normalises as rmsnorm_ref, rounds the result
/// to the nearest bfloat16.
void rmsnorm_bf16_ref(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows, size_t dim,
                      float eps);

/// Checks the arguments every RMSNorm entry point takes (non-null pointers when rows > 0,
/// dim > 0, finite eps >= 0, sizes that fit in memory); names the bad one.
Status rmsnorm_check_args(const void* x, const void* w, const void* y, size_t rows, size_t dim,
                          float eps, size_t elem_size);

/// RMSNorm on the GPU for host arrays: allocates device memory, copies in, launches one
/// block per row, copies out and synchronises. fp32 accumulation.
Status rmsnorm_cuda(const float* x_host, const float* w_host, float* y_host, size_t rows,
                    size_t dim, float eps);

/// The same for bfloat16 host arrays (fp32 accumulation, output rounded to bfloat16).
Status rmsnorm_bf16_cuda(const bf16_bits* x_host, const bf16_bits* w_host, bf16_bits* y_host,
                         size_t rows, size_t dim, float eps);

/// RMSNorm on device pointers, enqueued on `stream` (a cudaStream_t; nullptr = the default
/// stream). Returns after the launch; errors of the launch itself are reported, errors
/// during execution surface at the caller's next synchronisation.
Status rmsnorm_cuda_device(const float* x_dev, const float* w_dev, float* y_dev, size_t rows,
                           size_t dim, float eps, void* stream);

/// BF16 variant of rmsnorm_cuda_device (pointers to __nv_bfloat16).
Status rmsnorm_bf16_cuda_device(const bf16_bits* x_dev, const bf16_bits* w_dev, bf16_bits* y_dev,
                                size_t rows, size_t dim, float eps, void* stream);

/// Reference of the fused residual add + RMSNorm, as a layer's pre-norm step does it:
/// hidden[r] += delta[r] (rounded to `store`), then out[r] = rmsnorm(hidden[r]) * w (rounded
/// to `store`). delta may be null (plain RMSNorm of hidden, which is then left as is).
void add_rmsnorm_ref(float* hidden, const float* delta, const float* w, float* out, size_t rows,
                     size_t dim, float eps, DType store);

/// Fused residual add + RMSNorm on device pointers, all of type `dt`: hidden += delta (in
/// place; skipped when delta is null), out = rmsnorm(hidden) * w. fp32 math, one read of
/// each input; out must not alias hidden or delta.
Status add_rmsnorm_cuda_device(DType dt, void* hidden, const void* delta, const void* w, void* out,
                               size_t rows, size_t dim, float eps, void* stream);

/// Reference per-head RMSNorm in place (Qwen3's q_norm/k_norm): x is [n_tokens] rows of
/// `token_stride` elements holding n_heads heads of head_dim each at the start; each head
/// is normalised with the same head_dim weights. Results rounded to `store`.
void head_rmsnorm_ref(float* x, size_t token_stride, size_t n_tokens, int n_heads, int head_dim,
                      const float* w, float eps, DType store);

/// Per-head RMSNorm in place on device pointers of type `dt` (layout as head_rmsnorm_ref).
Status head_rmsnorm_cuda_device(DType dt, void* x, size_t token_stride, size_t n_tokens,
                                int n_heads, int head_dim, const void* w, float eps, void* stream);

/// Reference of folding a norm's weight into the product that follows it:
/// w[r][c] = bf16(w[r][c] * norm_w[c]) for `rows` rows of `cols` bf16 weights (the product's
/// rows read the normalised input's columns), so that the product over the norm without its
/// weight gives the product over the norm with it, up to one bf16 rounding per weight.
void rmsnorm_fold_weight_ref(bf16_bits* w, size_t rows, size_t cols, const bf16_bits* norm_w);

/// The same on device pointers (bf16), in place, enqueued on `stream`.
Status rmsnorm_fold_weight_cuda_device(bf16_bits* w, size_t rows, size_t cols,
                                       const bf16_bits* norm_w, void* stream);

}  // namespace spark::kernels

namespace spark::kernels {

/// A norm over a row that tensor-parallel ranks hold in parts (MiniMax-M2's q/k norm over all
/// heads), in two halves around the all-reduce of the sums of squares:
/// ss[r] = sum of x[r][i]^2 over this rank's `dim` bf16 values (fp32) ...
Status row_sumsq_cuda_device(const void* x, size_t rows, size_t dim, float* ss, void* stream);
/// ... then x[r][i] = x[r][i] * rsqrt(ss[r] / total + eps) * w[i], in place (bf16, w bf16).
Status rows_rms_scale_cuda_device(void* x, const void* w, const float* ss, size_t rows, size_t dim,
                                  float total, float eps, void* stream);

}  // namespace spark::kernels
