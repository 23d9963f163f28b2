#pragma once
// Embedding lookup: out[t] = table[ids[t]], rows of `dim` elements. embedding_ref is the CPU
// twin of the CUDA kernel in embedding.cu. An id outside [0, vocab) gives a row of zeros
// on both devices (the engine validates ids before; the kernel must not read out of bounds).
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// Reference lookup over float rows: out is [n][dim], table is [vocab][dim].
void embedding_ref(const float* table, size_t vocab, size_t dim, const int32_t* ids, size_t n,
                   float* out);

/// Checks the arguments of the embedding entry points (non-null when n > 0, dim > 0).
Status embedding_check_args(const void* table, size_t vocab, size_t dim, const int32_t* ids,
                            size_t n, const void* out);

/// Lookup on device pointers (table and out both of type `dt`, ids on the device), on
/// `stream` (a cudaStream_t; nullptr = the default stream).
Status embedding_cuda_device(DType dt, const void* table, size_t vocab, size_t dim,
                             const int32_t* ids, size_t n, void* out, void* stream);

}  // namespace spark::kernels
