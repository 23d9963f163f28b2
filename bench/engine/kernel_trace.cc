// libspark_kernel_trace.so: a CUDA injection library that records every kernel, copy and
// memset a process runs on the GPU, with the device's start and end times, through CUPTI's
// activity API. It is for the machines where no Nsight Systems is installed: run any binary
// with
//   CUDA_INJECTION64_PATH=/path/libspark_kernel_trace.so SPARK_TRACE_OUT=trace.csv BINARY ...
// and bench/engine/trace_summary.py reads the file. Kernels are recorded concurrently
// (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), so the overlap that programmatic dependent
// launch gives stays visible, unlike a profiler that serialises kernels; kernels replayed
// from a CUDA graph carry the graph's id and their node's id. SPARK_TRACE_API=1 also
// records the host side of the runtime and driver calls (cudaGraphLaunch,
// cudaStreamSynchronize, ...), which adds about a microsecond to each call.
//
// Output: one CSV line per record,
//   kind,start_ns,end_ns,stream,graph_id,graph_node,correlation,name
// kind is kernel, memcpy, memset, runtime or driver; times are CUPTI's clock (ns).
#include <cupti.h>
#include <cxxabi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

std::mutex g_mu;
FILE* g_out = nullptr;
std::atomic<bool> g_done{false};
constexpr size_t kBufferBytes = size_t{8} << 20;

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = (status == 0 && d) ? d : name;
  std::free(d);
  for (char& c : s)
    if (c == ',' || c == '\n') c = ';';  // one CSV field
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lk(g_mu);
  CUpti_Activity* rec = nullptr;
  while (g_out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        std::fprintf(g_out, "kernel,%llu,%llu,%u,%u,%llu,%u,%s\n",
                     static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->streamId, k->graphId,
                     static_cast<unsigned long long>(k->graphNodeId), k->correlationId,
                     demangle(k->name).c_str());
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        std::fprintf(g_out, "memcpy,%llu,%llu,%u,%u,%llu,%u,copy kind %u bytes %llu\n",
                     static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId, m->graphId,
                     static_cast<unsigned long long>(m->graphNodeId), m->correlationId,
                     static_cast<unsigned>(m->copyKind), static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        std::fprintf(g_out, "memset,%llu,%llu,%u,%u,%llu,%u,bytes %llu\n",
                     static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId, m->graphId,
                     static_cast<unsigned long long>(m->graphNodeId), m->correlationId,
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        const bool rt = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        cuptiGetCallbackName(rt ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid,
                             &name);
        std::fprintf(g_out, "%s,%llu,%llu,0,0,0,%u,%s\n", rt ? "runtime" : "driver",
                     static_cast<unsigned long long>(a->start),
                     static_cast<unsigned long long>(a->end), a->correlationId, name ? name : "?");
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void finish() {
  if (g_done.exchange(true)) return;
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

bool enable(CUpti_ActivityKind kind, const char* what) {
  const CUptiResult r = cuptiActivityEnable(kind);
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "spark_kernel_trace: cannot record %s: %s\n", what, msg ? msg : "?");
  return false;
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  const char* path = std::getenv("SPARK_TRACE_OUT");
  if (!path || !*path) path = "spark_kernel_trace.csv";
  g_out = std::fopen(path, "w");
  if (!g_out) {
    std::fprintf(stderr, "spark_kernel_trace: cannot write %s: %s\n", path, std::strerror(errno));
    return 0;
  }
  std::fprintf(g_out, "kind,start_ns,end_ns,stream,graph_id,graph_node,correlation,name\n");
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "spark_kernel_trace: cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  bool ok = enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "kernels") &&
            enable(CUPTI_ACTIVITY_KIND_MEMCPY, "copies") &&
            enable(CUPTI_ACTIVITY_KIND_MEMSET, "memsets");
  const char* api = std::getenv("SPARK_TRACE_API");
  if (ok && api && std::strcmp(api, "1") == 0)
    ok = enable(CUPTI_ACTIVITY_KIND_RUNTIME, "runtime calls") &&
         enable(CUPTI_ACTIVITY_KIND_DRIVER, "driver calls");
  if (!ok) return 0;
  std::atexit(finish);
  std::fprintf(stderr, "spark_kernel_trace: recording to %s\n", path);
  return 1;
}
