// cuda_stream.h in a build without CUDA: every call says so.
#if !defined(SPARK_HAVE_CUDA)

#include <string>

#include "kernels/cuda_stream.h"

namespace spark::kernels {
namespace {
Error no_cuda(const char* what) {
  return make_error(Errc::unsupported,
                    std::string(what) +
                        ": built without CUDA (nvcc was not found at configure time; "
                        "reconfigure with CUDA installed and SPARK_CUDA=ON)");
}
}  // namespace

Status cuda_set_device(int) {
  return no_cuda("cuda_set_device");
}
Result<CudaMemInfo> cuda_mem_info() {
  return no_cuda("cuda_mem_info");
}
Result<void*> cuda_malloc(size_t) {
  return no_cuda("cuda_malloc");
}
void cuda_free(void*) {}
Result<void*> cuda_host_alloc(size_t) {
  return no_cuda("cuda_host_alloc");
}
Result<MappedHostMemory> cuda_host_alloc_mapped(size_t) {
  return no_cuda("cuda_host_alloc_mapped");
}
void cuda_host_free(void*) {}
Result<void*> cuda_stream_create() {
  return no_cuda("cuda_stream_create");
}
void cuda_stream_destroy(void*) {}
Status cuda_stream_synchronize(void*) {
  return no_cuda("cuda_stream_synchronize");
}
Status cuda_memcpy_async(void*, const void*, size_t, void*) {
  return no_cuda("cuda_memcpy_async");
}
Status cuda_memset_async(void*, int, size_t, void*) {
  return no_cuda("cuda_memset_async");
}
Result<void*> cuda_event_create() {
  return no_cuda("cuda_event_create");
}
void cuda_event_destroy(void*) {}
Status cuda_event_record(void*, void*) {
  return no_cuda("cuda_event_record");
}
Status cuda_event_synchronize(void*) {
  return no_cuda("cuda_event_synchronize");
}
Result<float> cuda_event_elapsed_ms(void*, void*) {
  return no_cuda("cuda_event_elapsed_ms");
}
Status cuda_graph_begin_capture(void*) {
  return no_cuda("cuda_graph_begin_capture");
}
Result<void*> cuda_graph_end_capture(void*) {
  return no_cuda("cuda_graph_end_capture");
}
Status cuda_graph_launch(void*, void*) {
  return no_cuda("cuda_graph_launch");
}
void cuda_graph_destroy(void*) {}
Status cuda_read_bandwidth_kernel(const void*, size_t, void*, void*) {
  return no_cuda("cuda_read_bandwidth_kernel");
}
Status cuda_f32_to_bf16(const float*, void*, size_t, void*) {
  return no_cuda("cuda_f32_to_bf16");
}

}  // namespace spark::kernels

#endif
