// CUDA runtime services for the engine (see cuda_stream.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda_check.cuh"
#include "kernels/cuda_stream.h"

namespace spark::kernels {

namespace {
cudaStream_t S(void* s) {
  return static_cast<cudaStream_t>(s);
}
}  // namespace

Status cuda_set_device(int device) {
  SPARK_CUDA_TRY(cudaSetDevice(device));
  return Status::Ok();
}

Result<CudaMemInfo> cuda_mem_info() {
  CudaMemInfo m;
  SPARK_CUDA_TRY(cudaMemGetInfo(&m.free_bytes, &m.total_bytes));
  return m;
}

Result<void*> cuda_malloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return make_error(detail::errc_for_cuda(e), "cudaMalloc of " + std::to_string(bytes >> 20) +
                                                    " MiB failed: " + cudaGetErrorName(e) + ": " +
                                                    cudaGetErrorString(e));
  }
  return p;
}

void cuda_free(void* p) {
  if (p) cudaFree(p);
}

Result<void*> cuda_host_alloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return make_error(detail::errc_for_cuda(e), "cudaMallocHost of " + std::to_string(bytes >> 20) +
                                                    " MiB failed: " + cudaGetErrorName(e) + ": " +
                                                    cudaGetErrorString(e));
  }
  return p;
}

Result<MappedHostMemory> cuda_host_alloc_mapped(size_t bytes) {
  MappedHostMemory m;
  cudaError_t e = cudaHostAlloc(&m.host, bytes ? bytes : 1, cudaHostAllocMapped);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return make_error(detail::errc_for_cuda(e),
                      "cudaHostAlloc (mapped) of " + std::to_string(bytes >> 20) +
                          " MiB failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
  e = cudaHostGetDevicePointer(&m.device, m.host, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaFreeHost(m.host);
    return make_error(detail::errc_for_cuda(e), std::string("cudaHostGetDevicePointer failed: ") +
                                                    cudaGetErrorName(e) + ": " +
                                                    cudaGetErrorString(e));
  }
  return m;
}

void cuda_host_free(void* p) {
  if (p) cudaFreeHost(p);
}

Result<void*> cuda_stream_create() {
  cudaStream_t s = nullptr;
  SPARK_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return static_cast<void*>(s);
}

void cuda_stream_destroy(void* stream) {
  if (stream) cudaStreamDestroy(S(stream));
}

Status cuda_stream_synchronize(void* stream) {
  SPARK_CUDA_TRY(cudaStreamSynchronize(S(stream)));
  return Status::Ok();
}

Status cuda_memcpy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  SPARK_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, S(stream)));
  return Status::Ok();
}

Status cuda_memset_async(void* dst, int value, size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  SPARK_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, S(stream)));
  return Status::Ok();
}

Result<void*> cuda_event_create() {
  cudaEvent_t e = nullptr;
  SPARK_CUDA_TRY(cudaEventCreate(&e));
  return static_cast<void*>(e);
}

void cuda_event_destroy(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

Status cuda_event_record(void* event, void* stream) {
  SPARK_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), S(stream)));
  return Status::Ok();
}

Status cuda_event_synchronize(void* event) {
  SPARK_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return Status::Ok();
}

Result<float> cuda_event_elapsed_ms(void* start, void* end) {
  SPARK_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
  float ms = 0;
  SPARK_CUDA_TRY(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

Status cuda_graph_begin_capture(void* stream) {
  SPARK_CUDA_TRY(cudaStreamBeginCapture(S(stream), cudaStreamCaptureModeThreadLocal));
  return Status::Ok();
}

Result<void*> cuda_graph_end_capture(void* stream) {
  cudaGraph_t g = nullptr;
  SPARK_CUDA_TRY(cudaStreamEndCapture(S(stream), &g));
  cudaGraphExec_t exec = nullptr;
  cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return detail::cuda_error(e, "cudaGraphInstantiate", __FILE__, __LINE__);
  }
  return static_cast<void*>(exec);
}

Status cuda_graph_launch(void* graph_exec, void* stream) {
  SPARK_CUDA_TRY(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_exec), S(stream)));
  return Status::Ok();
}

void cuda_graph_destroy(void* graph_exec) {
  if (graph_exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_exec));
}

namespace {

__global__ void read_kernel(const uint4* __restrict__ src, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent 16-byte loads in flight per thread.
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
          d = __ldcs(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = __ldcs(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicXor(sink + (blockIdx.x & 4095), acc);
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                   size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = __float2bfloat16_rn(src[i]);
}

}  // namespace

Status cuda_read_bandwidth_kernel(const void* src, size_t bytes, void* sink, void* stream) {
  if (bytes % 16 != 0) return make_error(Errc::usage, "cuda_read_bandwidth_kernel: bytes % 16");
  int dev = 0, sms = 0;
  SPARK_CUDA_TRY(cudaGetDevice(&dev));
  SPARK_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  read_kernel<<<static_cast<unsigned>(sms) * 8, 512, 0, S(stream)>>>(
      static_cast<const uint4*>(src), bytes / 16, static_cast<unsigned*>(sink));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status cuda_f32_to_bf16(const float* src, void* dst, size_t n, void* stream) {
  if (n == 0) return Status::Ok();
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 65535));
  f32_to_bf16_kernel<<<blocks, 256, 0, S(stream)>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
