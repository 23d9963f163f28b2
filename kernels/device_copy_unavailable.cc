// device_copy_async in a build without CUDA: it says so instead of failing to link.
#if !defined(SPARK_HAVE_CUDA)

#include "kernels/device_copy.h"

namespace spark::kernels {

Status device_copy_async(void*, const void*, size_t bytes, void*) {
  if (bytes == 0) return Status::Ok();
  return make_error(Errc::unsupported,
                    "device_copy_async: built without CUDA (nvcc was not found at configure "
                    "time; reconfigure with CUDA installed and SPARK_CUDA=ON)");
}

}  // namespace spark::kernels

#endif
