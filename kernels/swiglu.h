#pragma once
// SwiGLU activation of a fused gate/up projection: for each row of 2*dim inputs laid out as
// [gate(dim) | up(dim)], y[i] = silu(gate[i]) * up[i] with silu(g) = g / (1 + exp(-g)).
// swiglu_ref is the plain C++ reference twin (and CPU path) of the CUDA kernel in swiglu.cu.
#include <cstddef>

#include "core/error.h"
#include "kernels/bf16.h"

namespace spark::kernels {

/// Reference SwiGLU over `rows` rows: gate_up is rows x (2*dim), y is rows x dim. Computes
/// in double.
void swiglu_ref(const float* gate_up, float* y, size_t rows, size_t dim);
/// Reference BF16 SwiGLU: widens to float, computes as swiglu_ref, rounds to bfloat16.
void swiglu_bf16_ref(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim);

/// Checks SwiGLU arguments (non-null pointers when rows > 0, dim > 0, sizes that fit).
Status swiglu_check_args(const void* gate_up, const void* y, size_t rows, size_t dim,
                         size_t elem_size);

/// SwiGLU on the GPU for host arrays (allocates, copies, launches, synchronises). fp32 math.
Status swiglu_cuda(const float* gate_up_host, float* y_host, size_t rows, size_t dim);
/// The same for bfloat16 host arrays (fp32 math, output rounded to bfloat16).
Status swiglu_bf16_cuda(const bf16_bits* gate_up_host, bf16_bits* y_host, size_t rows, size_t dim);
/// SwiGLU on device pointers, enqueued on `stream` (a cudaStream_t; nullptr = default).
Status swiglu_cuda_device(const float* gate_up_dev, float* y_dev, size_t rows, size_t dim,
                          void* stream);
/// BF16 variant of swiglu_cuda_device (pointers to __nv_bfloat16).
Status swiglu_bf16_cuda_device(const bf16_bits* gate_up_dev, bf16_bits* y_dev, size_t rows,
                               size_t dim, void* stream);

}  // namespace spark::kernels
