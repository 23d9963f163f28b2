#pragma once
// Device-to-device copies and stream queries, for callers without CUDA headers (the one-rank
// collective's all-gather, the NCCL collective's deadline waits). In a build without CUDA
// every call returns Errc::unsupported.
#include <cstddef>
#include <functional>

#include "core/error.h"

namespace spark::kernels {

/// Enqueues a copy of `bytes` bytes of device memory from `src` to `dst` on the CUDA stream
/// `stream` (nullptr: the default stream); capturable in a CUDA graph. Does not wait.
Status device_copy_async(void* dst, const void* src, size_t bytes, void* stream);

/// Enqueues a strided copy of `rows` rows of `width` bytes, from `src` (rows `src_pitch`
/// bytes apart) to `dst` (rows `dst_pitch` bytes apart), device to device on `stream`
/// (cudaMemcpy2DAsync); capturable in a CUDA graph. Does not wait.
Status device_copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                            size_t width, size_t rows, void* stream);

/// True when every operation enqueued on `stream` so far has finished (cudaStreamQuery),
/// false while some still run; an error the stream's work raised as its Error.
Result<bool> stream_done(void* stream);

/// Blocks until `stream` is idle (cudaStreamSynchronize) and reports its work's errors.
Status stream_synchronize(void* stream);

/// A non-blocking CUDA stream owned by one object (destroyed with it); move-only.
class OwnedStream {
 public:
  static Result<OwnedStream> create();
  OwnedStream() = default;
  OwnedStream(OwnedStream&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  OwnedStream& operator=(OwnedStream&& o) noexcept;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream();
  void* get() const { return s_; }

 private:
  void* s_ = nullptr;
};

/// A CUDA graph captured from the work `body` enqueues on a stream (global capture mode), then
/// instantiated; launch() replays it. Move-only.
class CapturedGraph {
 public:
  /// Captures `body` on `stream` (not the legacy default stream); a failure inside body ends
  /// the capture and comes back as the Error.
  static Result<CapturedGraph> capture(void* stream, const std::function<Status()>& body);
  CapturedGraph() = default;
  CapturedGraph(CapturedGraph&& o) noexcept : g_(o.g_), e_(o.e_) { o.g_ = o.e_ = nullptr; }
  CapturedGraph& operator=(CapturedGraph&& o) noexcept;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph();
  /// Enqueues one replay of the graph on `stream`.
  Status launch(void* stream);

 private:
  void* g_ = nullptr;
  void* e_ = nullptr;
};

}  // namespace spark::kernels
