#pragma once
// Device-to-device copies and stream queries, for callers without CUDA headers (the one-rank
// collective's all-gather, the NCCL collective's deadline waits). In a build without CUDA
// every call returns Errc::unsupported.
#include <cstddef>

#include "core/error.h"

namespace spark::kernels {

/// Enqueues a copy of `bytes` bytes of device memory from `src` to `dst` on the CUDA stream
/// `stream` (nullptr: the default stream); capturable in a CUDA graph. Does not wait.
Status device_copy_async(void* dst, const void* src, size_t bytes, void* stream);

/// True when every operation enqueued on `stream` so far has finished (cudaStreamQuery),
/// false while some still run; an error the stream's work raised as its Error.
Result<bool> stream_done(void* stream);

/// Blocks until `stream` is idle (cudaStreamSynchronize) and reports its work's errors.
Status stream_synchronize(void* stream);

}  // namespace spark::kernels
