#pragma once
// Device-to-device copies enqueued on a stream, for callers without CUDA headers (the
// one-rank collective's all-gather). In a build without CUDA the call returns
// Errc::unsupported.
#include <cstddef>

#include "core/error.h"

namespace spark::kernels {

/// Enqueues a copy of `bytes` bytes of device memory from `src` to `dst` on the CUDA stream
/// `stream` (nullptr: the default stream); capturable in a CUDA graph. Does not wait.
Status device_copy_async(void* dst, const void* src, size_t bytes, void* stream);

}  // namespace spark::kernels
