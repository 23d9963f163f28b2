// Device-to-device copies on a stream.
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda_check.cuh"
#include "kernels/device_copy.h"

namespace spark::kernels {

Status device_copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  if (!dst || !src) return make_error(Errc::internal, "device_copy_async: null pointer");
  SPARK_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                 static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status device_copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                            size_t width, size_t rows, void* stream) {
  if (width == 0 || rows == 0) return Status::Ok();
  if (!dst || !src) return make_error(Errc::internal, "device_copy_2d_async: null pointer");
  SPARK_CUDA_TRY(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                   cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<bool> stream_done(void* stream) {
  cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  SPARK_CUDA_TRY(e);
  return true;
}

Status stream_synchronize(void* stream) {
  SPARK_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<OwnedStream> OwnedStream::create() {
  OwnedStream o;
  cudaStream_t s = nullptr;
  SPARK_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  o.s_ = s;
  return Result<OwnedStream>(std::move(o));
}

OwnedStream& OwnedStream::operator=(OwnedStream&& o) noexcept {
  std::swap(s_, o.s_);
  return *this;
}

OwnedStream::~OwnedStream() {
  if (s_) cudaStreamDestroy(static_cast<cudaStream_t>(s_));
}

Result<CapturedGraph> CapturedGraph::capture(void* stream, const std::function<Status()>& body) {
  auto s = static_cast<cudaStream_t>(stream);
  SPARK_CUDA_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  Status inner = body();
  cudaGraph_t g = nullptr;
  cudaError_t end = cudaStreamEndCapture(s, &g);
  if (!inner.ok()) {
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError();
    return inner.error();
  }
  SPARK_CUDA_TRY(end);
  CapturedGraph out;
  out.g_ = g;
  cudaGraphExec_t e = nullptr;
  SPARK_CUDA_TRY(cudaGraphInstantiate(&e, g, 0));
  out.e_ = e;
  return Result<CapturedGraph>(std::move(out));
}

CapturedGraph& CapturedGraph::operator=(CapturedGraph&& o) noexcept {
  std::swap(g_, o.g_), std::swap(e_, o.e_);
  return *this;
}

CapturedGraph::~CapturedGraph() {
  if (e_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e_));
  if (g_) cudaGraphDestroy(static_cast<cudaGraph_t>(g_));
}

Status CapturedGraph::launch(void* stream) {
  SPARK_CUDA_TRY(
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(e_), static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

}  // namespace spark::kernels
