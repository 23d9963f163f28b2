#include "daemon/engine/fabric_test.h"

#include <algorithm>
#include <chrono>

#include "core/strings.h"
#include "daemon/engine/nccl_collective.h"
#include "kernels/cuda_runtime.h"
#include "kernels/fabric_check.h"

namespace spark::engine {

Result<FabricReport> run_fabric_test(NcclCollective& comm, const FabricOptions& o,
                                     const FabricExpect& expect, const std::string& debug_file) {
  const auto t0 = std::chrono::steady_clock::now();
  FabricReport r;
  r.rank = comm.rank();
  r.world = comm.world_size();
  r.node = expect.node;
  const int world = r.world;
  auto out = kernels::DeviceMemory::allocate(o.max_bytes);
  if (!out) return out.error();
  auto in = kernels::DeviceMemory::allocate(std::max<size_t>(o.max_bytes / world, 16));
  if (!in) return in.error();
  auto counter = kernels::DeviceMemory::allocate(sizeof(unsigned long long));
  if (!counter) return counter.error();
  auto timer = kernels::StreamTimer::create();
  if (!timer) return timer.error();
  void* const stream = nullptr;
  auto* buf = static_cast<float*>(out->get());
  auto* src = static_cast<float*>(in->get());
  auto* wrong = static_cast<unsigned long long*>(counter->get());

  for (size_t bytes : fabric_sizes(o.min_bytes, o.max_bytes)) {
    for (const char* op : {"all_reduce", "all_gather"}) {
      FabricPoint p;
      p.op = op;
      p.bytes = bytes;
      p.count = bytes / sizeof(float);
      const bool ar = p.op == "all_reduce";
      const size_t cpr = p.count / static_cast<size_t>(world);
      if (!ar && cpr == 0) continue;
      if (!ar) p.count = cpr * static_cast<size_t>(world), p.bytes = p.count * sizeof(float);
      const uint64_t seed = o.seed ^ (bytes * 2 + (ar ? 0 : 1));
      auto fill = [&] {
        return ar ? kernels::fabric_fill_device(buf, p.count, r.rank, seed, stream)
                  : kernels::fabric_fill_device(src, cpr, r.rank, seed, stream);
      };
      auto run = [&] {
        return ar ? comm.all_reduce_sum_device(buf, p.count, DType::f32, stream)
                  : comm.all_gather_device(src, buf, cpr, DType::f32, stream);
      };
      SPARK_TRY(fill());
      for (int i = 0; i < o.warmup; ++i) SPARK_TRY(run());
      p.iters = fabric_iters(p.bytes);
      SPARK_TRY(timer->start(stream));
      for (int i = 0; i < p.iters; ++i) SPARK_TRY(run());
      SPARK_TRY(timer->stop(stream));
      SPARK_TRY(comm.synchronize(stream, o.timeout));
      auto ms = timer->elapsed_ms();
      if (!ms) return ms.error();
      p.time_us = *ms * 1e3 / p.iters;
      fabric_bandwidth(p, world);
      // The check runs on a fresh result: the timed all-reduces summed in place.
      const unsigned long long zero = 0;
      SPARK_TRY(counter->copy_from_host(&zero, sizeof(zero)));
      SPARK_TRY(fill());
      SPARK_TRY(run());
      SPARK_TRY(
          ar ? kernels::fabric_count_wrong_allreduce_device(buf, p.count, world, seed, wrong,
                                                            stream)
             : kernels::fabric_count_wrong_allgather_device(buf, cpr, world, seed, wrong, stream));
      SPARK_TRY(comm.synchronize(stream, o.timeout));
      unsigned long long w = 0;
      SPARK_TRY(counter->copy_to_host(&w, sizeof(w)));
      p.wrong = w;
      if (ar && bytes == (8u << 10)) r.decode_latency_us_8k = p.time_us;
      if (ar && bytes == (16u << 10)) r.decode_latency_us_16k = p.time_us;
      r.points.push_back(p);
    }
  }
  if (!debug_file.empty()) {
    auto text = read_file(debug_file);
    if (text) r.nccl = parse_nccl_debug(*text, r.rank);
  }
  judge_fabric(r, expect);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace spark::engine
