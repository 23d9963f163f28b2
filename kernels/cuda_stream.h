#pragma once
// CUDA runtime services the engine's CUDA device needs, for callers without CUDA headers:
// the current device, streams, events, async copies, page-locked host memory, free memory,
// and CUDA graphs (capture a stream's work once, replay it with one launch). Streams,
// events and graphs are passed as void* (cudaStream_t, cudaEvent_t, cudaGraphExec_t). In a
// build without CUDA every call returns Errc::unsupported ("built without CUDA").
#include <cstddef>
#include <cstdint>

#include "core/error.h"

namespace spark::kernels {

/// Makes `device` current for this thread (cudaSetDevice).
Status cuda_set_device(int device);

/// Free and total memory of the current device (cudaMemGetInfo).
struct CudaMemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
Result<CudaMemInfo> cuda_mem_info();

/// Device memory (cudaMalloc) and its release; Errc::resource naming the size when it does
/// not fit.
Result<void*> cuda_malloc(size_t bytes);
void cuda_free(void* p);

/// Page-locked host memory (cudaMallocHost) and its release.
Result<void*> cuda_host_alloc(size_t bytes);
void cuda_host_free(void* p);

/// Page-locked host memory that the GPU addresses in place (cudaHostAlloc with
/// cudaHostAllocMapped): `host` for the CPU to write, `device` for kernels to read (the same
/// address where the device uses host pointers directly). Released with cuda_host_free(host).
struct MappedHostMemory {
  void* host = nullptr;
  void* device = nullptr;
};
Result<MappedHostMemory> cuda_host_alloc_mapped(size_t bytes);

/// A non-blocking stream, and its release.
Result<void*> cuda_stream_create();
void cuda_stream_destroy(void* stream);
/// Waits for the stream's work and reports errors raised by it.
Status cuda_stream_synchronize(void* stream);

/// Copies enqueued on `stream` (cudaMemcpyAsync with cudaMemcpyDefault: any direction).
Status cuda_memcpy_async(void* dst, const void* src, size_t bytes, void* stream);
/// Sets `bytes` at dst to `value` on `stream`.
Status cuda_memset_async(void* dst, int value, size_t bytes, void* stream);

/// Events for timing device work.
Result<void*> cuda_event_create();
void cuda_event_destroy(void* event);
Status cuda_event_record(void* event, void* stream);
/// Waits until the work recorded before `event` is done.
Status cuda_event_synchronize(void* event);
/// Milliseconds between two recorded events (waits for `end`).
Result<float> cuda_event_elapsed_ms(void* start, void* end);

/// Starts capturing `stream`'s work into a graph (thread-local capture mode: work enqueued
/// by other threads is not affected).
Status cuda_graph_begin_capture(void* stream);
/// Ends the capture and instantiates it; returns the executable graph.
Result<void*> cuda_graph_end_capture(void* stream);
/// Replays an executable graph on `stream`.
Status cuda_graph_launch(void* graph_exec, void* stream);
void cuda_graph_destroy(void* graph_exec);

/// Reads `bytes` (a multiple of 16) at `src` with 16-byte loads over the whole device and
/// stores one word per block into `sink` (so the reads cannot be optimised away): the
/// memory-read ceiling the benchmark measures. `sink` needs 4 * 4096 bytes.
Status cuda_read_bandwidth_kernel(const void* src, size_t bytes, void* sink, void* stream);

/// fp32 to bf16 (round to nearest even) on the device, `n` elements, on `stream`.
Status cuda_f32_to_bf16(const float* src, void* dst, size_t n, void* stream);

}  // namespace spark::kernels
