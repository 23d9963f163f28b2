// Kernel benchmark: one run measures the device's HBM read bandwidth (a read kernel of our
// own and a device-to-device copy), then each kernel against it (memory-bound kernels as a
// share of that bandwidth, matrix products also in TFLOP/s), with cuBLASLt and the own
// decode kernel side by side on every Llama-3-8B projection shape. Each timing replays a
// CUDA graph of many launches (launch gaps hidden) over inputs rotated among enough copies
// to exceed the L2 cache, median of several replays. Inputs are random, never zeros.
//
// The sampler rows time the staged sampler against the previous one-block-per-row kernel
// (sample_cuda_device_v1) on the same batch, with the row's floors: its bytes over the HBM
// rate, over the L2 rate (the engine's logits were just written by lm_head and sit in L2)
// and over what one multiprocessor reads alone.
//
// Usage: spark_kernel_bench [--json FILE] [--quick] [--only SECTION,...]
// Sections: matmul, forms, fused, layer (batch 1), layer8 (8 rows), fp8 (the FP8 decode
// product beside the bf16 own kernel), fp8prefill (the FP8 prefill product: on the FP8 tensor
// cores beside the dequantized bf16 tiles, against the FP8 peak measured in the same run),
// moe (MXFP4 experts beside bf16 ones), decode, prefill
// (attention = both), mla (DeepSeek-V3's latent attention decode at batch 1), other, sampler;
// the HBM read and the bf16 product peak are measured in every run, as every row is read
// against them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "kernels/fp8.h"
#include "kernels/matmul.h"
#include "kernels/mla.h"
#include "kernels/moe.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/swiglu.h"

using namespace spark::kernels;
using json = nlohmann::json;

namespace {

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define ST(x)                                                                        \
  do {                                                                               \
    auto s_ = (x);                                                                   \
    if (!s_.ok()) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.message().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__global__ void fill_random(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    const float f = (static_cast<float>(x & 0xffffff) / 16777216.f - 0.5f) * 2.f * scale;
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    p[i] = *reinterpret_cast<uint16_t*>(&b);
  }
}

__global__ void read_kernel(const uint4* p, size_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(sink, 1u);  // keeps the loads; practically never taken
}

void* dalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes));
  return p;
}
void* random_bf16(size_t n, uint32_t seed, float scale = 1.f) {
  void* p = dalloc(n * 2);
  fill_random<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed, scale);
  CK(cudaGetLastError());
  return p;
}

// Random e4m3 codes (never the NaN codes 0x7f, 0xff) and block scales.
__global__ void fill_fp8(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    uint8_t b = static_cast<uint8_t>(x);
    if ((b & 0x7f) == 0x7f) b ^= 1;
    p[i] = b;
  }
}
// Random e8m0 scale bytes near 2^-7 (never 0xff, the NaN byte).
__global__ void fill_e8m0(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    p[i] = static_cast<uint8_t>(118 + (x & 3));
  }
}
__global__ void fill_scales(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    p[i] = (1.f + static_cast<float>(x & 0xffff) / 65536.f) / 8192.f;
  }
}

// `sets` routes of `rows` rows each choosing `k` distinct experts of `experts` at random
// (ids [sets][rows][k], every weight `weight`) on the device, and the mean number of distinct
// experts a set chooses.
struct RouteSets {
  int32_t* ids = nullptr;
  float* weights = nullptr;
  double distinct = 0;
};
RouteSets route_sets(int sets, int rows, int experts, int k, float weight, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(sets * rows * k));
  std::vector<float> wts(ids.size(), weight);
  std::vector<int32_t> all(static_cast<size_t>(experts));
  RouteSets r;
  for (int set = 0; set < sets; ++set) {
    std::vector<char> seen(static_cast<size_t>(experts), 0);
    for (int row = 0; row < rows; ++row) {
      for (int e = 0; e < experts; ++e) all[static_cast<size_t>(e)] = e;
      std::shuffle(all.begin(), all.end(), rng);
      for (int j = 0; j < k; ++j) {
        const int32_t e = all[static_cast<size_t>(j)];
        ids[static_cast<size_t>((set * rows + row) * k + j)] = e;
        r.distinct += !seen[static_cast<size_t>(e)];
        seen[static_cast<size_t>(e)] = 1;
      }
    }
  }
  r.distinct /= sets;
  r.ids = static_cast<int32_t*>(dalloc(ids.size() * sizeof(int32_t)));
  r.weights = static_cast<float*>(dalloc(wts.size() * sizeof(float)));
  CK(cudaMemcpy(r.ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(r.weights, wts.data(), wts.size() * sizeof(float), cudaMemcpyHostToDevice));
  return r;
}

// Median time in microseconds of one call of `body(i)` (i = the rotation index), from
// replays of a graph of `per_graph` calls.
double time_us(cudaStream_t st, int per_graph, const std::function<void(int)>& body,
               int replays = 7) {
  for (int i = 0; i < 3; ++i) body(i);  // warm-up outside capture (plans, attributes)
  CK(cudaStreamSynchronize(st));
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < per_graph; ++i) body(i);
  CK(cudaStreamEndCapture(st, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaGraphLaunch(ge, st));
  std::vector<double> t;
  for (int r = 0; r < replays; ++r) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0 / per_graph);
  }
  CK(cudaGetLastError());
  cudaEventDestroy(a), cudaEventDestroy(b);
  cudaGraphExecDestroy(ge), cudaGraphDestroy(g);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The sampler, staged kernels against the previous kernel, over batch sizes, vocabularies
// and parameter mixes; floors per row from the bytes it must read (the logits, plus the
// penalty state where penalties are on).
json sampler_bench(cudaStream_t st, double hbm_gbs, void* big, unsigned* sink,
                   const DeviceLimits& lim) {
  // What one multiprocessor reads alone (HBM, 256 MiB) and what the whole chip reads
  // from L2 (a 16 MiB buffer read over and over).
  const size_t one_bytes = size_t{256} << 20, l2_bytes = size_t{16} << 20;
  const double t_one = time_us(
      st, 2,
      [&](int) {
        read_kernel<<<1, 1024, 0, st>>>(static_cast<const uint4*>(big), one_bytes / 16, sink);
      },
      3);
  const double t_l2 = time_us(st, 50, [&](int) {
    read_kernel<<<static_cast<unsigned>(lim.sm_count * 4), 512, 0, st>>>(
        static_cast<const uint4*>(big), l2_bytes / 16, sink);
  });
  const double one_gbs = one_bytes / t_one / 1e3, l2_gbs = l2_bytes / t_l2 / 1e3;
  fmt::print(
      "\n# sampler: one multiprocessor reads {:.0f} GB/s; L2 reads {:.0f} GB/s; HBM {:.0f} GB/s\n",
      one_gbs, l2_gbs, hbm_gbs);
  fmt::print("# {:<40} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6}\n",
             "sampler (rows x vocab: mix)", "KiB/row", "floor HBM", "floor L2", "1 SM", "old us",
             "new us", "no-PDL us", "4/SM us", "speedup", "same");
  json js = json::array();
  struct Mix {
    const char* name;
    SampleParams p;
    bool penalties;
  };
  std::vector<Mix> mixes;
  {
    SampleParams g;
    g.temperature = 0;
    mixes.push_back({"greedy", g, false});
    mixes.push_back({"temperature 1", SampleParams{}, false});
    SampleParams k;
    k.top_k = 50;
    mixes.push_back({"top-k 50", k, false});
    SampleParams tp;
    tp.top_p = 0.9f;
    mixes.push_back({"top-p 0.9", tp, false});
    SampleParams all;
    all.top_k = 50, all.top_p = 0.9f, all.min_p = 0.05f, all.repetition_penalty = 1.1f,
    all.presence_penalty = 0.2f, all.frequency_penalty = 0.1f, all.logprobs = 1,
    all.top_logprobs = 20;
    mixes.push_back({"all: k50 p0.9 minp penalties top-20", all, true});
    SampleParams flat;
    flat.temperature = 2.f, flat.top_p = 0.95f;
    mixes.push_back({"temperature 2 top-p 0.95", flat, false});
  }
  for (int V : {32000, 128256, 151936}) {
    for (int rows : {1, 8, 32}) {
      const size_t n = static_cast<size_t>(rows) * V;
      void* logits = dalloc(n * 4);
      std::vector<float> hl(n);
      std::mt19937 rng(3 + V + rows);
      std::normal_distribution<float> nd(0, 3);
      for (auto& f : hl) f = nd(rng);
      CK(cudaMemcpy(logits, hl.data(), n * 4, cudaMemcpyHostToDevice));
      std::vector<uint8_t> seen(n, 0);
      std::vector<int32_t> counts(n, 0);
      std::uniform_int_distribution<int> tok(0, V - 1);
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < 300; ++i) {
          const size_t t = static_cast<size_t>(r) * V + static_cast<size_t>(tok(rng));
          seen[t] = 1;
          counts[t] += i % 3;
        }
      void* dseen = dalloc(n);
      void* dcounts = dalloc(n * 4);
      CK(cudaMemcpy(dseen, seen.data(), n, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dcounts, counts.data(), n * 4, cudaMemcpyHostToDevice));
      const size_t wbytes = sample_workspace_bytes(rows, V);
      void* ws = dalloc(wbytes);
      void* dp = dalloc(static_cast<size_t>(rows) * sizeof(SampleParams));
      void* dr = dalloc(static_cast<size_t>(rows) * sizeof(SampleResult));
      for (const auto& m : mixes) {
        std::vector<SampleParams> ps(static_cast<size_t>(rows), m.p);
        for (int r = 0; r < rows; ++r)
          ps[static_cast<size_t>(r)].seed = 1,
          ps[static_cast<size_t>(r)].request = static_cast<uint64_t>(r);
        CK(cudaMemcpy(dp, ps.data(), ps.size() * sizeof(SampleParams), cudaMemcpyHostToDevice));
        SampleBatch b;
        b.logits = logits, b.logits_stride = static_cast<size_t>(V), b.vocab = V, b.rows = rows;
        b.params = static_cast<SampleParams*>(dp);
        b.results = static_cast<SampleResult*>(dr), b.workspace = ws, b.workspace_bytes = wbytes;
        b.update_state = false;
        if (m.penalties)
          b.seen = static_cast<uint8_t*>(dseen), b.counts = static_cast<int32_t*>(dcounts);
        std::vector<SampleResult> rn(static_cast<size_t>(rows)), ro(rn.size());
        const double t_new = time_us(st, 20, [&](int) { ST(sample_cuda_device(b, st)); });
        CK(cudaMemcpy(rn.data(), dr, rn.size() * sizeof(SampleResult), cudaMemcpyDeviceToHost));
        const double t_old = time_us(st, 20, [&](int) { ST(sample_cuda_device_v1(b, st)); });
        CK(cudaMemcpy(ro.data(), dr, ro.size() * sizeof(SampleResult), cudaMemcpyDeviceToHost));
        SampleLaunch plain;
        plain.pdl = false;
        const double t_plain = time_us(st, 20, [&](int) { ST(sample_cuda_device(b, st, plain)); });
        SampleLaunch two;  // the other chunking: four blocks per multiprocessor
        two.blocks_per_sm = 4;
        const double t_two = time_us(st, 20, [&](int) { ST(sample_cuda_device(b, st, two)); });
        // Rows where both kernels drew the same token: all of them, except where v1's float
        // top-p masses move a floor (a check that the timed kernels do the work).
        int same = 0;
        for (size_t r = 0; r < rn.size(); ++r) same += rn[r].token == ro[r].token;
        const double row_bytes = V * (4.0 + (m.penalties ? 5.0 : 0.0));
        const double f_hbm = row_bytes * rows / hbm_gbs / 1e3,
                     f_l2 = row_bytes * rows / l2_gbs / 1e3, f_one = row_bytes / one_gbs / 1e3;
        const std::string name = fmt::format("{} x {}: {}", rows, V, m.name);
        fmt::print(
            "{:<42} {:>7.0f} {:>9.2f} {:>9.2f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} "
            "{:>6.1f}x {:>3}/{}\n",
            name, row_bytes / 1024, f_hbm, f_l2, f_one, t_old, t_new, t_plain, t_two, t_old / t_new,
            same, rows);
        js.push_back({{"kernel", "sampler"},
                      {"rows", rows},
                      {"vocab", V},
                      {"mode", m.name},
                      {"bytes_per_row", row_bytes},
                      {"floor_hbm_us", f_hbm},
                      {"floor_l2_us", f_l2},
                      {"one_sm_row_us", f_one},
                      {"old_us", t_old},
                      {"us", t_new},
                      {"no_pdl_us", t_plain},
                      {"four_per_sm_us", t_two},
                      {"same_tokens", same}});
      }
      for (void* q : {logits, dseen, dcounts, ws, dp, dr}) CK(cudaFree(q));
    }
  }
  return json{{"one_sm_GBps", one_gbs}, {"l2_GBps", l2_gbs}, {"rows", js}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool quick = false;
  std::string only;
  const std::string sections =
      ",matmul,forms,fused,layer,layer8,fp8,fp8prefill,moe,decode,prefill,attention,mla,other,"
      "sampler,";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
      size_t p = 0;
      while (p <= only.size()) {
        const size_t e = std::min(only.find(',', p), only.size());
        const std::string sec = only.substr(p, e - p);
        if (sections.find("," + sec + ",") == std::string::npos) {
          std::fprintf(stderr,
                       "spark_kernel_bench: --only: unknown section '%s' (known: matmul, forms, "
                       "fused, layer, layer8, fp8, fp8prefill, moe, decode, prefill, attention, "
                       "mla, other, sampler)\n",
                       sec.c_str());
          return 2;
        }
        p = e + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: spark_kernel_bench [--json FILE] [--quick] [--only SECTION,...]\n");
      return 2;
    }
  }
  // Whether section `sec` runs: all of them without --only; "attention" stands for
  // decode and prefill.
  auto want = [&](const std::string& sec) {
    if (only.empty()) return true;
    const std::string list = "," + only + ",";
    if (list.find("," + sec + ",") != std::string::npos) return true;
    return (sec == "decode" || sec == "prefill") && list.find(",attention,") != std::string::npos;
  };
  ST(cuda_select_device(0));
  auto lim = cuda_device_limits(0);
  ST(lim.status());
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  json out;
  out["device"] = describe_device(*lim);
  out["sm_count"] = lim->sm_count;
  out["l2_bytes"] = lim->l2_bytes;
  out["smem_per_block_optin"] = lim->smem_per_block_optin;

  // ---- HBM bandwidth ----
  const size_t bw_bytes = size_t{4} << 30;
  void* big = random_bf16(bw_bytes / 2, 1);
  void* big2 = dalloc(bw_bytes);
  unsigned* sink = static_cast<unsigned*>(dalloc(4));
  const unsigned rblocks = static_cast<unsigned>(lim->sm_count * 8);
  const double t_read = time_us(st, 5, [&](int) {
    read_kernel<<<rblocks, 512, 0, st>>>(static_cast<const uint4*>(big), bw_bytes / 16, sink);
  });
  const double t_copy = time_us(
      st, 5, [&](int) { CK(cudaMemcpyAsync(big2, big, bw_bytes, cudaMemcpyDeviceToDevice, st)); });
  const double read_gbs = bw_bytes / t_read / 1e3;
  const double copy_gbs = 2.0 * bw_bytes / t_copy / 1e3;
  out["hbm_read_GBps"] = read_gbs;
  out["d2d_copy_GBps"] = copy_gbs;
  fmt::print("# {}: {} SMs, L2 {} MiB, shared memory per block {} KiB (opt-in)\n",
             describe_device(*lim), lim->sm_count, lim->l2_bytes >> 20,
             lim->smem_per_block_optin >> 10);
  fmt::print("# HBM read {:.0f} GB/s (read kernel, 4 GiB), D2D copy {:.0f} GB/s (read+write)\n\n",
             read_gbs, copy_gbs);
  CK(cudaFree(big2));

  // ---- matrix products ----
  auto mm = Matmul::create();
  ST(mm.status());
  out["cublaslt"] = (*mm)->library_path();
  struct Shape {
    const char* name;
    size_t n, k;
  } shapes[] = {{"q/o 4096x4096", 4096, 4096},
                {"k/v 1024x4096", 1024, 4096},
                {"gate_up 28672x4096", 28672, 4096},
                {"down 4096x14336", 4096, 14336},
                {"lm_head 128256x4096", 128256, 4096}};
  std::vector<size_t> ms = {1, 8, 32, 1024, 8192};
  if (quick) ms = {1, 8, 32, 1024};
  // A bf16 dense-product peak in the same run: cuBLASLt on 8192^3.
  {
    const size_t n = 8192;
    void *a = random_bf16(n * n, 2), *w = random_bf16(n * n, 3), *o = dalloc(n * n * 2);
    MatmulArgs args;
    args.a = a, args.lda = n, args.w = w, args.ldw = n, args.out = o, args.ldo = n, args.m = n,
    args.n = n, args.k = n;
    args.backend = MatmulBackend::cublaslt;
    const double t = time_us(st, 5, [&](int) { ST((*mm)->run(args, st)); });
    out["bf16_peak_TFLOPs"] = 2.0 * n * n * n / t / 1e6;
    fmt::print("# bf16 matrix-product peak (cuBLASLt 8192^3): {:.0f} TFLOP/s\n\n",
               2.0 * n * n * n / t / 1e6);
    CK(cudaFree(a));
    CK(cudaFree(w));
    CK(cudaFree(o));
  }
  if (want("matmul"))
    fmt::print("# {:<20} {:>5} | {:>10} {:>8} {:>6} {:>7} | {:>10} {:>8} {:>6} {:>7} | {}\n",
               "matmul (n x k)", "m", "cublasLt us", "GB/s", "%HBM", "TFLOP/s", "own us", "GB/s",
               "%HBM", "TFLOP/s", "faster");
  json mjs = json::array();
  for (const auto& sh : shapes) {
    if (!want("matmul")) break;
    const size_t wbytes = sh.n * sh.k * 2;
    // Enough weight copies to exceed the L2 (and at least 2).
    const int copies = static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / wbytes + 1));
    std::vector<void*> ws;
    for (int c = 0; c < copies; ++c) ws.push_back(random_bf16(sh.n * sh.k, 10 + c, 0.05f));
    for (size_t m : ms) {
      void* a = random_bf16(m * sh.k, 99);
      void* o = dalloc(m * sh.n * 2);
      MatmulArgs args;
      args.a = a, args.lda = sh.k, args.ldw = sh.k, args.out = o, args.ldo = sh.n, args.m = m,
      args.n = sh.n, args.k = sh.k;
      const int per = m >= 1024 ? 3 : 20;
      auto run = [&](MatmulBackend be) {
        args.backend = be;
        return time_us(st, per, [&](int i) {
          args.w = ws[static_cast<size_t>(i) % ws.size()];
          ST((*mm)->run(args, st));
        });
      };
      const double bytes = static_cast<double>(wbytes + m * sh.k * 2 + m * sh.n * 2);
      const double flops = 2.0 * m * sh.n * sh.k;
      const double tl = run(MatmulBackend::cublaslt);
      double to = 0;
      if (m <= kMatmulOwnMaxRows) to = run(MatmulBackend::own);
      auto gbs = [&](double t) { return bytes / t / 1e3; };
      const std::string faster = to > 0 && to < tl ? "own" : "cublaslt";
      if (to > 0)
        fmt::print(
            "{:<22} {:>5} | {:>10.1f} {:>8.0f} {:>5.0f}% {:>7.1f} | {:>10.1f} {:>8.0f} {:>5.0f}% "
            "{:>7.1f} | {}\n",
            sh.name, m, tl, gbs(tl), 100 * gbs(tl) / read_gbs, flops / tl / 1e6, to, gbs(to),
            100 * gbs(to) / read_gbs, flops / to / 1e6, faster);
      else
        fmt::print(
            "{:<22} {:>5} | {:>10.1f} {:>8.0f} {:>5.0f}% {:>7.1f} | {:>10} {:>8} {:>6} {:>7} | "
            "{}\n",
            sh.name, m, tl, gbs(tl), 100 * gbs(tl) / read_gbs, flops / tl / 1e6, "-", "-", "-", "-",
            faster);
      json j = {{"shape", sh.name},
                {"n", sh.n},
                {"k", sh.k},
                {"m", m},
                {"cublaslt_us", tl},
                {"cublaslt_GBps", gbs(tl)},
                {"cublaslt_TFLOPs", flops / tl / 1e6},
                {"faster", faster},
                {"chosen", matmul_backend_name((*mm)->choose(m, sh.n, sh.k))}};
      if (to > 0) j["own_us"] = to, j["own_GBps"] = gbs(to), j["own_TFLOPs"] = flops / to / 1e6;
      mjs.push_back(j);
      CK(cudaFree(a));
      CK(cudaFree(o));
    }
    for (void* p : ws) CK(cudaFree(p));
  }
  out["matmul"] = mjs;

  // ---- the own kernel's forms at decode rows: the streaming form (one warp per output row)
  // in four register shapes and with programmatic launch, the tensor-core form, cuBLASLt.
  if (want("forms")) {
    // The tensor-core form in each shape (row tiles a warp, k warps a block) and its
    // automatic choice; the streaming forms up to kMatmulGemvMaxRows rows.
    struct Form {
      std::string name;
      OwnVariant v;
      int rt = 0, kw = 0;
    };
    std::vector<Form> forms = {{"mma auto", OwnVariant::mma}};
    for (int rt : {1, 2, 4})
      for (int kw : {8, 16})
        forms.push_back({fmt::format("mma r{} k{}", rt, kw), OwnVariant::mma, rt, kw});
    for (OwnVariant v : {OwnVariant::gemv_r1_u8, OwnVariant::gemv_r1_u4, OwnVariant::gemv_r2_u4,
                         OwnVariant::gemv_r2_u8, OwnVariant::gemv_r2_u2})
      forms.push_back({own_variant_name(v), v});
    fmt::print("\n# {:<20} {:>3} | {:>9} |", "own forms (us)", "m", "cublasLt");
    for (const auto& f : forms) fmt::print(" {:>10}", f.name);
    fmt::print(" | {:>10} | {:>6} {:>6}\n", "auto+pdl", "best", "%HBM");
    json gjs = json::array();
    for (const auto& sh : shapes) {
      const size_t wbytes = sh.n * sh.k * 2;
      const int copies = static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / wbytes + 1));
      std::vector<void*> ws;
      for (int c = 0; c < copies; ++c) ws.push_back(random_bf16(sh.n * sh.k, 30 + c, 0.05f));
      for (size_t m : {size_t{1}, size_t{2}, size_t{4}, size_t{8}}) {
        void* a = random_bf16(m * sh.k, 95);
        void* o = dalloc(m * sh.n * 2);
        MatmulArgs args;
        args.a = a, args.lda = sh.k, args.ldw = sh.k, args.out = o, args.ldo = sh.n, args.m = m,
        args.n = sh.n, args.k = sh.k;
        auto run_form = [&](const Form& f, bool pdl) {
          set_programmatic_launch(pdl);
          const double t = time_us(st, 20, [&](int i) {
            args.w = ws[static_cast<size_t>(i) % ws.size()];
            if (f.v == OwnVariant::mma)
              ST(matmul_own_mma_cuda_device(&args, 1, st, f.rt, f.kw));
            else
              ST(matmul_own_group_cuda_device(&args, 1, st, f.v));
          });
          set_programmatic_launch(false);
          return t;
        };
        args.backend = MatmulBackend::cublaslt;
        const double tl = time_us(st, 20, [&](int i) {
          args.w = ws[static_cast<size_t>(i) % ws.size()];
          ST((*mm)->run(args, st));
        });
        json j = {{"shape", sh.name}, {"n", sh.n}, {"k", sh.k}, {"m", m}, {"cublaslt_us", tl}};
        fmt::print("{:<22} {:>3} | {:>9.1f} |", sh.name, m, tl);
        double best = tl;
        for (const auto& f : forms) {
          if (f.v != OwnVariant::mma && m > kMatmulGemvMaxRows) {
            fmt::print(" {:>10}", "-");
            continue;
          }
          const double t = run_form(f, false);
          best = std::min(best, t);
          j[f.name] = t;
          fmt::print(" {:>10.1f}", t);
        }
        const double tp = run_form({"auto", OwnVariant::automatic}, true);
        j["auto_pdl_us"] = tp;
        best = std::min(best, tp);
        const double gbs = static_cast<double>(wbytes) / best / 1e3;
        fmt::print(" | {:>10.1f} | {:>6.1f} {:>5.0f}%\n", tp, best, 100 * gbs / read_gbs);
        gjs.push_back(j);
        CK(cudaFree(a));
        CK(cudaFree(o));
      }
      for (void* p : ws) CK(cudaFree(p));
    }
    out["own_forms"] = gjs;
  }

  // ---- the FP8 decode product (weights kept as e4m3 bytes with 128 x 128 block scales) at
  // 1-8 rows beside the bf16 own kernel on the same shape: each against the bytes it must
  // read (fp8: the codes, the scales and A; bf16: twice the weight bytes and A), as a share
  // of the HBM read rate. Llama-3-8B's projections and Qwen3-30B-A3B's (attention and one
  // expert's gate/up and down).
  if (want("fp8")) {
    struct Fp8Shape {
      const char* name;
      size_t n, k;
    } fshapes[] = {{"llama q/o 4096x4096", 4096, 4096},
                   {"llama gate_up 28672x4096", 28672, 4096},
                   {"llama down 4096x14336", 4096, 14336},
                   {"qwen3moe q 4096x2048", 4096, 2048},
                   {"qwen3moe o 2048x4096", 2048, 4096},
                   {"qwen3moe expert gate_up 1536x2048", 1536, 2048},
                   {"qwen3moe expert down 2048x768", 2048, 768}};
    fmt::print("\n# {:<33} {:>2} | {:>8} {:>7} {:>5} | {:>8} {:>7} {:>5} | {:>6}\n",
               "fp8 decode (n x k)", "m", "fp8 us", "GB/s", "%HBM", "bf16 us", "GB/s", "%HBM",
               "bf16/fp8");
    json f8js = json::array();
    for (const auto& sh : fshapes) {
      const size_t blocks = (sh.k + kFp8BlockK - 1) / kFp8BlockK;
      const size_t srows = (sh.n + 127) / 128;
      const size_t qbytes = sh.n * sh.k, sbytes = srows * blocks * 4;
      // Enough copies of each weight to exceed the L2 (and at least 2).
      const int fcopies =
          static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / (qbytes + sbytes) + 1));
      const int bcopies =
          static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / (2 * qbytes) + 1));
      std::vector<Fp8Weight> fw;
      for (int c = 0; c < fcopies; ++c) {
        auto* q = static_cast<uint8_t*>(dalloc(qbytes));
        auto* sc = static_cast<float*>(dalloc(sbytes));
        fill_fp8<<<1024, 256>>>(q, qbytes, 70 + c);
        fill_scales<<<64, 256>>>(sc, sbytes / 4, 80 + c);
        CK(cudaGetLastError());
        Fp8Weight w;
        w.q = q, w.ldq = sh.k, w.scales = sc, w.scale_ld = blocks, w.row_shift = 7;
        fw.push_back(w);
      }
      std::vector<void*> bw;
      for (int c = 0; c < bcopies; ++c) bw.push_back(random_bf16(sh.n * sh.k, 90 + c, 0.05f));
      CK(cudaDeviceSynchronize());
      for (size_t m : {size_t{1}, size_t{2}, size_t{4}, size_t{8}}) {
        void* a = random_bf16(m * sh.k, 96);
        void* o = dalloc(m * sh.n * 2);
        Fp8MatmulArgs fa;
        fa.a = a, fa.lda = sh.k, fa.out = o, fa.out_dtype = DType::bf16, fa.ldo = sh.n, fa.m = m,
        fa.n = sh.n, fa.k = sh.k;
        const double tf = time_us(st, 20, [&](int i) {
          fa.w = fw[static_cast<size_t>(i) % fw.size()];
          ST(fp8_gemv_cuda_device(fa, st));
        });
        MatmulArgs ba;
        ba.a = a, ba.lda = sh.k, ba.ldw = sh.k, ba.out = o, ba.ldo = sh.n, ba.m = m, ba.n = sh.n,
        ba.k = sh.k;
        const double tb = time_us(st, 20, [&](int i) {
          ba.w = bw[static_cast<size_t>(i) % bw.size()];
          ST(matmul_own_cuda_device(ba, st));
        });
        const double abytes = static_cast<double>(m * sh.k * 2);
        const double fbytes = static_cast<double>(qbytes + sbytes) + abytes;
        const double bbytes = 2.0 * static_cast<double>(qbytes) + abytes;
        const double fgbs = fbytes / tf / 1e3, bgbs = bbytes / tb / 1e3;
        fmt::print(
            "{:<35} {:>2} | {:>8.1f} {:>7.0f} {:>4.0f}% | {:>8.1f} {:>7.0f} {:>4.0f}% | "
            "{:>6.2f}x\n",
            sh.name, m, tf, fgbs, 100 * fgbs / read_gbs, tb, bgbs, 100 * bgbs / read_gbs, tb / tf);
        f8js.push_back({{"shape", sh.name},
                        {"n", sh.n},
                        {"k", sh.k},
                        {"m", m},
                        {"fp8_us", tf},
                        {"fp8_bytes", fbytes},
                        {"fp8_GBps", fgbs},
                        {"fp8_hbm_fraction", fgbs / read_gbs},
                        {"bf16_own_us", tb},
                        {"bf16_bytes", bbytes},
                        {"bf16_GBps", bgbs},
                        {"bf16_hbm_fraction", bgbs / read_gbs},
                        {"bf16_over_fp8", tb / tf}});
        CK(cudaFree(a));
        CK(cudaFree(o));
      }
      for (const Fp8Weight& w : fw) {
        CK(cudaFree(const_cast<uint8_t*>(w.q)));
        CK(cudaFree(const_cast<float*>(w.scales)));
      }
      for (void* p : bw) CK(cudaFree(p));
    }
    out["fp8"] = f8js;
  }

  // ---- the FP8 prefill product, both ways the engine runs it (daemon/engine/device_cuda.cc
  // fp8_product): the rows quantized per 128 columns and cuBLASLt's block-scaled FP8 product
  // (the tensor cores; Hopper), beside the weight dequantized into bf16 tiles of 16 Mi
  // elements and the bf16 product of each. Llama-3-8B's projections at 16 to 8192 rows, in
  // TFLOP/s against the FP8 peak: the block-scaled product on 8192^3 in the same run.
  if (want("fp8prefill")) {
    auto fp8_weight_of = [&](size_t n, size_t k, uint32_t seed) {
      Fp8Weight w;
      const size_t ld = fp8_tc_scale_ld(k), srows = (n + 127) / 128;
      auto* q = static_cast<uint8_t*>(dalloc(n * k));
      auto* sc = static_cast<float*>(dalloc(srows * ld * 4));
      fill_fp8<<<1024, 256>>>(q, n * k, seed);
      fill_scales<<<64, 256>>>(sc, srows * ld, seed + 1);
      CK(cudaGetLastError());
      w.q = q, w.ldq = k, w.scales = sc, w.scale_ld = ld, w.row_shift = 7;
      return w;
    };
    auto free_weight = [](const Fp8Weight& w) {
      CK(cudaFree(const_cast<uint8_t*>(w.q)));
      CK(cudaFree(const_cast<float*>(w.scales)));
    };
    constexpr size_t kTile = size_t{16} << 20;  // the engine's dequantized tile, elements
    void* ws = dalloc(kTile * 2);
    // One product of m rows the tensor-core way, in the engine's passes (as many rows as
    // the 32 MiB workspace holds quantized): quantize, then the block-scaled product.
    auto tc = [&](const void* a, const Fp8Weight& w, void* o, size_t m, size_t n, size_t k) {
      const size_t blocks = (k + 127) / 128;
      const size_t pass = std::min(m, (kTile * 2 - 256) / (k + 4 * blocks) / 4 * 4);
      for (size_t r0 = 0; r0 < m; r0 += pass) {
        const size_t mm_rows = std::min(pass, m - r0);
        auto* q = static_cast<uint8_t*>(ws);
        auto* sc = reinterpret_cast<float*>(q + (mm_rows * k + 255) / 256 * 256);
        ST(fp8_quantize_rows_cuda_device(static_cast<const char*>(a) + r0 * k * 2, k, mm_rows, k,
                                         Fp8Rows{q, k, sc, mm_rows}, st));
        Fp8TcArgs t;
        t.a = q, t.lda = k, t.a_scales = sc, t.w = w, t.out = static_cast<char*>(o) + r0 * n * 2;
        t.ldo = n, t.m = mm_rows, t.n = n, t.k = k;
        ST((*mm)->run_fp8(t, st));
      }
    };
    // The dequantized way, tile by tile.
    auto dq = [&](const void* a, const Fp8Weight& w, void* o, size_t m, size_t n, size_t k) {
      const size_t tile = std::max<size_t>(1, std::min(n, kTile / k));
      for (size_t n0 = 0; n0 < n; n0 += tile) {
        const size_t nn = std::min(tile, n - n0);
        ST(fp8_dequantize_cuda_device(w, n0, nn, k, ws, k, st));
        MatmulArgs b;
        b.a = a, b.lda = k, b.w = ws, b.ldw = k, b.out = static_cast<char*>(o) + n0 * 2;
        b.ldo = n, b.m = m, b.n = nn, b.k = k, b.backend = MatmulBackend::cublaslt;
        ST((*mm)->run(b, st));
      }
    };
    double fp8_peak = 0;
    {
      const size_t n = 8192;
      // The quantized rows of 8192^2 take 64 MiB + scales: its own workspace.
      void* a = random_bf16(n * n, 301);
      void* o = dalloc(n * n * 2);
      auto* q = static_cast<uint8_t*>(dalloc(n * n));
      auto* sc = static_cast<float*>(dalloc(n * (n / 128) * 4));
      ST(fp8_quantize_rows_cuda_device(a, n, n, n, Fp8Rows{q, n, sc, n}, st));
      Fp8Weight w = fp8_weight_of(n, n, 302);
      Fp8TcArgs t;
      t.a = q, t.lda = n, t.a_scales = sc, t.w = w, t.out = o, t.ldo = n, t.m = n, t.n = n, t.k = n;
      const double us = time_us(st, 5, [&](int) { ST((*mm)->run_fp8(t, st)); });
      fp8_peak = 2.0 * n * n * n / us / 1e6;
      out["fp8_peak_TFLOPs"] = fp8_peak;
      fmt::print(
          "\n# FP8 matrix-product peak (cuBLASLt block-scaled FP8, 8192^3): {:.0f} TFLOP/s\n",
          fp8_peak);
      free_weight(w);
      CK(cudaFree(a));
      CK(cudaFree(o));
      CK(cudaFree(q));
      CK(cudaFree(sc));
    }
    struct Shape {
      const char* name;
      size_t n, k;
    } pshapes[] = {{"llama q/o 4096x4096", 4096, 4096},
                   {"llama gate_up 28672x4096", 28672, 4096},
                   {"llama down 4096x14336", 4096, 14336}};
    fmt::print("# {:<26} {:>5} | {:>9} {:>7} {:>5} | {:>9} {:>7} {:>5} | {:>6}\n",
               "fp8 prefill (n x k)", "m", "tc us", "TFLOP/s", "%peak", "dequant us", "TFLOP/s",
               "%peak", "dq/tc");
    json pjs = json::array();
    for (const auto& sh : pshapes) {
      Fp8Weight w = fp8_weight_of(sh.n, sh.k, 310);
      for (size_t m : {size_t{16}, size_t{128}, size_t{1024}, size_t{8192}}) {
        void* a = random_bf16(m * sh.k, 311);
        void* o = dalloc(m * sh.n * 2);
        const int per = m >= 1024 ? 3 : 10;
        const double t_tc = time_us(st, per, [&](int) { tc(a, w, o, m, sh.n, sh.k); });
        const double t_dq = time_us(st, per, [&](int) { dq(a, w, o, m, sh.n, sh.k); });
        const double flops = 2.0 * static_cast<double>(m * sh.n * sh.k);
        const double f_tc = flops / t_tc / 1e6, f_dq = flops / t_dq / 1e6;
        fmt::print(
            "{:<28} {:>5} | {:>9.1f} {:>7.0f} {:>4.0f}% | {:>9.1f} {:>7.0f} {:>4.0f}% | "
            "{:>5.2f}x\n",
            sh.name, m, t_tc, f_tc, 100 * f_tc / fp8_peak, t_dq, f_dq, 100 * f_dq / fp8_peak,
            t_dq / t_tc);
        pjs.push_back({{"shape", sh.name},
                       {"n", sh.n},
                       {"k", sh.k},
                       {"m", m},
                       {"tc_us", t_tc},
                       {"tc_TFLOPs", f_tc},
                       {"tc_peak_fraction", f_tc / fp8_peak},
                       {"dequant_us", t_dq},
                       {"dequant_TFLOPs", f_dq},
                       {"dequant_peak_fraction", f_dq / fp8_peak},
                       {"dequant_over_tc", t_dq / t_tc}});
        CK(cudaFree(a));
        CK(cudaFree(o));
      }
      free_weight(w);
    }
    CK(cudaFree(ws));
    out["fp8_prefill"] = pjs;
  }

  // ---- MoE expert products over MXFP4 experts (gpt-oss's, kept packed: e2m1 codes and e8m0
  // scales per 32 columns) beside the same launch over bf16 experts, at gpt-oss-20b's shape
  // (hidden and inter 2880, 32 experts, top-4, interleaved gate/up, biases, limit 7): the
  // decode form at 1, 4 and 8 rows, the grouped form at 64. Bytes: the distinct chosen
  // experts' weights (MXFP4: codes and scales; bf16: 2 bytes a weight) plus x and out. The
  // routing rotates among 16 random choices, so the experts read are not all L2-resident.
  if (want("moe")) {
    constexpr int H = 2880, I = 2880, E = 32, K = 4, kSets = 16;
    const size_t gu_rows = size_t{E} * 2 * I, dn_rows = size_t{E} * H;
    auto* gub = static_cast<uint8_t*>(dalloc(gu_rows * H / 2));
    auto* gus = static_cast<uint8_t*>(dalloc(gu_rows * H / 32));
    auto* dnb = static_cast<uint8_t*>(dalloc(dn_rows * I / 2));
    auto* dns = static_cast<uint8_t*>(dalloc(dn_rows * I / 32));
    fill_fp8<<<1024, 256>>>(gub, gu_rows * H / 2, 201);
    fill_e8m0<<<1024, 256>>>(gus, gu_rows * H / 32, 202);
    fill_fp8<<<1024, 256>>>(dnb, dn_rows * I / 2, 203);
    fill_e8m0<<<1024, 256>>>(dns, dn_rows * I / 32, 204);
    CK(cudaGetLastError());
    void* gu16 = random_bf16(gu_rows * H, 205, 0.02f);
    void* dn16 = random_bf16(dn_rows * I, 206, 0.02f);
    void* gubias = random_bf16(gu_rows, 207, 0.5f);
    void* dnbias = random_bf16(dn_rows, 208, 0.5f);
    CK(cudaDeviceSynchronize());
    const double mx4_expert = 3.0 * H * I / 2 + 3.0 * H * I / 32, bf16_expert = 3.0 * H * I * 2;
    fmt::print("\n# {:<33} {:>2} | {:>8} {:>7} {:>5} | {:>8} {:>7} {:>5} | {:>6}\n",
               "moe experts (gpt-oss-20b)", "m", "mxfp4 us", "GB/s", "%HBM", "bf16 us", "GB/s",
               "%HBM", "bf16/mx4");
    json mjs = json::array();
    for (int rows : {1, 4, 8, 64}) {
      const int form = rows <= kMoeDecodeMaxRows ? 1 : 2;
      const RouteSets rs = route_sets(kSets, rows, E, K, 0.25f, 300u + static_cast<unsigned>(rows));
      int32_t* dids = rs.ids;
      float* dw = rs.weights;
      const double distinct = rs.distinct;
      void* x = random_bf16(static_cast<size_t>(rows) * H, 209);
      void* o = dalloc(static_cast<size_t>(rows) * H * 2);
      const size_t wsb = moe_experts_workspace_bytes(rows, K, H, I, 0, E);
      void* wsp = dalloc(wsb);
      MoeExpertsArgs a;
      a.x = x, a.rows = rows, a.top_k = K, a.hidden = H, a.expert0 = 0, a.experts = E;
      a.inter = I, a.out = o, a.workspace = wsp, a.workspace_bytes = wsb, a.form = form;
      a.gate_up_bias = gubias, a.down_bias = dnbias, a.interleaved = true;
      a.swiglu_limit = 7.f, a.swiglu_alpha = 1.702f;
      auto timed = [&](const MoeExpertsArgs& base) {
        MoeExpertsArgs b = base;
        return time_us(st, 20, [&](int i) {
          const size_t set = static_cast<size_t>(i) % kSets;
          b.ids = dids + set * static_cast<size_t>(rows * K);
          b.weights = dw + set * static_cast<size_t>(rows * K);
          ST(moe_experts_cuda_device(b, st));
        });
      };
      MoeExpertsArgs am = a;
      am.gate_up_mx4.blocks = gub, am.gate_up_mx4.ldb = H / 2;
      am.gate_up_mx4.scales = gus, am.gate_up_mx4.lds = H / 32;
      am.down_mx4.blocks = dnb, am.down_mx4.ldb = I / 2;
      am.down_mx4.scales = dns, am.down_mx4.lds = I / 32;
      MoeExpertsArgs ab = a;
      ab.gate_up = gu16, ab.down = dn16;
      const double tm = timed(am), tb = timed(ab);
      const double xo = 2.0 * rows * H * 2;
      const double mbytes = distinct * mx4_expert + xo, bbytes = distinct * bf16_expert + xo;
      const double mgbs = mbytes / tm / 1e3, bgbs = bbytes / tb / 1e3;
      fmt::print(
          "{:<35} {:>2} | {:>8.1f} {:>7.0f} {:>4.0f}% | {:>8.1f} {:>7.0f} {:>4.0f}% | "
          "{:>6.2f}x\n",
          form == 1 ? "decode form" : "grouped form", rows, tm, mgbs, 100 * mgbs / read_gbs, tb,
          bgbs, 100 * bgbs / read_gbs, tb / tm);
      mjs.push_back({{"form", form == 1 ? "decode" : "grouped"},
                     {"rows", rows},
                     {"distinct_experts", distinct},
                     {"mxfp4_us", tm},
                     {"mxfp4_bytes", mbytes},
                     {"mxfp4_GBps", mgbs},
                     {"mxfp4_hbm_fraction", mgbs / read_gbs},
                     {"bf16_us", tb},
                     {"bf16_bytes", bbytes},
                     {"bf16_GBps", bgbs},
                     {"bf16_hbm_fraction", bgbs / read_gbs},
                     {"bf16_over_mxfp4", tb / tm}});
      for (void* p : {static_cast<void*>(dids), static_cast<void*>(dw), x, o, wsp}) CK(cudaFree(p));
    }
    for (void* p : {static_cast<void*>(gub), static_cast<void*>(gus), static_cast<void*>(dnb),
                    static_cast<void*>(dns), gu16, dn16, gubias, dnbias})
      CK(cudaFree(p));
    out["moe"] = mjs;

    // Qwen3-30B-A3B's bf16 experts (128 of hidden 2048, inter 768, top-8): the fp32 decode
    // kernels up to 8 rows and the grouped form past them (form 4) against the tensor-core
    // decode kernels (form 3), and the automatic form's choice; bytes: the distinct experts'.
    constexpr int QH = 2048, QI = 768, QE = 128, QK = 8;
    void* qgu = random_bf16(size_t{QE} * 2 * QI * QH, 211, 0.02f);
    void* qdn = random_bf16(size_t{QE} * QH * QI, 212, 0.02f);
    CK(cudaDeviceSynchronize());
    fmt::print("\n# {:<25} {:>2} {:>5} | {:>8} {:>5} | {:>8} {:>5} | {:>8} {:>5} | {:>6}\n",
               "moe experts (qwen3 bf16)", "m", "dist", "fp32 us", "%HBM", "mma us", "%HBM",
               "auto us", "%HBM", "mma x");
    json qjs = json::array();
    for (int rows : {1, 2, 4, 8, 16, 32}) {
      const RouteSets rs =
          route_sets(kSets, rows, QE, QK, 1.f / QK, 400u + static_cast<unsigned>(rows));
      int32_t* dids = rs.ids;
      float* dw = rs.weights;
      const double distinct = rs.distinct;
      void* x = random_bf16(static_cast<size_t>(rows) * QH, 213);
      void* o = dalloc(static_cast<size_t>(rows) * QH * 2);
      const size_t wsb = moe_experts_workspace_bytes(rows, QK, QH, QI, 0, QE);
      void* wsp = dalloc(wsb);
      MoeExpertsArgs a;
      a.x = x, a.rows = rows, a.top_k = QK, a.hidden = QH, a.expert0 = 0, a.experts = QE;
      a.inter = QI, a.out = o, a.workspace = wsp, a.workspace_bytes = wsb;
      a.gate_up = qgu, a.down = qdn;
      auto timed = [&](int form) {
        MoeExpertsArgs b = a;
        b.form = form;
        return time_us(st, 20, [&](int i) {
          const size_t set = static_cast<size_t>(i) % kSets;
          b.ids = dids + set * static_cast<size_t>(rows * QK);
          b.weights = dw + set * static_cast<size_t>(rows * QK);
          ST(moe_experts_cuda_device(b, st));
        });
      };
      const double t4 = timed(4), t3 = timed(3), t0 = timed(0);
      const double bytes = distinct * 3.0 * QH * QI * 2 + 2.0 * rows * QH * 2;
      auto frac = [&](double us) { return bytes / us / 1e3 / read_gbs; };
      fmt::print(
          "{:<27} {:>2} {:>5.1f} | {:>8.1f} {:>4.0f}% | {:>8.1f} {:>4.0f}% | {:>8.1f} {:>4.0f}% | "
          "{:>5.2f}x\n",
          rows <= kMoeDecodeMaxRows ? "fp32 decode / mma" : "grouped / mma", rows, distinct, t4,
          100 * frac(t4), t3, 100 * frac(t3), t0, 100 * frac(t0), t4 / t3);
      qjs.push_back({{"rows", rows},
                     {"distinct_experts", distinct},
                     {"bytes", bytes},
                     {"other_form", rows <= kMoeDecodeMaxRows ? "decode-fp32" : "grouped"},
                     {"other_us", t4},
                     {"other_hbm_fraction", frac(t4)},
                     {"mma_us", t3},
                     {"mma_hbm_fraction", frac(t3)},
                     {"auto_us", t0},
                     {"auto_hbm_fraction", frac(t0)}});
      for (void* p : {static_cast<void*>(dids), static_cast<void*>(dw), x, o, wsp}) CK(cudaFree(p));
    }
    for (void* p : {qgu, qdn}) CK(cudaFree(p));
    out["moe_qwen3_bf16"] = qjs;
  }

  // ---- fused decode launches: the engine's choice against what it replaces ----
  // q/k/v: one own launch over the three weights (4096 + 2 x 1024 rows) against the three
  // products as Matmul::run picks them. gate/up + SwiGLU: the own kernel with SwiGLU in its
  // epilogue against the product (automatic choice) into [gate | up] plus the SwiGLU kernel.
  json fjs = json::array();
  if (want("fused"))
    fmt::print("\n# {:<32} {:>10} {:>10} {:>8} | {:>10} {:>10} {:>8}\n", "fused (m rows)",
               "fused us", "GB/s", "%HBM", "split us", "GB/s", "%HBM");
  for (size_t m : {size_t{1}, size_t{8}}) {
    if (!want("fused")) break;
    const size_t k = 4096, nq = 4096, nkv = 1024;
    const size_t wbytes = (nq + 2 * nkv) * k * 2;
    const int copies = static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / wbytes + 1));
    std::vector<std::array<void*, 3>> ws;
    for (int c = 0; c < copies; ++c)
      ws.push_back({random_bf16(nq * k, 40 + c, 0.05f), random_bf16(nkv * k, 60 + c, 0.05f),
                    random_bf16(nkv * k, 80 + c, 0.05f)});
    void* a = random_bf16(m * k, 98);
    void *oq = dalloc(m * nq * 2), *ok = dalloc(m * nkv * 2), *ov = dalloc(m * nkv * 2);
    MatmulArgs parts[3];
    const size_t ns[3] = {nq, nkv, nkv};
    void* outs[3] = {oq, ok, ov};
    for (int p = 0; p < 3; ++p) {
      parts[p].a = a, parts[p].lda = k, parts[p].ldw = k, parts[p].out = outs[p];
      parts[p].ldo = ns[p], parts[p].m = m, parts[p].n = ns[p], parts[p].k = k;
    }
    auto set_w = [&](int i) {
      for (int p = 0; p < 3; ++p) parts[p].w = ws[static_cast<size_t>(i) % ws.size()][p];
    };
    const double tg = time_us(st, 20, [&](int i) {
      set_w(i);
      ST(matmul_own_group_cuda_device(parts, 3, st));
    });
    const double ts = time_us(st, 20, [&](int i) {
      set_w(i);
      for (auto& p : parts) ST((*mm)->run(p, st));
    });
    const double bytes = static_cast<double>(wbytes);
    const std::string name = fmt::format("q/k/v 3 products m {}", m);
    fmt::print("{:<34} {:>10.1f} {:>10.0f} {:>7.0f}% | {:>10.1f} {:>10.0f} {:>7.0f}%\n", name, tg,
               bytes / tg / 1e3, 100 * bytes / tg / 1e3 / read_gbs, ts, bytes / ts / 1e3,
               100 * bytes / ts / 1e3 / read_gbs);
    fjs.push_back({{"kernel", "qkv_group"},
                   {"m", m},
                   {"fused_us", tg},
                   {"split_us", ts},
                   {"engine_uses_fused", matmul_group_prefers_own(m, (nq + 2 * nkv) * k)}});
    for (auto& w3 : ws)
      for (void* p : w3) CK(cudaFree(p));
    for (void* p : {a, oq, ok, ov}) CK(cudaFree(p));
  }
  const struct {
    const char* name;
    size_t inter, k;
  } gates[] = {{"gate_up+swiglu 28672x4096", 14336, 4096}, {"gate_up+swiglu 9728x896", 4864, 896}};
  for (const auto& gsh : gates)
    for (size_t m : {size_t{1}, size_t{8}}) {
      if (!want("fused")) break;
      const size_t k = gsh.k, inter = gsh.inter;
      const size_t wbytes = 2 * inter * k * 2;
      const int copies = static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / wbytes + 1));
      std::vector<void*> ws;
      for (int c = 0; c < copies; ++c) ws.push_back(random_bf16(2 * inter * k, 20 + c, 0.05f));
      void *a = random_bf16(m * k, 97), *gu = dalloc(m * 2 * inter * 2), *y = dalloc(m * inter * 2);
      MatmulArgs f;
      f.a = a, f.lda = k, f.ldw = k, f.out = y, f.ldo = inter, f.m = m, f.n = inter, f.k = k;
      f.swiglu = true;
      MatmulArgs p = f;
      p.swiglu = false, p.out = gu, p.ldo = 2 * inter, p.n = 2 * inter;
      const double tf = time_us(st, 20, [&](int i) {
        f.w = ws[static_cast<size_t>(i) % ws.size()];
        ST(matmul_own_cuda_device(f, st));
      });
      const double ts = time_us(st, 20, [&](int i) {
        p.w = ws[static_cast<size_t>(i) % ws.size()];
        ST((*mm)->run(p, st));
        ST(swiglu_bf16_cuda_device(static_cast<const bf16_bits*>(gu), static_cast<bf16_bits*>(y), m,
                                   inter, st));
      });
      const double bytes = static_cast<double>(wbytes);
      const std::string name = fmt::format("{} m {}", gsh.name, m);
      fmt::print("{:<34} {:>10.1f} {:>10.0f} {:>7.0f}% | {:>10.1f} {:>10.0f} {:>7.0f}%\n", name, tf,
                 bytes / tf / 1e3, 100 * bytes / tf / 1e3 / read_gbs, ts, bytes / ts / 1e3,
                 100 * bytes / ts / 1e3 / read_gbs);
      fjs.push_back({{"kernel", "gate_up_swiglu"},
                     {"inter", inter},
                     {"k", k},
                     {"m", m},
                     {"fused_us", tf},
                     {"split_us", ts},
                     {"engine_uses_fused", (*mm)->choose(m, 2 * inter, k) == MatmulBackend::own}});
      for (void* w : ws) CK(cudaFree(w));
      for (void* q : {a, gu, y}) CK(cudaFree(q));
    }
  out["fused"] = fjs;

  // ---- one decode layer of Llama-3-8B at batch 1, as the engine runs it ----
  // The layer's kernels in the engine's order (norm, q/k/v, RoPE with the KV write, attention at a
  // context of 256 under a graph sized for 33792, o, norm, gate/up + SwiGLU, down), each
  // timed alone, then the chain of 32 layers in one graph without and with programmatic
  // launch: chain - sum is what the boundaries between kernels cost.
  if (want("layer")) {
    const size_t H = 4096, NQ = 4096, NKV = 1024, I = 14336;
    const int ctx = 256, bound = 33792, lbs = 16;
    const int nlayers = 32;
    // Two copies of the layer's weights, alternated, so no layer finds the last one's in L2.
    struct Wt {
      void *wq, *wk, *wv, *wo, *wgu, *wd, *n1, *n2;
    };
    std::vector<Wt> wts;
    for (int c = 0; c < 2; ++c)
      wts.push_back({random_bf16(NQ * H, 200 + c, 0.02f), random_bf16(NKV * H, 210 + c, 0.02f),
                     random_bf16(NKV * H, 220 + c, 0.02f), random_bf16(H * NQ, 230 + c, 0.02f),
                     random_bf16(2 * I * H, 240 + c, 0.02f), random_bf16(H * I, 250 + c, 0.02f),
                     random_bf16(H, 260 + c), random_bf16(H, 270 + c)});
    void *x = random_bf16(H, 300), *o = random_bf16(H, 301), *h = dalloc(H * 2),
         *q = dalloc(NQ * 2), *k = dalloc(NKV * 2), *v = dalloc(NKV * 2), *att = dalloc(NQ * 2),
         *act = dalloc(I * 2);
    const int blocks_per = (bound + lbs - 1) / lbs;
    const size_t kvrow = NKV;
    void *kp = random_bf16(static_cast<size_t>(blocks_per) * lbs * kvrow, 310),
         *vp = random_bf16(static_cast<size_t>(blocks_per) * lbs * kvrow, 311);
    std::vector<int32_t> table(static_cast<size_t>(blocks_per));
    for (int i = 0; i < blocks_per; ++i) table[static_cast<size_t>(i)] = i;
    const int32_t len = ctx, qs[2] = {0, 1}, slot = ctx - 1, pos = ctx - 1;
    void *dt = dalloc(table.size() * 4), *dl = dalloc(4), *dq = dalloc(8), *ds = dalloc(4),
         *dp = dalloc(4), *di = dalloc(64 * 4);
    std::vector<float> inv(64);
    for (int i = 0; i < 64; ++i) inv[static_cast<size_t>(i)] = std::pow(500000.f, -i / 64.f);
    CK(cudaMemcpy(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dl, &len, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dq, qs, 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds, &slot, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, &pos, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(di, inv.data(), 64 * 4, cudaMemcpyHostToDevice));
    PagedKVDevice kvd;
    kvd.k = kp, kvd.v = vp, kvd.dtype = DType::bf16, kvd.block_size = lbs, kvd.n_kv_heads = 8,
    kvd.head_dim = 128, kvd.num_blocks = blocks_per;
    AttentionBatch b;
    b.q = q, b.q_stride = NQ, b.out = att, b.out_stride = NQ, b.n_heads = 32, b.kv = kvd;
    b.block_tables = static_cast<int32_t*>(dt), b.max_blocks_per_seq = blocks_per;
    b.seq_lens = static_cast<int32_t*>(dl), b.query_start = static_cast<int32_t*>(dq);
    b.n_seqs = 1, b.n_tokens = 1, b.max_query_len = 1, b.max_seq_len = bound;
    b.scale = 0.0883883f;
    b.workspace_bytes = attention_decode_workspace_bytes(1, 32, 128, bound);
    void* aws = dalloc(b.workspace_bytes);
    CK(cudaMemset(aws, 0, b.workspace_bytes));
    b.workspace = aws;
    RopeArgs ra;
    ra.q = q, ra.q_stride = NQ, ra.n_heads = 32, ra.k = k, ra.k_stride = NKV, ra.n_kv_heads = 8,
    ra.head_dim = 128, ra.n_tokens = 1, ra.positions = static_cast<int32_t*>(dp),
    ra.inv_freq = static_cast<float*>(di);
    auto prod = [&](const void* in, size_t in_dim, const void* w, void* out_, size_t n) {
      MatmulArgs m;
      m.a = in, m.lda = in_dim, m.w = w, m.ldw = in_dim, m.out = out_, m.ldo = n, m.m = 1, m.n = n,
      m.k = in_dim;
      return m;
    };
    using Step = std::function<void(const Wt&)>;
    std::vector<std::pair<const char*, Step>> steps = {
        {"add_rmsnorm",
         [&](const Wt& w) {
           ST(add_rmsnorm_cuda_device(DType::bf16, x, o, w.n1, h, 1, H, 1e-5f, st));
         }},
        {"q/k/v",
         [&](const Wt& w) {
           MatmulArgs g[3] = {prod(h, H, w.wq, q, NQ), prod(h, H, w.wk, k, NKV),
                              prod(h, H, w.wv, v, NKV)};
           ST(matmul_own_group_cuda_device(g, 3, st));
         }},
        {"rope + kv write",
         [&](const Wt&) {
           RopeArgs r = ra;
           r.k_cache = kp, r.v_cache = vp, r.cache_dtype = DType::bf16;
           r.cache_slots = static_cast<long long>(blocks_per) * lbs;
           r.slots = static_cast<int32_t*>(ds), r.v = v, r.v_stride = NKV;
           ST(rope_cuda_device(r, st));
         }},
        {"attention", [&](const Wt&) { ST(attention_decode_cuda_device(b, st)); }},
        {"o", [&](const Wt& w) { ST((*mm)->run(prod(att, NQ, w.wo, o, H), st)); }},
        {"add_rmsnorm",
         [&](const Wt& w) {
           ST(add_rmsnorm_cuda_device(DType::bf16, x, o, w.n2, h, 1, H, 1e-5f, st));
         }},
        {"gate/up+swiglu",
         [&](const Wt& w) {
           MatmulArgs m = prod(h, H, w.wgu, act, I);
           m.swiglu = true;
           ST((*mm)->run(m, st));
         }},
        {"down", [&](const Wt& w) { ST((*mm)->run(prod(act, I, w.wd, o, H), st)); }},
    };
    const double bytes_layer =
        2.0 * (NQ * H + 2 * NKV * H + H * NQ + 2 * I * H + H * I) + 2.0 * 2 * ctx * kvrow * 2;
    fmt::print("\n# {:<32} {:>10} {:>10} {:>8}\n", "decode layer (batch 1)", "us", "GB/s", "%HBM");
    json ljs = json::object();
    double sum = 0;
    json kj = json::array();
    for (auto& step : steps) {
      const Step& fn = step.second;
      const double t = time_us(st, 32, [&](int i) { fn(wts[static_cast<size_t>(i) % 2]); });
      sum += t;
      fmt::print("{:<34} {:>10.1f}\n", step.first, t);
      kj.push_back({{"kernel", step.first}, {"us", t}});
    }
    ljs["kernels"] = kj;
    ljs["sum_us"] = sum;
    for (bool pdl : {false, true}) {
      set_programmatic_launch(pdl);
      const double t = time_us(st, 1, [&](int) {
        for (int l = 0; l < nlayers; ++l)
          for (auto& step : steps) step.second(wts[static_cast<size_t>(l) % 2]);
      });
      set_programmatic_launch(false);
      const double per = t / nlayers;
      fmt::print("{:<34} {:>10.1f} {:>10.0f} {:>7.0f}%   (sum of the kernels alone {:.1f})\n",
                 fmt::format("chain of {} layers{}, per layer", nlayers, pdl ? " + pdl" : ""), per,
                 bytes_layer / per / 1e3, 100 * bytes_layer / per / 1e3 / read_gbs, sum);
      ljs[pdl ? "chain_pdl_us_per_layer" : "chain_us_per_layer"] = per;
    }
    // The engine's layer: q/k/v with RoPE and the KV write in its epilogue (one launch for
    // the two steps above), then also attention as the engine's short-context graph runs it
    // (bound: what the short kernel takes, when this context fits): the new step alone, and
    // the chain with programmatic launch.
    {
      auto variant = [&](std::vector<std::pair<const char*, Step>>& chain, size_t at,
                         const char* label, const char* alone_key, const char* chain_key) {
        const double t1 =
            time_us(st, 32, [&](int i) { chain[at].second(wts[static_cast<size_t>(i) % 2]); });
        set_programmatic_launch(true);
        const double per = time_us(st, 1,
                                   [&](int) {
                                     for (int l = 0; l < nlayers; ++l)
                                       for (auto& step : chain)
                                         step.second(wts[static_cast<size_t>(l) % 2]);
                                   }) /
                           nlayers;
        set_programmatic_launch(false);
        fmt::print("{:<34} {:>10.1f}\n", chain[at].first, t1);
        fmt::print("{:<34} {:>10.1f} {:>10.0f} {:>7.0f}%\n", label, per, bytes_layer / per / 1e3,
                   100 * bytes_layer / per / 1e3 / read_gbs);
        ljs[alone_key] = t1;
        ljs[chain_key] = per;
      };
      auto fused = steps;
      fused[1] = {"q/k/v + rope + kv write", [&](const Wt& w) {
                    MatmulArgs g[3] = {prod(h, H, w.wq, q, NQ), prod(h, H, w.wk, k, NKV),
                                       prod(h, H, w.wv, v, NKV)};
                    RopeArgs r = ra;
                    r.k_cache = kp, r.v_cache = vp, r.cache_dtype = DType::bf16;
                    r.cache_slots = static_cast<long long>(blocks_per) * lbs;
                    r.slots = static_cast<int32_t*>(ds), r.v = v, r.v_stride = NKV;
                    ST(matmul_qkv_rope_cuda_device(g, r, st));
                  }};
      fused.erase(fused.begin() + 2);
      variant(fused, 1, "chain + pdl, rope in q/k/v, per layer", "qkv_rope_us",
              "chain_pdl_qkv_rope_us_per_layer");
      const int sb = attention_decode_short_max(128, DType::bf16);
      if (sb >= ctx) {
        AttentionBatch bs_ = b;
        bs_.max_seq_len = sb;
        fused[2] = {"attention (short)",
                    [&, bs_](const Wt&) { ST(attention_decode_cuda_device(bs_, st)); }};
        variant(fused, 2, "chain + pdl, rope in q/k/v, short attention, per layer",
                "attention_short_us", "chain_pdl_qkv_rope_short_us_per_layer");
      }
      // The engine's layer at one rank: o and down add themselves into the residual in their
      // epilogue, and the two norms run inside q/k/v and gate/up (five launches a layer).
      std::vector<std::pair<const char*, Step>> normed = {
          {"q/k/v + norm + rope + kv write",
           [&](const Wt& w) {
             MatmulArgs g[3] = {prod(x, H, w.wq, q, NQ), prod(x, H, w.wk, k, NKV),
                                prod(x, H, w.wv, v, NKV)};
             for (auto& m : g) m.norm_w = w.n1, m.norm_eps = 1e-5f;
             RopeArgs r = ra;
             r.k_cache = kp, r.v_cache = vp, r.cache_dtype = DType::bf16;
             r.cache_slots = static_cast<long long>(blocks_per) * lbs;
             r.slots = static_cast<int32_t*>(ds), r.v = v, r.v_stride = NKV;
             ST(matmul_qkv_rope_cuda_device(g, r, st));
           }},
          fused[2],
          {"o, added into x",
           [&](const Wt& w) {
             MatmulArgs m = prod(att, NQ, w.wo, x, H);
             m.accumulate = true;
             ST((*mm)->run(m, st));
           }},
          {"gate/up + norm + swiglu",
           [&](const Wt& w) {
             MatmulArgs m = prod(x, H, w.wgu, act, I);
             m.swiglu = true, m.norm_w = w.n2, m.norm_eps = 1e-5f;
             ST((*mm)->run(m, st));
           }},
          {"down, added into x",
           [&](const Wt& w) {
             MatmulArgs m = prod(act, I, w.wd, x, H);
             m.accumulate = true;
             ST((*mm)->run(m, st));
           }},
      };
      variant(normed, 0, "chain + pdl, norms in products, per layer", "qkv_norm_rope_us",
              "chain_pdl_norm_in_products_us_per_layer");
      const double t_gu =
          time_us(st, 32, [&](int i) { normed[3].second(wts[static_cast<size_t>(i) % 2]); });
      fmt::print("{:<34} {:>10.1f}\n", normed[3].first, t_gu);
      ljs["gate_up_norm_swiglu_us"] = t_gu;
      // The same layer with gate/up taking two units (four weight rows) a warp, which reads
      // the residual and the norm weight once per two units; then with both norms' weights
      // folded into the products' weights (norm_unit: the 1 / rms scale alone; the timing
      // does not depend on the weights' values).
      auto gate_up = [&](bool unit, OwnVariant form) {
        return [&, unit, form](const Wt& w) {
          MatmulArgs m = prod(x, H, w.wgu, act, I);
          m.swiglu = true, m.norm_eps = 1e-5f;
          if (unit)
            m.norm_unit = true;
          else
            m.norm_w = w.n2;
          ST(matmul_own_group_cuda_device(&m, 1, st, form));
        };
      };
      auto r2 = normed;
      r2[3] = {"gate/up + norm + swiglu, r2 u2", gate_up(false, OwnVariant::gemv_r2_u2)};
      variant(r2, 3, "chain + pdl, norms in products, gate/up r2 u2, per layer",
              "gate_up_norm_swiglu_r2u2_us", "chain_pdl_norm_in_products_r2u2_us_per_layer");
      auto folded = normed;
      folded[0] = {"q/k/v + folded norm + rope + kv write", [&](const Wt& w) {
                     MatmulArgs g[3] = {prod(x, H, w.wq, q, NQ), prod(x, H, w.wk, k, NKV),
                                        prod(x, H, w.wv, v, NKV)};
                     for (auto& m : g) m.norm_unit = true, m.norm_eps = 1e-5f;
                     RopeArgs r = ra;
                     r.k_cache = kp, r.v_cache = vp, r.cache_dtype = DType::bf16;
                     r.cache_slots = static_cast<long long>(blocks_per) * lbs;
                     r.slots = static_cast<int32_t*>(ds), r.v = v, r.v_stride = NKV;
                     ST(matmul_qkv_rope_cuda_device(g, r, st));
                   }};
      folded[3] = {"gate/up + folded norm + swiglu", gate_up(true, OwnVariant::gemv_r1_u4)};
      variant(folded, 0, "chain + pdl, folded norms in products, per layer",
              "qkv_folded_norm_rope_us", "chain_pdl_folded_norms_us_per_layer");
      const double t_fgu =
          time_us(st, 32, [&](int i) { folded[3].second(wts[static_cast<size_t>(i) % 2]); });
      fmt::print("{:<34} {:>10.1f}\n", folded[3].first, t_fgu);
      ljs["gate_up_folded_norm_swiglu_us"] = t_fgu;
      folded[3] = {"gate/up + folded norm + swiglu, r2 u2", gate_up(true, OwnVariant::gemv_r2_u2)};
      variant(folded, 3, "chain + pdl, folded norms, gate/up r2 u2, per layer",
              "gate_up_folded_norm_swiglu_r2u2_us", "chain_pdl_folded_norms_r2u2_us_per_layer");
    }
    // What each kernel's place in the chain costs: the chain (with pdl) without it. The
    // results are wrong; the time is what the kernel adds to the layer.
    const double all = ljs["chain_pdl_us_per_layer"].get<double>();
    json cj = json::array();
    fmt::print("# {:<32} {:>10}\n", "chain + pdl: what each kernel adds", "us");
    for (size_t skip = 0; skip < steps.size(); ++skip) {
      set_programmatic_launch(true);
      const double t = time_us(st, 1, [&](int) {
        for (int l = 0; l < nlayers; ++l)
          for (size_t si = 0; si < steps.size(); ++si)
            if (si != skip) steps[si].second(wts[static_cast<size_t>(l) % 2]);
      });
      set_programmatic_launch(false);
      const double adds = all - t / nlayers;
      fmt::print("{:<34} {:>10.1f}\n", steps[skip].first, adds);
      cj.push_back({{"kernel", steps[skip].first}, {"chain_adds_us", adds}});
    }
    ljs["chain_adds"] = cj;
    ljs["bytes_per_layer"] = bytes_layer;
    out["layer"] = ljs;
    for (auto& w : wts)
      for (void* p : {w.wq, w.wk, w.wv, w.wo, w.wgu, w.wd, w.n1, w.n2}) CK(cudaFree(p));
    for (void* p : {x, o, h, q, k, v, att, act, kp, vp, dt, dl, dq, ds, dp, di, aws})
      CK(cudaFree(p));
  }

  // ---- the decode layer at 8 rows (8 sequences of 256 tokens): the separate norm passes
  // and cuBLASLt where Matmul::choose picks it, against the tensor-core form with the
  // folded norms, RoPE and SwiGLU in its epilogues and o/down added into the residual ----
  if (want("layer8")) {
    const size_t H = 4096, NQ = 4096, NKV = 1024, I = 14336, M = 8;
    const int ctx = 256, lbs = 16, nlayers = 32;
    const int per_seq = (ctx + lbs - 1) / lbs, blocks_all = per_seq * static_cast<int>(M);
    struct Wt {
      void *wq, *wk, *wv, *wo, *wgu, *wd, *ones;
    };
    std::vector<Wt> wts;
    for (int c = 0; c < 2; ++c)
      wts.push_back({random_bf16(NQ * H, 400 + c, 0.02f), random_bf16(NKV * H, 410 + c, 0.02f),
                     random_bf16(NKV * H, 420 + c, 0.02f), random_bf16(H * NQ, 430 + c, 0.02f),
                     random_bf16(2 * I * H, 440 + c, 0.02f), random_bf16(H * I, 450 + c, 0.02f),
                     random_bf16(H, 460 + c)});
    void *x = random_bf16(M * H, 500), *h = dalloc(M * H * 2), *q = dalloc(M * NQ * 2),
         *k = dalloc(M * NKV * 2), *v = dalloc(M * NKV * 2), *att = dalloc(M * NQ * 2),
         *gu = dalloc(M * 2 * I * 2), *act = dalloc(M * I * 2);
    const size_t kvrow = NKV;
    void *kp = random_bf16(static_cast<size_t>(blocks_all) * lbs * kvrow, 510),
         *vp = random_bf16(static_cast<size_t>(blocks_all) * lbs * kvrow, 511);
    std::vector<int32_t> table(static_cast<size_t>(blocks_all)), lens(M, ctx), qs(M + 1), slots(M),
        pos(M, ctx - 1);
    for (int i = 0; i < blocks_all; ++i) table[static_cast<size_t>(i)] = i;
    for (size_t i = 0; i <= M; ++i) qs[i] = static_cast<int32_t>(i);
    for (size_t i = 0; i < M; ++i) slots[i] = static_cast<int32_t>(i) * per_seq * lbs + ctx - 1;
    auto up = [&](const std::vector<int32_t>& vv) {
      void* d = dalloc(vv.size() * 4);
      CK(cudaMemcpy(d, vv.data(), vv.size() * 4, cudaMemcpyHostToDevice));
      return static_cast<int32_t*>(d);
    };
    int32_t *dt = up(table), *dl = up(lens), *dq = up(qs), *ds = up(slots), *dp = up(pos);
    std::vector<float> inv(64);
    for (int i = 0; i < 64; ++i) inv[static_cast<size_t>(i)] = std::pow(500000.f, -i / 64.f);
    void* di = dalloc(64 * 4);
    CK(cudaMemcpy(di, inv.data(), 64 * 4, cudaMemcpyHostToDevice));
    PagedKVDevice kvd;
    kvd.k = kp, kvd.v = vp, kvd.dtype = DType::bf16, kvd.block_size = lbs, kvd.n_kv_heads = 8,
    kvd.head_dim = 128, kvd.num_blocks = blocks_all;
    AttentionBatch b;
    b.q = q, b.q_stride = NQ, b.out = att, b.out_stride = NQ, b.n_heads = 32, b.kv = kvd;
    b.block_tables = dt, b.max_blocks_per_seq = per_seq;
    b.seq_lens = dl, b.query_start = dq;
    b.n_seqs = static_cast<int>(M), b.n_tokens = M, b.max_query_len = 1, b.max_seq_len = ctx;
    b.scale = 0.0883883f;
    b.workspace_bytes = attention_decode_workspace_bytes(static_cast<int>(M), 32, 128, ctx);
    void* aws = dalloc(b.workspace_bytes);
    CK(cudaMemset(aws, 0, b.workspace_bytes));
    b.workspace = aws;
    RopeArgs ra;
    ra.q = q, ra.q_stride = NQ, ra.n_heads = 32, ra.k = k, ra.k_stride = NKV, ra.n_kv_heads = 8,
    ra.head_dim = 128, ra.n_tokens = M, ra.positions = dp, ra.inv_freq = static_cast<float*>(di);
    ra.k_cache = kp, ra.v_cache = vp, ra.cache_dtype = DType::bf16;
    ra.cache_slots = static_cast<long long>(blocks_all) * lbs, ra.slots = ds, ra.v = v,
    ra.v_stride = NKV;
    auto prod = [&](const void* in, size_t in_dim, const void* w, void* out_, size_t n) {
      MatmulArgs m;
      m.a = in, m.lda = in_dim, m.w = w, m.ldw = in_dim, m.out = out_, m.ldo = n, m.m = M, m.n = n,
      m.k = in_dim;
      return m;
    };
    auto qkv = [&](const Wt& w, const void* in, bool unit) {
      MatmulArgs g[3] = {prod(in, H, w.wq, q, NQ), prod(in, H, w.wk, k, NKV),
                         prod(in, H, w.wv, v, NKV)};
      for (auto& m : g) m.norm_unit = unit, m.norm_eps = 1e-5f;
      return std::array<MatmulArgs, 3>{g[0], g[1], g[2]};
    };
    using Step = std::function<void(const Wt&)>;
    using Chain = std::vector<std::pair<const char*, Step>>;
    const Step attention = [&](const Wt&) { ST(attention_decode_cuda_device(b, st)); };
    auto own_add = [&](bool own, const void* in, size_t in_dim, void* Wt::*wp, size_t n) {
      return [&, own, in, in_dim, wp, n](const Wt& w) {
        MatmulArgs m = prod(in, in_dim, w.*wp, x, n);
        m.accumulate = true;
        if (own)
          ST(matmul_own_group_cuda_device(&m, 1, st, OwnVariant::mma));
        else
          ST((*mm)->run(m, st));
      };
    };
    const Chain split = {
        {"rmsnorm",
         [&](const Wt& w) {
           ST(add_rmsnorm_cuda_device(DType::bf16, x, nullptr, w.ones, h, M, H, 1e-5f, st));
         }},
        {"q/k/v (one own launch)",
         [&](const Wt& w) { ST(matmul_own_group_cuda_device(qkv(w, h, false).data(), 3, st)); }},
        {"rope + kv write", [&](const Wt&) { ST(rope_cuda_device(ra, st)); }},
        {"attention", attention},
        {"o, added (choose)", own_add(false, att, NQ, &Wt::wo, H)},
        {"rmsnorm",
         [&](const Wt& w) {
           ST(add_rmsnorm_cuda_device(DType::bf16, x, nullptr, w.ones, h, M, H, 1e-5f, st));
         }},
        {"gate/up (choose)",
         [&](const Wt& w) { ST((*mm)->run(prod(h, H, w.wgu, gu, 2 * I), st)); }},
        {"swiglu",
         [&](const Wt&) {
           ST(swiglu_bf16_cuda_device(static_cast<const bf16_bits*>(gu),
                                      static_cast<bf16_bits*>(act), M, I, st));
         }},
        {"down, added (choose)", own_add(false, act, I, &Wt::wd, H)},
    };
    const Chain fused = {
        {"q/k/v + folded norm + rope + kv write",
         [&](const Wt& w) { ST(matmul_qkv_rope_cuda_device(qkv(w, x, true).data(), ra, st)); }},
        {"attention", attention},
        {"o, added (tensor-core form)", own_add(true, att, NQ, &Wt::wo, H)},
        {"gate/up + folded norm + swiglu",
         [&](const Wt& w) {
           MatmulArgs m = prod(x, H, w.wgu, act, I);
           m.swiglu = true, m.norm_unit = true, m.norm_eps = 1e-5f;
           ST(matmul_own_group_cuda_device(&m, 1, st, OwnVariant::mma));
         }},
        {"down, added (tensor-core form)", own_add(true, act, I, &Wt::wd, H)},
    };
    Chain fused_lt = fused;
    fused_lt[2] = {"o, added (choose)", own_add(false, att, NQ, &Wt::wo, H)};
    fused_lt[4] = {"down, added (choose)", own_add(false, act, I, &Wt::wd, H)};
    // gate/up as cuBLASLt runs it: the norm's pass, the product, SwiGLU.
    Chain fused_gu = fused;
    fused_gu.erase(fused_gu.begin() + 3);
    fused_gu.insert(fused_gu.begin() + 3, split.begin() + 5, split.begin() + 8);
    const double bytes_layer =
        2.0 * (NQ * H + 2 * NKV * H + H * NQ + 2 * I * H + H * I) + 2.0 * 2 * M * ctx * kvrow;
    fmt::print("\n# {:<40} {:>10} {:>10} {:>8}\n", "decode layer (8 rows, 8 x 256 context)", "us",
               "GB/s", "%HBM");
    json l8 = json::object();
    auto run_chain = [&](const Chain& chain, const char* label, const char* key) {
      json kj = json::array();
      double sum = 0;
      for (const auto& s8 : chain) {
        const double t =
            time_us(st, 32, [&](int i) { s8.second(wts[static_cast<size_t>(i) % 2]); });
        sum += t;
        fmt::print("  {:<40} {:>8.1f}\n", s8.first, t);
        kj.push_back({{"kernel", s8.first}, {"us", t}});
      }
      set_programmatic_launch(true);
      const double per = time_us(st, 1,
                                 [&](int) {
                                   for (int l = 0; l < nlayers; ++l)
                                     for (const auto& s8 : chain)
                                       s8.second(wts[static_cast<size_t>(l) % 2]);
                                 }) /
                         nlayers;
      set_programmatic_launch(false);
      fmt::print("{:<42} {:>10.1f} {:>10.0f} {:>7.0f}%   (sum of the kernels alone {:.1f})\n",
                 label, per, bytes_layer / per / 1e3, 100 * bytes_layer / per / 1e3 / read_gbs,
                 sum);
      l8[key] = {{"kernels", kj}, {"sum_us", sum}, {"chain_pdl_us_per_layer", per}};
    };
    run_chain(split, "chain + pdl, norms as passes, per layer", "split");
    run_chain(fused, "chain + pdl, tensor-core form fused, per layer", "fused");
    run_chain(fused_lt, "chain + pdl, fused, o/down as chosen, per layer", "fused_choose");
    run_chain(fused_gu, "chain + pdl, fused, gate/up split, per layer", "fused_gate_up_split");
    l8["bytes_per_layer"] = bytes_layer;
    out["layer8"] = l8;
    for (auto& w : wts)
      for (void* p : {w.wq, w.wk, w.wv, w.wo, w.wgu, w.wd, w.ones}) CK(cudaFree(p));
    for (void* p : {x, h, q, k, v, att, gu, act, kp, vp, di, aws}) CK(cudaFree(p));
    for (int32_t* p : {dt, dl, dq, ds, dp}) CK(cudaFree(p));
  }

  // ---- attention (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128, bf16 cache) ----
  json ajs = json::array();
  if (want("decode") || want("prefill"))
    fmt::print("\n# {:<40} {:>10} {:>10} {:>8}\n", "attention", "us", "GB/s|TF/s", "%");
  const int nh = 32, hd = 128, bs = 16;
  int nkv = 8;  // Llama-3-8B's group of 4; 4 (a group of 8) for Qwen3-MoE's rows
  // Decode runs the split-K kernel the engine uses and the previous (partitioned) kernel on
  // the same inputs; `bound` > 0 sizes the launch for contexts up to it, as the engine's
  // captured decode graphs do (CONTEXT_LEN), while the real contexts are `ctx`.
  auto attention = [&](bool decode, int n_seqs, int ctx, int qlen, bool partitioned = false,
                       int bound = 0, int variant = 0) {
    const int blocks_per = (std::max(ctx, bound) + bs - 1) / bs;
    const size_t nblocks = static_cast<size_t>(blocks_per) * n_seqs;
    const size_t row = static_cast<size_t>(nkv) * hd;
    void *kp = random_bf16(nblocks * bs * row, 5), *vp = random_bf16(nblocks * bs * row, 6);
    std::vector<int32_t> tables(nblocks), lens(static_cast<size_t>(n_seqs), ctx),
        qs(static_cast<size_t>(n_seqs) + 1);
    std::vector<int32_t> perm(nblocks);
    for (size_t i = 0; i < nblocks; ++i) perm[i] = static_cast<int32_t>(i);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    tables = perm;
    for (int s = 0; s <= n_seqs; ++s) qs[static_cast<size_t>(s)] = s * qlen;
    void *dt = dalloc(tables.size() * 4), *dl = dalloc(lens.size() * 4),
         *dq = dalloc(qs.size() * 4);
    CK(cudaMemcpy(dt, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dl, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dq, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    const size_t T = static_cast<size_t>(n_seqs) * qlen;
    void *q = random_bf16(T * nh * hd, 8), *o = dalloc(T * nh * hd * 2);
    AttentionBatch b;
    b.q = q, b.q_stride = static_cast<size_t>(nh) * hd, b.out = o, b.out_stride = b.q_stride,
    b.n_heads = nh;
    b.kv.k = kp, b.kv.v = vp, b.kv.block_size = bs, b.kv.n_kv_heads = nkv, b.kv.head_dim = hd;
    b.kv.num_blocks = static_cast<int>(nblocks);
    b.block_tables = static_cast<int32_t*>(dt), b.max_blocks_per_seq = blocks_per,
    b.seq_lens = static_cast<int32_t*>(dl);
    b.query_start = static_cast<int32_t*>(dq), b.n_seqs = n_seqs, b.n_tokens = T,
    b.max_query_len = qlen;
    b.max_seq_len = std::max(ctx, bound), b.scale = 0.0883883f;
    (decode ? b.decode_variant : b.prefill_variant) = variant;
    void* ws = nullptr;
    if (decode) {
      b.workspace_bytes =
          partitioned ? attention_decode_partitioned_workspace_bytes(n_seqs, nh, hd, b.max_seq_len)
                      : attention_decode_workspace_bytes(n_seqs, nh, hd, b.max_seq_len);
      if (b.workspace_bytes) {
        ws = dalloc(b.workspace_bytes);
        CK(cudaMemset(ws, 0, b.workspace_bytes));  // split-K's counters start at zero
      }
      b.workspace = ws;
    }
    const double t = time_us(st, decode ? 20 : 3, [&](int) {
      ST(!decode       ? attention_prefill_cuda_device(b, st)
         : partitioned ? attention_decode_partitioned_cuda_device(b, st)
                       : attention_decode_cuda_device(b, st));
    });
    const char* prefill_names[] = {
        "prefill",        "prefill (old)",        "prefill (64q)",      "prefill (128q)",
        "prefill (256q)", "prefill (256q eager)", "prefill (256q skew)"};
    const bool short_kernel = decode && !partitioned && attention_decode_short_takes(b);
    const char* kname = !decode        ? prefill_names[variant]
                        : partitioned  ? "decode (old)"
                        : variant == 1 ? "decode (U4x3)"
                        : variant == 2 ? "decode (split-K)"
                        : variant == 4 ? "decode (tensor cores)"
                        : short_kernel ? "decode (short)"
                                       : "decode";
    std::string name =
        fmt::format("{}{} seqs {} ctx {}{}", kname, nkv == 8 ? "" : " G8", n_seqs, ctx,
                    bound ? fmt::format(" bound {}", bound) : fmt::format(" q {}", qlen));
    json j = {{"kernel", !decode && variant == 1 ? "attention_prefill_previous"
                         : !decode               ? "attention_prefill"
                         : partitioned           ? "attention_decode_partitioned"
                         : short_kernel          ? "attention_decode_short"
                                                 : "attention_decode"},
              {"seqs", n_seqs},
              {"ctx", ctx},
              {"bound", std::max(ctx, bound)},
              {"variant", variant},
              {"kv_heads", nkv},
              {"q", qlen},
              {"us", t}};
    if (decode) {
      const double bytes = 2.0 * n_seqs * ctx * row * 2;
      j["GBps"] = bytes / t / 1e3;
      fmt::print("{:<42} {:>10.1f} {:>10.0f} {:>7.0f}%\n", name, t, bytes / t / 1e3,
                 100 * bytes / t / 1e3 / read_gbs);
    } else {
      // Causal: each query attends to (prefix + its index + 1) keys; 4 flops per key and dim.
      const double keys = static_cast<double>(n_seqs) *
                          (static_cast<double>(ctx - qlen) * qlen + 0.5 * qlen * (qlen + 1.0));
      const double flops = 4.0 * keys * hd * nh;
      j["TFLOPs"] = flops / t / 1e6;
      fmt::print("{:<42} {:>10.1f} {:>10.1f} {:>7.0f}%\n", name, t, flops / t / 1e6,
                 100 * flops / t / 1e6 / out["bf16_peak_TFLOPs"].get<double>());
    }
    ajs.push_back(j);
    for (void* p : {kp, vp, dt, dl, dq, q, o}) CK(cudaFree(p));
    if (ws) CK(cudaFree(ws));
  };
  // Each decode shape with the split-K kernel, its variant with more warps and fewer loads
  // each (decode_variant 1), then the previous kernel. The last three are short contexts
  // under a graph sized for 33792 (the engine's long-context graphs).
  const int decode_shapes[][3] = {{1, 4096, 0},    {1, 32768, 0},   {8, 4096, 0},    {32, 4096, 0},
                                  {1, 256, 33792}, {8, 256, 33792}, {32, 256, 33792}};
  for (const auto& d : decode_shapes) {
    if (!want("decode")) break;
    attention(true, d[0], d[1], 1, false, d[2]);
    attention(true, d[0], d[1], 1, false, d[2], 1);
    attention(true, d[0], d[1], 1, false, d[2], 4);  // split-K on the tensor cores
    attention(true, d[0], d[1], 1, true, d[2]);
  }
  // Groups of 8 query heads (Qwen3-MoE: 32 heads, 4 KV heads), where a lane holds the most
  // (q and the output of 8 heads: ~250 registers, 8 warps a multiprocessor).
  nkv = 4;
  const int g8_shapes[][3] = {{1, 4096, 0}, {1, 32768, 0}, {8, 4096, 0}, {1, 256, 33792}};
  for (const auto& d : g8_shapes) {
    if (!want("decode")) break;
    attention(true, d[0], d[1], 1, false, d[2]);
    attention(true, d[0], d[1], 1, false, d[2], 4);
  }
  // Batch 1 at short contexts with a group of 8 (the engine's short-context graph): the short
  // kernel against split-K on the tensor cores at the same bound.
  for (int sctx : {256, 1024}) {
    const int sb = attention_decode_short_max(hd, DType::bf16);
    if (!want("decode") || sb < sctx) break;
    attention(true, 1, sctx, 1, false, sb, 3);
    attention(true, 1, sctx, 1, false, sb, 4);
  }
  nkv = 8;
  // The engine's short-context graphs (bound: what the short kernel takes here): the short
  // kernel (forced where the engine would take split-K: more than one wave of clusters),
  // and split-K at the same bound.
  const int short_bound = attention_decode_short_max(hd, DType::bf16);
  for (int sctx : {256, 1024})
    for (int n : {1, 2, 8, 32}) {
      if (!want("decode") || short_bound < sctx) break;
      attention(true, n, sctx, 1, false, short_bound, 3);
      attention(true, n, sctx, 1, false, short_bound, 2);
    }
  // Prefill: the engine's kernel (the tiled kernel, block size chosen from the grid), the
  // previous kernel, then the tiled kernel with each block size forced (256 queries where
  // the shared memory allows, also rescaling on every tile: AttentionBatch::
  // prefill_variant); % is of the bf16
  // product peak above. The last shape is a chunk of 2048 after a 6144-token prefix.
  const int prefill_shapes[][2] = {{1024, 1024}, {8192, 8192}, {32768, 32768}, {8192, 2048}};
  for (const auto& p : prefill_shapes) {
    if (!want("prefill")) break;
    if (quick && p[0] > 8192) continue;
    for (int v : {0, 1, 2, 3, 4, 5, 6}) {
      if (v >= 4 && lim->smem_per_block_optin < (v == 6 ? 174848u : 104960u))
        continue;  // not on GB10
      attention(false, 1, p[0], p[1], false, 0, v);
    }
  }
  out["attention"] = ajs;

  // ---- latent attention decode (DeepSeek-V3 widths at one rank), batch 1 ----
  // mla_cuda_device as the engine calls it for one decoding sequence: q_nope into the latent
  // space through W_UK, the new token's kv_a row normalised, rotated and written, the heads
  // over the paged latent cache in mla_splits' ranges, the ranges combined and taken out
  // through W_UV. What it must read: the context's cache rows and all of kv_b (W_UK and
  // W_UV), plus q, kv_a, the norm and out; the fp32 workspace (latent queries, the ranges'
  // partials) is the kernel's own traffic and not counted.
  json lajs = json::array();
  if (want("mla")) {
    fmt::print("\n# {:<42} {:>7} {:>8} {:>9} {:>8} {:>6} {:>7}\n", "mla decode (ctx, bound, heads)",
               "splits", "MB", "us", "GB/s", "%HBM", "%cache");
    MlaShape s;
    s.nope = 128, s.rope = 64, s.v_dim = 128, s.latent = 512, s.interleave = true;
    s.rope_factor = 1.f;
    // DeepSeek-V3's softmax scale: 1/sqrt(qk_head_dim) times the square of YaRN's mscale
    // (factor 40, mscale_all_dim 1), as the engine computes it.
    const double mscale = 0.1 * std::log(40.0) + 1.0;
    s.scale = static_cast<float>(mscale * mscale / std::sqrt(192.0));
    const int W = s.latent + s.rope, blk = 16;  // the engine's default KV block size
    auto inv = rope_inv_freq(s.rope, 10000.0, {});
    void* dinv = dalloc(inv.size() * 4);
    CK(cudaMemcpy(dinv, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    // kv_a_layernorm's weights all 1: the kernel normalises kv_a in place on every call, with
    // unit weights idempotently (and rotates its k_pe, norm kept), so the row stays finite
    // over the replays.
    std::vector<uint16_t> ones(static_cast<size_t>(s.latent), 0x3f80);
    void* dnorm = dalloc(ones.size() * 2);
    CK(cudaMemcpy(dnorm, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice));
    // {context, bound}: the bound is max_seq_len, which sets the ranges (mla_splits) and
    // their length. An uncaptured step's bound is its context; the engine's decode graphs
    // are captured with the context limit as bound (max_seq_len_bound), so the last rows
    // are short contexts under a 131072 bound, where only the first ranges hold positions.
    std::vector<std::array<int, 2>> mla_shapes = {
        {4096, 4096}, {32768, 32768}, {131072, 131072}, {4096, 131072}, {32768, 131072}};
    if (quick) mla_shapes = {{4096, 4096}, {32768, 32768}, {4096, 131072}};
    // 128 heads: DeepSeek-V3 on one rank; 16: one rank of an 8-way split (or a smaller model).
    for (int heads : {128, 16})
      for (const auto& sh : mla_shapes) {
        const int ctx = sh[0], bound = sh[1];
        s.heads = heads;
        const int nblocks = ctx / blk;
        const size_t pool = static_cast<size_t>(nblocks) * blk * W;
        const size_t kvb = static_cast<size_t>(heads) * (s.nope + s.v_dim) * s.latent;
        // Enough copies of the cache and kv_b together to exceed the L2 (and at least 2).
        const size_t per_copy = (pool + kvb) * 2;
        const int copies =
            static_cast<int>(std::max<size_t>(2, (3 * lim->l2_bytes) / per_copy + 1));
        std::vector<void*> pools, kvbs;
        for (int c = 0; c < copies; ++c) {
          pools.push_back(random_bf16(pool, 200 + c));
          kvbs.push_back(random_bf16(kvb, 300 + c, 0.05f));
        }
        // One block table for every copy (each copy is its own pool of nblocks blocks),
        // blocks shuffled so the context is not one contiguous stretch.
        std::vector<int32_t> table(static_cast<size_t>(nblocks));
        for (int i = 0; i < nblocks; ++i) table[static_cast<size_t>(i)] = i;
        std::shuffle(table.begin(), table.end(), std::mt19937(11));
        const int32_t last = ctx - 1;
        const int32_t ints[] = {last, table[static_cast<size_t>(last / blk)] * blk + last % blk, 0,
                                1};
        void *dt = dalloc(table.size() * 4), *di = dalloc(sizeof(ints));
        CK(cudaMemcpy(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(di, ints, sizeof(ints), cudaMemcpyHostToDevice));
        const size_t qn = static_cast<size_t>(heads) * (s.nope + s.rope);
        // q's q_pe is rotated in place on every call, at rope_factor 1 a rotation (its norm
        // kept up to bf16 rounding), so q needs no restoring between replays.
        void *q = random_bf16(qn, 400), *kv_a = random_bf16(static_cast<size_t>(W), 401),
             *o = dalloc(static_cast<size_t>(heads) * s.v_dim * 2);
        MlaCudaArgs m;
        m.s = s;
        m.eps = 1e-6f;
        m.q = q, m.kv_a = kv_a, m.kv_norm = dnorm, m.kv_b = kvbs[0];
        m.inv_freq = static_cast<const float*>(dinv);
        m.out = o;
        m.kv.k = pools[0], m.kv.dtype = DType::bf16, m.kv.block_size = blk, m.kv.n_kv_heads = 1;
        m.kv.head_dim = W, m.kv.num_blocks = nblocks;
        m.block_tables = static_cast<const int32_t*>(dt), m.max_blocks_per_seq = nblocks;
        const int32_t* dints = static_cast<const int32_t*>(di);
        m.positions = dints, m.slots = dints + 1, m.query_start = dints + 2;
        m.n_seqs = 1, m.n_tokens = 1;
        m.max_seq_len = bound;
        const int chosen = mla_splits(m.max_seq_len, true, 1, heads, lim->sm_count);
        // The earlier choice, one range per 128 positions of the bound up to 32, beside it.
        const int earlier = std::min(32, (bound + 127) / 128);
        m.workspace_bytes = mla_workspace_bytes(m.n_tokens, s, std::max(chosen, earlier));
        void* ws = dalloc(m.workspace_bytes);
        m.workspace = ws;
        // Each shape on the tensor-core attention (where mla_cuda_device takes it) at
        // mla_splits' ranges and at the earlier 32, and on the scalar one
        // (MlaCudaArgs::scalar_attention), side by side.
        std::vector<std::pair<bool, int>> variants = {{false, chosen}};
        if (earlier != chosen) variants.push_back({false, earlier});
        variants.push_back({true, chosen});
        for (const auto& [scalar, splits] : variants) {
          m.scalar_attention = scalar;
          m.splits = splits;
          ST(mla_cuda_device(m, st));  // a bad argument fails here, before any capture
          CK(cudaStreamSynchronize(st));
          const double t = time_us(st, 20, [&](int i) {
            m.kv.k = pools[static_cast<size_t>(i) % pools.size()];
            m.kv_b = kvbs[static_cast<size_t>(i) % kvbs.size()];
            ST(mla_cuda_device(m, st));
          });
          const double cache_bytes = static_cast<double>(ctx) * W * 2;
          const double bytes = cache_bytes + static_cast<double>(kvb) * 2 + qn * 2.0 + W * 2.0 +
                               s.latent * 2.0 + static_cast<double>(heads) * s.v_dim * 2;
          const double gbs = bytes / t / 1e3;
          fmt::print("{:<44} {:>7} {:>8.1f} {:>9.1f} {:>8.0f} {:>5.0f}% {:>6.0f}%\n",
                     fmt::format("mla{} ctx {}{} heads {}",
                                 scalar             ? " scalar"
                                 : splits != chosen ? " earlier"
                                                    : "",
                                 ctx, bound != ctx ? fmt::format(" bound {}", bound) : "", heads),
                     m.splits, bytes / 1e6, t, gbs, 100 * gbs / read_gbs,
                     100 * cache_bytes / t / 1e3 / read_gbs);
          lajs.push_back({{"context", ctx},
                          {"bound", bound},
                          {"heads", heads},
                          {"attention", scalar ? "scalar" : "default"},
                          {"splits_rule", splits == chosen ? "mla_splits" : "earlier (32)"},
                          {"splits", m.splits},
                          {"us", t},
                          {"bytes", bytes},
                          {"cache_bytes", cache_bytes},
                          {"GBps", gbs},
                          {"vs_hbm", gbs / read_gbs},
                          {"cache_vs_hbm", cache_bytes / t / 1e3 / read_gbs},
                          {"copies", copies}});
        }
        for (void* p : pools) CK(cudaFree(p));
        for (void* p : kvbs) CK(cudaFree(p));
        for (void* p : {dt, di, q, kv_a, o, ws}) CK(cudaFree(p));
      }
    for (void* p : {dinv, dnorm}) CK(cudaFree(p));
  }
  out["mla"] = lajs;

  // ---- norms, RoPE, sampler ----
  json ojs = json::array();
  if (want("other")) {
    fmt::print("\n# {:<32} {:>10} {:>10} {:>8}\n", "other", "us", "GB/s", "%HBM");
    for (size_t rows : {size_t{1}, size_t{32}, size_t{8192}}) {
      const size_t dim = 4096;
      void *h = random_bf16(rows * dim, 20), *d = random_bf16(rows * dim, 21),
           *w = random_bf16(dim, 22), *y = dalloc(rows * dim * 2);
      const double t = time_us(st, 50, [&](int) {
        ST(add_rmsnorm_cuda_device(DType::bf16, h, d, w, y, rows, dim, 1e-5f, st));
      });
      const double bytes = 4.0 * rows * dim * 2;  // read h, d; write h, y
      fmt::print("{:<34} {:>10.2f} {:>10.0f} {:>7.0f}%\n",
                 fmt::format("add_rmsnorm {}x{}", rows, dim), t, bytes / t / 1e3,
                 100 * bytes / t / 1e3 / read_gbs);
      ojs.push_back({{"kernel", "add_rmsnorm"},
                     {"rows", rows},
                     {"dim", dim},
                     {"us", t},
                     {"GBps", bytes / t / 1e3}});
      for (void* p : {h, d, w, y}) CK(cudaFree(p));
    }
    for (size_t T : {size_t{1}, size_t{32}, size_t{8192}}) {
      const size_t stride = (32 + 16) * 128;
      void* qkv = random_bf16(T * stride, 30);
      std::vector<int32_t> pos(T);
      for (size_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i * 3);
      auto inv = rope_inv_freq(128, 500000.0, {});
      void *dp = dalloc(T * 4), *di = dalloc(inv.size() * 4);
      CK(cudaMemcpy(dp, pos.data(), T * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(di, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
      RopeArgs a;
      a.q = qkv, a.q_stride = stride, a.n_heads = 32, a.k = static_cast<char*>(qkv) + 32 * 128 * 2,
      a.k_stride = stride;
      a.n_kv_heads = 8, a.head_dim = 128, a.n_tokens = T, a.positions = static_cast<int32_t*>(dp),
      a.inv_freq = static_cast<float*>(di);
      const double t = time_us(st, 50, [&](int) { ST(rope_cuda_device(a, st)); });
      const double bytes = 2.0 * T * 40 * 128 * 2;
      fmt::print("{:<34} {:>10.2f} {:>10.0f} {:>7.0f}%\n", fmt::format("rope q+k {} tokens", T), t,
                 bytes / t / 1e3, 100 * bytes / t / 1e3 / read_gbs);
      ojs.push_back({{"kernel", "rope"}, {"tokens", T}, {"us", t}, {"GBps", bytes / t / 1e3}});
      for (void* p : {qkv, dp, di}) CK(cudaFree(p));
    }
  }
  if (want("sampler")) out["sampler"] = sampler_bench(st, read_gbs, big, sink, *lim);
  out["other"] = ojs;
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
  }
  std::printf("\n%s\n", out.dump().c_str());
  return 0;
}
