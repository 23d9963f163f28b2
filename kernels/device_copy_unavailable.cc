// device_copy_async in a build without CUDA: it says so instead of failing to link.
#if !defined(SPARK_HAVE_CUDA)

#include <string>
#include <utility>

#include "kernels/device_copy.h"

namespace spark::kernels {

namespace {
Error no_cuda(const char* what) {
  return make_error(Errc::unsupported,
                    std::string(what) +
                        ": built without CUDA (nvcc was not found at configure time; "
                        "reconfigure with CUDA installed and SPARK_CUDA=ON)");
}
}  // namespace

Status device_copy_async(void*, const void*, size_t bytes, void*) {
  if (bytes == 0) return Status::Ok();
  return no_cuda("device_copy_async");
}
Status device_copy_2d_async(void*, size_t, const void*, size_t, size_t width, size_t rows, void*) {
  if (width == 0 || rows == 0) return Status::Ok();
  return no_cuda("device_copy_2d_async");
}
Result<bool> stream_done(void*) {
  return no_cuda("stream_done");
}
Status stream_synchronize(void*) {
  return no_cuda("stream_synchronize");
}
Result<OwnedStream> OwnedStream::create() {
  return no_cuda("OwnedStream::create");
}
OwnedStream& OwnedStream::operator=(OwnedStream&& o) noexcept {
  std::swap(s_, o.s_);
  return *this;
}
OwnedStream::~OwnedStream() = default;
Result<CapturedGraph> CapturedGraph::capture(void*, const std::function<Status()>&) {
  return no_cuda("CapturedGraph::capture");
}
CapturedGraph& CapturedGraph::operator=(CapturedGraph&& o) noexcept {
  std::swap(g_, o.g_), std::swap(e_, o.e_);
  return *this;
}
CapturedGraph::~CapturedGraph() = default;
Status CapturedGraph::launch(void*) {
  return no_cuda("CapturedGraph::launch");
}

}  // namespace spark::kernels

#endif
