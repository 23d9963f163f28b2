// device_copy_async in a build without CUDA: it says so instead of failing to link.
#if !defined(SPARK_HAVE_CUDA)

#include <string>

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
Result<bool> stream_done(void*) {
  return no_cuda("stream_done");
}
Status stream_synchronize(void*) {
  return no_cuda("stream_synchronize");
}

}  // namespace spark::kernels

#endif
