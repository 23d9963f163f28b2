// The fabric check's kernels: seeded fill, and #wrong of an all-reduce or all-gather result.
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda_check.cuh"
#include "kernels/fabric_check.h"

namespace spark::kernels {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 4096 ? (b ? b : 1) : 4096);  // grid-stride beyond that
}

__global__ void fill_kernel(float* buf, size_t count, int rank, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x)
    buf[i] = fabric_value(seed, rank, i);
}

__device__ void add_wrong(unsigned long long mine, unsigned long long* wrong) {
  // One atomic per warp that saw a wrong value, not per element.
  for (int off = 16; off > 0; off >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, off);
  if ((threadIdx.x & 31) == 0 && mine) atomicAdd(wrong, mine);
}

__global__ void wrong_allreduce_kernel(const float* buf, size_t count, int world, uint64_t seed,
                                       unsigned long long* wrong) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += fabric_value(seed, r, i);
    mine += buf[i] != want;
  }
  add_wrong(mine, wrong);
}

__global__ void wrong_allgather_kernel(const float* buf, size_t count_per_rank, int world,
                                       uint64_t seed, unsigned long long* wrong) {
  unsigned long long mine = 0;
  const size_t total = count_per_rank * static_cast<size_t>(world);
  for (size_t j = blockIdx.x * size_t(blockDim.x) + threadIdx.x; j < total;
       j += size_t(gridDim.x) * blockDim.x) {
    int r = static_cast<int>(j / count_per_rank);
    mine += buf[j] != fabric_value(seed, r, j - static_cast<size_t>(r) * count_per_rank);
  }
  add_wrong(mine, wrong);
}

}  // namespace

Status fabric_fill_device(float* buf, size_t count, int rank, uint64_t seed, void* stream) {
  if (count == 0) return Status::Ok();
  fill_kernel<<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(buf, count,
                                                                                     rank, seed);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status fabric_count_wrong_allreduce_device(const float* buf, size_t count, int world, uint64_t seed,
                                           unsigned long long* wrong, void* stream) {
  if (count == 0) return Status::Ok();
  wrong_allreduce_kernel<<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      buf, count, world, seed, wrong);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status fabric_count_wrong_allgather_device(const float* buf, size_t count_per_rank, int world,
                                           uint64_t seed, unsigned long long* wrong, void* stream) {
  const size_t total = count_per_rank * static_cast<size_t>(world);
  if (total == 0) return Status::Ok();
  wrong_allgather_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      buf, count_per_rank, world, seed, wrong);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Result<StreamTimer> StreamTimer::create() {
  StreamTimer t;
  cudaEvent_t a = nullptr, b = nullptr;
  SPARK_CUDA_TRY(cudaEventCreate(&a));
  t.a_ = a;
  SPARK_CUDA_TRY(cudaEventCreate(&b));
  t.b_ = b;
  return Result<StreamTimer>(std::move(t));
}

StreamTimer& StreamTimer::operator=(StreamTimer&& o) noexcept {
  std::swap(a_, o.a_), std::swap(b_, o.b_);
  return *this;
}

StreamTimer::~StreamTimer() {
  if (a_) cudaEventDestroy(static_cast<cudaEvent_t>(a_));
  if (b_) cudaEventDestroy(static_cast<cudaEvent_t>(b_));
}

Status StreamTimer::start(void* stream) {
  SPARK_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(a_), static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status StreamTimer::stop(void* stream) {
  SPARK_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(b_), static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<double> StreamTimer::elapsed_ms() const {
  float ms = 0;
  SPARK_CUDA_TRY(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a_), static_cast<cudaEvent_t>(b_)));
  return static_cast<double>(ms);
}

}  // namespace spark::kernels
