// The sampler on the GPU, following the definition in sampler.h with the per-element
// arithmetic and the selection steps of sampler_core.h (this file is compiled with
// -fmad=false, so float expressions round as the CPU twin's do).
//
// Each row is split over several blocks (chunks of >= kSampleMinChunk tokens, more rows
// -> longer chunks, about two blocks per multiprocessor in all), in three launches:
//   1 scan: penalties and temperature -> z in the workspace; per block the largest z, the
//     largest raw logit and the greedy argmax. Block 0 of a row zeroes the row's header.
//   2 hist: per block a shared-memory histogram of sample_bin(z) (counts; integer masses
//     for top-p alone, as two 32-bit halves with a carry, so every atomic is a native
//     32-bit one), of the raw logits' bins for the top alternatives, and the log-sum-exp
//     partial; merged into the row's header with integer atomics, which are exact in any
//     order. The row's last block (a ticket) turns the histogram into the plan
//     (sample_plan) and the raw logits' bin for the top alternatives (sample_top_bin).
//   3 draw: per block, tokens in bins above the plan's b0 are kept or not alone (min-p)
//     and their best Gumbel score kept; tokens in bins b0..b1 are appended to the row's
//     candidate list (warp-aggregated atomics); the raw logits' candidates likewise. The
//     row's last block sorts the candidates (bitonic, shared memory) and finds the floors
//     with sample_floors, draws among the kept candidates, merges the blocks' bests, sums
//     the log-sum-exp partials in block order and sorts the top-alternative candidates.
//     More than kSortCap candidates (flat rows, huge top-k): the floors come from a radix
//     selection over the list instead, on the same integer counts and masses, and the top
//     alternatives from rounds of argmax; slower, same result.
// The plan never changes the result: every token the definition can keep is in a bin up
// to b1, and those in bins below b0 are kept by it (sampler_core.h). The log-sum-exp is
// summed in float per thread and double across threads and blocks in a fixed order: the
// logprobs agree with the twin to ~1e-6 relative, not bit for bit.
//
// sample_cuda_device_v1 is the previous kernel (one block of 1024 threads per row,
// radix selection over the whole row with float masses), kept for the benchmark.
#include <algorithm>
#include <cfloat>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/sampler.h"
#include "kernels/sampler_core.h"

namespace spark::kernels {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Shared {
  float fhist[256];     // probability mass per digit (top-p)
  unsigned chist[256];  // tokens per digit (top-k)
  double dred[32];
  float fred[32];
  int ired[32];
  uint32_t prefix;
  double need;
  double dval;
  float fval;
  int ival;
};

__device__ float block_max(float v, Shared& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = dev::warp_max(v);
  if (lane == 0) sh.fred[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = sh.fred[lane];
    m = dev::warp_max(m);
    if (lane == 0) sh.fval = m;
  }
  __syncthreads();
  const float r = sh.fval;
  __syncthreads();
  return r;
}

__device__ double block_sum_d(double v, Shared& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) sh.dred[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = sh.dred[lane];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sh.dval = s;
  }
  __syncthreads();
  const double r = sh.dval;
  __syncthreads();
  return r;
}

// (value, index) argmax, larger value wins, then the lower index; index -1 = none.
__device__ __forceinline__ bool better(double v, int i, double bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}
__device__ int block_argmax(double v, int i, Shared& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  if (lane == 0) sh.dred[warp] = v, sh.ired[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = sh.dred[lane];
    i = sh.ired[lane];
    for (int o = 16; o > 0; o >>= 1) {
      const double ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (better(ov, oi, v, i)) v = ov, i = oi;
    }
    if (lane == 0) sh.ival = i;
  }
  __syncthreads();
  const int r = sh.ival;
  __syncthreads();
  return r;
}

template <typename T>
__device__ __forceinline__ float logit_at(const T* row, int i) {
  return dev::to_f(row[i]);
}

// The largest key t with weight({z >= t, z >= floor}) >= need, by 4 passes of 8 bits.
// by_mass: weight = mass[i] (exp(z - zmax) in float, 0 below the floor), else 1 per token.
// Lanes of a warp that fall into the same digit add up first (__match_any_sync), so the
// shared-memory atomics do not serialise when most tokens share a digit, as they do in
// the first pass.
__device__ float radix_floor(const float* z, const float* mass, int V, float floor_z, bool by_mass,
                             double need, Shared& sh) {
  uint32_t prefix = 0;
  const unsigned lane = threadIdx.x & 31u;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int d = threadIdx.x; d < 256; d += blockDim.x) sh.fhist[d] = 0.f, sh.chist[d] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = z[i];
      const uint32_t k = order_key(v);
      const bool in = v >= floor_z && (k & mask) == prefix;
      const unsigned bin = in ? (k >> shift) & 255u : 256u;
      const unsigned active = __activemask();
      const unsigned peers = __match_any_sync(active, bin);
      const bool leader = lane == static_cast<unsigned>(__ffs(peers) - 1);
      if (by_mass) {
        const float w = in ? mass[i] : 0.f;
        float sum = 0.f;
        if (peers == 0xffffffffu) {
          sum = dev::warp_sum(w);
        } else {
          for (unsigned m = peers; m; m &= m - 1) sum += __shfl_sync(peers, w, __ffs(m) - 1);
        }
        if (leader && in) atomicAdd(&sh.fhist[bin], sum);
      } else if (leader && in) {
        atomicAdd(&sh.chist[bin], static_cast<unsigned>(__popc(peers)));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double cum = 0;
      int pick = -1, lowest = -1;
      for (int d = 255; d >= 0; --d) {
        const double h =
            by_mass ? static_cast<double>(sh.fhist[d]) : static_cast<double>(sh.chist[d]);
        if (h == 0) continue;
        lowest = d;
        if (cum + h >= need) {
          pick = d;
          break;
        }
        cum += h;
      }
      if (pick < 0)
        pick = lowest < 0 ? 0 : lowest;  // rounding left need just out of reach
      else
        need -= cum;
      sh.prefix = prefix | (static_cast<uint32_t>(pick) << shift);
      sh.need = need;
    }
    __syncthreads();
    prefix = sh.prefix;
    need = sh.need;
    __syncthreads();
  }
  return key_float(prefix);
}

// The previous kernel's mass and keep test (double exp, compared with min_p).
__device__ __forceinline__ double v1_mass(float z, float zmax) {
  return exp(static_cast<double>(z) - static_cast<double>(zmax));
}

// The v1 keep test, with its double exp only where z is within 1e-5 of the min-p
// threshold (elsewhere the float comparison cannot differ from it).
__device__ __forceinline__ bool keep_fast(float z, float zmax, float k_floor, float p_floor,
                                          float min_p, float log_min_p) {
  if (!(z >= k_floor) || !(z >= p_floor)) return false;
  if (min_p <= 0.0f) return true;
  const float d = z - zmax;  // rounded by at most |d| * 2^-24
  const float margin = 1e-5f + 1e-6f * fabsf(d);
  if (d >= log_min_p + margin) return true;
  if (d <= log_min_p - margin) return false;
  return v1_mass(z, zmax) >= static_cast<double>(min_p);
}

// A float evaluation of sample_score within 2e-5 of it: -log(u) from u or from 1 - u
// (exact in double) so it keeps its relative precision, then float logs (1 ulp each).
__device__ __forceinline__ double score_approx(float z, const SampleParams& p, uint32_t i) {
  const double u = philox_uniform(p.seed, p.request, p.step, i);
  const float t = u < 0.5 ? -logf(static_cast<float>(u)) : -log1pf(static_cast<float>(-(1.0 - u)));
  return static_cast<double>(z) + static_cast<double>(-logf(t));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel_v1(SampleBatch b) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  const SampleParams p = b.params[r];
  const int V = b.vocab;
  const T* row = static_cast<const T*>(b.logits) + static_cast<size_t>(r) * b.logits_stride;
  float* z = static_cast<float*>(b.workspace) + static_cast<size_t>(r) * V;
  float* mass = static_cast<float*>(b.workspace) + (static_cast<size_t>(b.rows) + r) * V;
  const int slot = b.state_row ? b.state_row[r] : r;
  uint8_t* seen = b.seen ? b.seen + static_cast<size_t>(slot) * V : nullptr;
  int32_t* counts = b.counts ? b.counts + static_cast<size_t>(slot) * V : nullptr;
  const bool want_lp = p.logprobs != 0 || p.top_logprobs > 0;
  const uint32_t* mask = b.mask ? b.mask + static_cast<size_t>(r) * b.mask_words : nullptr;

  // Penalties and temperature; greedy keeps its argmax on the way. The state is read only
  // for the penalties asked for (sample_penalize ignores it otherwise).
  const bool rep = p.repetition_penalty != 1.0f;
  const bool freq = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  const bool greedy = p.temperature == 0.0f;
  float tmax = -INFINITY;
  double gbest = 0;
  int gi = -1;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float v = sample_penalize(logit_at(row, i), p, rep && seen ? seen[i] : 0,
                              freq && counts ? counts[i] : 0);
    if (greedy) {
      v = sample_masked(v, mask, i);
      if (better(v, i, gbest, gi)) gbest = v, gi = i;
    } else {
      v = sample_masked(sample_temper(v, p.temperature), mask, i);
      z[i] = v;
      tmax = fmaxf(tmax, v);
    }
  }
  int chosen;
  if (greedy) {
    chosen = block_argmax(gbest, gi, sh);
  } else {
    const float zmax = block_max(tmax, sh);
    __syncthreads();  // z is complete
    float k_floor = -INFINITY, p_floor = -INFINITY;
    if (p.top_k > 0 && p.top_k < V)
      k_floor = radix_floor(z, mass, V, -INFINITY, false, static_cast<double>(p.top_k), sh);
    if (p.top_p < 1.0f) {
      double part = 0;
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float m = z[i] >= k_floor ? expf(z[i] - zmax) : 0.f;
        mass[i] = m;
        part += m;
      }
      const double total = block_sum_d(part, sh);  // ends with a barrier: mass is complete
      p_floor = radix_floor(z, mass, V, k_floor, true, static_cast<double>(p.top_p) * total, sh);
    }
    const float log_min_p = p.min_p > 0.0f ? logf(p.min_p) : 0.f;
    double best = 0;
    int bi = -1;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = z[i];
      if (!keep_fast(v, zmax, k_floor, p_floor, p.min_p, log_min_p)) continue;
      // Only a token whose approximate score comes within the approximation's error of
      // this thread's best so far needs the exact (double) score.
      if (bi >= 0 && score_approx(v, p, static_cast<uint32_t>(i)) + 4e-5 < best) continue;
      const double sc = sample_score(v, p, static_cast<uint32_t>(i));
      if (better(sc, i, best, bi)) best = sc, bi = i;
    }
    chosen = block_argmax(best, bi, sh);
    if (chosen < 0) chosen = 0;
  }

  // Logprobs of the raw logits.
  float lse = 0.f;
  if (want_lp) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, logit_at(row, i));
    m = block_max(m, sh);
    double part = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
      part += exp(static_cast<double>(logit_at(row, i)) - m);
    lse = static_cast<float>(m + log(block_sum_d(part, sh)));
  }
  SampleResult* res = b.results ? b.results + r : nullptr;
  if (res && want_lp && p.top_logprobs > 0) {
    double pv = INFINITY;
    int pi = -1;
    const int k = min(p.top_logprobs, min(V, kSampleMaxTop));
    for (int t = 0; t < k; ++t) {
      double best = 0;
      int bi = -1;
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const double v = logit_at(row, i);
        const bool after = pi < 0 || v < pv || (v == pv && i > pi);
        if (after && better(v, i, best, bi)) best = v, bi = i;
      }
      bi = block_argmax(best, bi, sh);
      if (bi < 0) break;
      pv = logit_at(row, bi);
      pi = bi;
      if (threadIdx.x == 0) {
        res->top_ids[t] = bi;
        res->top_logprobs[t] = static_cast<float>(pv) - lse;
        res->n_top = t + 1;
      }
    }
  }
  if (threadIdx.x == 0) {
    if (res) {
      res->token = chosen;
      res->logprob = want_lp ? logit_at(row, chosen) - lse : 0.f;
      if (p.top_logprobs <= 0) res->n_top = 0;
    }
    if (b.tokens) b.tokens[r] = chosen;
    if (b.update_state) {
      if (seen) seen[chosen] = 1;
      if (counts) ++counts[chosen];
    }
  }
}

__global__ void argmax_kernel_f(const float* x, size_t dim, int32_t* out) {
  __shared__ Shared sh;
  const float* v = x + blockIdx.x * dim;
  double best = 0;
  int bi = -1;
  for (int i = threadIdx.x; i < static_cast<int>(dim); i += blockDim.x)
    if (better(v[i], i, best, bi)) best = v[i], bi = i;
  bi = block_argmax(best, bi, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = bi < 0 ? 0 : bi;
}
__global__ void argmax_kernel_b(const dev::bf16* x, size_t dim, int32_t* out) {
  __shared__ Shared sh;
  const dev::bf16* v = x + blockIdx.x * dim;
  double best = 0;
  int bi = -1;
  for (int i = threadIdx.x; i < static_cast<int>(dim); i += blockDim.x) {
    const double f = __bfloat162float(v[i]);
    if (better(f, i, best, bi)) best = f, bi = i;
  }
  bi = block_argmax(best, bi, sh);
  if (threadIdx.x == 0) out[blockIdx.x] = bi < 0 ? 0 : bi;
}

__global__ void state_reset_kernel(uint8_t* seen, int32_t* counts, int vocab) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
    if (seen) seen[i] = 0;
    if (counts) counts[i] = 0;
  }
}
__global__ void state_mark_kernel(uint8_t* seen, int vocab, const int32_t* prompt, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const int32_t t = prompt[i];
    if (t >= 0 && t < vocab) seen[t] = 1;
  }
}

// ---- the staged sampler ----
namespace staged {

constexpr int kT = 512;  // threads per block, all three launches
constexpr int kNB = kSampleBins;
constexpr int kSortCap = 2048;  // candidates sorted in shared memory; more: radix over the list
constexpr int kWarps = kT / 32;
constexpr int kU = 4;  // tokens per thread per step of the streaming loops: loads in flight

struct RowHead {
  uint32_t zcount[kNB];
  unsigned long long zmass[kNB];
  uint32_t lcount[kNB];
  uint32_t ncand, nraw, ticket2, ticket3;
  SamplePlan plan;
  int32_t lbin;
  float zmax, lmax;
};
static_assert(sizeof(RowHead) <= kSampleHeadBytes, "kSampleHeadBytes is too small");

struct Partial {
  float zmax, lmax, gval;
  int32_t gid;
  double lse;
  double best;
  int32_t bid;
};
static_assert(sizeof(Partial) <= kSamplePartialBytes, "kSamplePartialBytes is too small");

// Where a row's pieces lie in the workspace (the order sample_workspace_bytes counts).
struct Layout {
  char* base;
  int rows, vocab, S, chunk;
  size_t max_chunks;
  __device__ RowHead* head(int r) const {
    return reinterpret_cast<RowHead*>(base + static_cast<size_t>(r) * kSampleHeadBytes);
  }
  __device__ Partial* part(int r, int s) const {
    return reinterpret_cast<Partial*>(
        base + static_cast<size_t>(rows) * kSampleHeadBytes +
        (static_cast<size_t>(r) * max_chunks + static_cast<size_t>(s)) * kSamplePartialBytes);
  }
  __device__ char* tail() const {
    return base + static_cast<size_t>(rows) * (kSampleHeadBytes + max_chunks * kSamplePartialBytes);
  }
  __device__ float* z(int r) const {
    return reinterpret_cast<float*>(tail()) + static_cast<size_t>(r) * vocab;
  }
  __device__ int32_t* cand(int r) const {
    return reinterpret_cast<int32_t*>(tail()) + (static_cast<size_t>(rows) + r) * vocab;
  }
  __device__ int32_t* raw(int r) const {
    return reinterpret_cast<int32_t*>(tail()) + (2 * static_cast<size_t>(rows) + r) * vocab;
  }
};

struct Scratch {
  float f[kWarps];
  double d[kWarps];
  int i[kWarps];
  unsigned long long u[kWarps];
  float fo;
  double dof;
  int io;
  unsigned long long uo;
};

__device__ float bmax(float v, Scratch& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  v = dev::warp_max(v);
  if (lane == 0) sh.f[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float m = lane < kWarps ? sh.f[lane] : -INFINITY;
    m = dev::warp_max(m);
    if (lane == 0) sh.fo = m;
  }
  __syncthreads();
  const float r = sh.fo;
  __syncthreads();
  return r;
}

__device__ double bsum_d(double v, Scratch& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) sh.d[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = lane < kWarps ? sh.d[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sh.dof = s;
  }
  __syncthreads();
  const double r = sh.dof;
  __syncthreads();
  return r;
}

__device__ unsigned long long bsum_u(unsigned long long v, Scratch& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) sh.u[warp] = v;
  __syncthreads();
  if (warp == 0) {
    unsigned long long s = lane < kWarps ? sh.u[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sh.uo = s;
  }
  __syncthreads();
  const unsigned long long r = sh.uo;
  __syncthreads();
  return r;
}

// (value, index) argmax over the block: larger value, then the lower index; -1 = none.
__device__ int bargmax(double v, int i, Scratch& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
  if (lane == 0) sh.d[warp] = v, sh.i[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? sh.d[lane] : 0.0;
    i = lane < kWarps ? sh.i[lane] : -1;
    for (int o = 16; o > 0; o >>= 1) {
      const double ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (better(ov, oi, v, i)) v = ov, i = oi;
    }
    if (lane == 0) sh.io = i, sh.dof = v;
  }
  __syncthreads();
  const int r = sh.io;
  __syncthreads();
  return r;
}

// Appends id to list where `want`, one atomic per warp; every lane of the warp calls it.
__device__ __forceinline__ void append(bool want, int id, uint32_t* counter, int32_t* list) {
  const unsigned m = __ballot_sync(0xffffffffu, want);
  if (!m) return;
  const unsigned lane = threadIdx.x & 31u;
  const int leader = __ffs(m) - 1;
  uint32_t base = 0;
  if (lane == static_cast<unsigned>(leader))
    base = atomicAdd(counter, static_cast<unsigned>(__popc(m)));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (want) list[base + static_cast<unsigned>(__popc(m & ((1u << lane) - 1u)))] = id;
}

// Adds a mass (< 2^32, or exactly 2^32) to a bin kept as two 32-bit halves: the low half
// wraps modulo 2^32 and each wrap carries one into the high half.
__device__ __forceinline__ void add_mass(uint32_t* lo, uint32_t* hi, uint64_t m) {
  const uint32_t l = static_cast<uint32_t>(m);
  uint32_t h = static_cast<uint32_t>(m >> 32);
  if (l) {
    const uint32_t old = atomicAdd(lo, l);
    if (old + l < old) ++h;
  }
  if (h) atomicAdd(hi, h);
}

// Programmatic dependent launch: a kernel lets the next one start launching, and the next
// one waits for this one's completion (and its memory) before it reads what it wrote.
// Both are no-ops when the launch did not ask for it.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

struct RowFlags {
  bool greedy, has_k, has_p, want_lp, need_z, need_m, need_l;
  __device__ RowFlags(const SampleParams& p, int V) {
    greedy = p.temperature == 0.0f;
    has_k = sample_has_k(p, V);
    has_p = sample_has_p(p);
    want_lp = p.logprobs != 0 || p.top_logprobs > 0;
    need_z = !greedy && (has_k || has_p);
    need_m = need_z && has_p && !has_k;
    need_l = p.top_logprobs > 0;
  }
};

template <typename T>
__device__ __forceinline__ const T* row_of(const SampleBatch& b, int r) {
  return static_cast<const T*>(b.logits) + static_cast<size_t>(r) * b.logits_stride;
}

// Warp 0 finds, over a histogram, the first bin where the cumulative (count, weight) from
// the top satisfies `reach`: lane l holds bins [16 l, 16 l + 16), an inclusive scan over
// the lanes' sums finds the lane, and that lane walks its 16 bins. The same bin and the
// same sums below it as sample_plan's and sample_top_bin's serial walks (the condition is
// monotone in the cumulative sums). Returns the bin (kNB - 1 when never reached) and the
// count and weight of the bins below it (of all bins when never reached); warp 0 only.
template <int NB = kNB, class Reach>
__device__ int first_reach(const uint32_t* count, const unsigned long long* weight, Reach reach,
                           unsigned long long* below_count, unsigned long long* below_weight,
                           bool* found = nullptr) {
  static_assert(NB % 32 == 0, "bins must split over 32 lanes");
  constexpr int kBinsPerLane = NB / 32;
  const unsigned lane = threadIdx.x & 31u;
  unsigned long long c = 0, w = 0;
  for (int j = 0; j < kBinsPerLane; ++j) {
    c += count[lane * kBinsPerLane + j];
    w += weight ? weight[lane * kBinsPerLane + j] : 0ull;
  }
  unsigned long long ci = c, wi = w;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long oc = __shfl_up_sync(0xffffffffu, ci, o);
    const unsigned long long ow = __shfl_up_sync(0xffffffffu, wi, o);
    if (lane >= static_cast<unsigned>(o)) ci += oc, wi += ow;
  }
  const unsigned hit = __ballot_sync(0xffffffffu, reach(ci, wi));
  if (found) *found = hit != 0;
  if (!hit) {
    *below_count = __shfl_sync(0xffffffffu, ci, 31);
    *below_weight = __shfl_sync(0xffffffffu, wi, 31);
    return NB - 1;
  }
  const int L = __ffs(hit) - 1;
  int bin = NB - 1;
  unsigned long long bc = 0, bw = 0;
  if (lane == static_cast<unsigned>(L)) {
    unsigned long long cc = ci - c, ww = wi - w;  // exclusive: the lanes below
    for (int j = 0; j < kBinsPerLane; ++j) {
      const int b = L * kBinsPerLane + j;
      const unsigned long long nc = cc + count[b], nw = ww + (weight ? weight[b] : 0ull);
      if (reach(nc, nw)) {
        bin = b;
        break;
      }
      cc = nc, ww = nw;
    }
    bc = cc, bw = ww;
  }
  *below_count = __shfl_sync(0xffffffffu, bc, L);
  *below_weight = __shfl_sync(0xffffffffu, bw, L);
  return __shfl_sync(0xffffffffu, bin, L);
}

// sample_plan on warp 0 (first_reach for its walks); lane 0 writes the plan.
__device__ void plan_warp(const SampleParams& p, int V, const uint32_t* count,
                          const unsigned long long* mass, SamplePlan* out) {
  SamplePlan pl;
  unsigned long long bc = 0, bw = 0;
  if (sample_has_k(p, V)) {
    pl.b0 = 0;
    const unsigned long long need = static_cast<unsigned long long>(p.top_k);
    pl.b1 = first_reach(
        count, nullptr, [&](unsigned long long c, unsigned long long) { return c >= need; }, &bc,
        &bw);
  } else if (sample_has_p(p)) {
    unsigned long long t = 0;
    for (int j = threadIdx.x & 31; j < kNB; j += 32) t += mass[j];
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    pl.total = t;
    const double target = static_cast<double>(p.top_p) * static_cast<double>(t);
    const int b = first_reach(
        count, mass,
        [&](unsigned long long, unsigned long long w) { return static_cast<double>(w) >= target; },
        &bc, &bw);
    pl.b0 = pl.b1 = b;
    pl.prefix_mass = bw;
    pl.prefix_count = static_cast<uint32_t>(bc);
  }
  if ((threadIdx.x & 31) == 0) *out = pl;
}

// sample_top_bin on warp 0.
__device__ int top_bin_warp(const uint32_t* count, int k) {
  unsigned long long bc = 0, bw = 0;
  const unsigned long long need = static_cast<unsigned long long>(k);
  return first_reach(
      count, nullptr, [&](unsigned long long c, unsigned long long) { return c >= need; }, &bc,
      &bw);
}

// sample_keep for a token above every floor (min-p alone), with the exact integer test
// only near the threshold: for min_p >= 1e-5, d more than 1e-4 above logf(min_p) means
// mass >= min_p 2^32 (the exp's error is 1e-15, logf's 1e-6, the floor's one unit), and
// 1e-4 below means less.
__device__ __forceinline__ bool keep_sure(float z, float zmax, float min_p, float log_min_p) {
  if (min_p <= 0.0f) return true;
  if (min_p >= 1e-5f) {
    const float d = z - zmax;
    if (d > log_min_p + 1e-4f) return true;
    if (d < log_min_p - 1e-4f) return false;
  }
  return sample_keep(z, zmax, -INFINITY, -INFINITY, min_p);
}

// Inclusive prefix sums of a[0, n) in place (n <= kT * 4), over the block.
__device__ void block_scan_u64(unsigned long long* a, int n, Scratch& sh) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const int per = (n + kT - 1) / kT;
  const int j0 = static_cast<int>(threadIdx.x) * per;
  unsigned long long run = 0;
  for (int q = 0; q < per; ++q)
    if (j0 + q < n) run += a[j0 + q], a[j0 + q] = run;
  unsigned long long x = run;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  if (lane == 31) sh.u[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned long long v = lane < static_cast<unsigned>(kWarps) ? sh.u[lane] : 0ull;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= static_cast<unsigned>(o)) v += y;
    }
    if (lane < static_cast<unsigned>(kWarps)) sh.u[lane] = v;
  }
  __syncthreads();
  const unsigned long long off = x - run + (warp > 0 ? sh.u[warp - 1] : 0ull);
  for (int q = 0; q < per; ++q)
    if (j0 + q < n) a[j0 + q] += off;
  __syncthreads();
}

// 1: penalties, temperature, maxima, greedy argmax.
template <typename T>
__global__ void __launch_bounds__(kT) k_scan(SampleBatch b, Layout L) {
  __shared__ Scratch sh;
  pdl_trigger();
  const int r = blockIdx.y, s = blockIdx.x;
  const SampleParams p = b.params[r];
  const int V = b.vocab;
  const RowFlags fl(p, V);
  if (s == 0) {
    auto* w = reinterpret_cast<uint32_t*>(L.head(r));
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(RowHead) / 4); i += kT) w[i] = 0;
  }
  const T* row = row_of<T>(b, r);
  const int slot = b.state_row ? b.state_row[r] : r;
  const uint8_t* seen = b.seen ? b.seen + static_cast<size_t>(slot) * V : nullptr;
  const int32_t* counts = b.counts ? b.counts + static_cast<size_t>(slot) * V : nullptr;
  const bool rep = p.repetition_penalty != 1.0f && seen;
  const bool freq = (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) && counts;
  const uint32_t* mask = b.mask ? b.mask + static_cast<size_t>(r) * b.mask_words : nullptr;
  float* z = L.z(r);
  const int c0 = s * L.chunk, c1 = min(V, c0 + L.chunk);
  float zm = -INFINITY, lm = -INFINITY;
  double gv = 0;
  int gi = -1;
  for (int i0 = c0 + static_cast<int>(threadIdx.x); i0 < c1; i0 += kT * kU) {
    float l[kU];
    uint8_t sn[kU];
    int32_t cn[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kT;
      const bool in = i < c1;
      l[u] = in ? dev::to_f(row[i]) : 0.f;
      sn[u] = rep && in ? seen[i] : 0;
      cn[u] = freq && in ? counts[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kT;
      if (i >= c1) continue;
      lm = fmaxf(lm, l[u]);
      float v = sample_penalize(l[u], p, sn[u], cn[u]);
      if (fl.greedy) {
        v = sample_masked(v, mask, i);
        if (better(v, i, gv, gi)) gv = v, gi = i;
      } else {
        v = sample_masked(sample_temper(v, p.temperature), mask, i);
        z[i] = v;
        zm = fmaxf(zm, v);
      }
    }
  }
  zm = bmax(zm, sh);
  lm = bmax(lm, sh);
  gi = fl.greedy ? bargmax(gv, gi, sh) : -1;
  if (threadIdx.x == 0) {
    Partial* P = L.part(r, s);
    P->zmax = zm, P->lmax = lm, P->gid = gi;
    P->gval = static_cast<float>(sh.dof);  // the block's best penalised logit (exact in float)
  }
}

// 2: histograms, log-sum-exp partials; the row's last block makes the plan.
template <typename T>
__global__ void __launch_bounds__(kT) k_hist(SampleBatch b, Layout L) {
  __shared__ uint32_t cnt[kNB], mlo[kNB], mhi[kNB], lc[kNB];
  __shared__ unsigned long long msum[kNB];
  __shared__ Scratch sh;
  __shared__ bool last;
  pdl_trigger();
  const int r = blockIdx.y, s = blockIdx.x;
  const SampleParams p = b.params[r];
  const int V = b.vocab;
  const RowFlags fl(p, V);
  RowHead* h = L.head(r);
  pdl_wait();  // the partials and z of launch 1
  float zm = -INFINITY, lm = -INFINITY;
  for (int t = threadIdx.x; t < L.S; t += kT) {
    const Partial* P = L.part(r, t);
    zm = fmaxf(zm, P->zmax);
    lm = fmaxf(lm, P->lmax);
  }
  zm = bmax(zm, sh);
  lm = bmax(lm, sh);
  for (int i = threadIdx.x; i < kNB; i += kT) cnt[i] = 0, mlo[i] = 0, mhi[i] = 0, lc[i] = 0;
  __syncthreads();
  const T* row = row_of<T>(b, r);
  const float* z = L.z(r);
  const int c0 = s * L.chunk, c1 = min(V, c0 + L.chunk);
  uint32_t over_z = 0, over_l = 0;
  float lsum = 0.f;
  if (fl.need_z || fl.need_l || fl.want_lp) {
    for (int i0 = c0 + static_cast<int>(threadIdx.x); i0 < c1; i0 += kT * kU) {
      float zv[kU], lv[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + u * kT;
        const bool in = i < c1;
        zv[u] = fl.need_z && in ? z[i] : 0.f;
        lv[u] = (fl.need_l || fl.want_lp) && in ? dev::to_f(row[i]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (i0 + u * kT >= c1) continue;
        if (fl.need_z) {
          const float v = zv[u];
          const int bn = sample_bin(v, zm);
          if (bn < kNB - 1) {
            atomicAdd(&cnt[bn], 1u);
            if (fl.need_m) add_mass(&mlo[bn], &mhi[bn], sample_mass_q(v, zm));
          } else {
            ++over_z;  // mass 0 there; counted in registers, not in one contended bin
          }
        }
        if (fl.need_l || fl.want_lp) {
          const float l = lv[u];
          if (fl.need_l) {
            const int lb = sample_bin(l, lm);
            if (lb < kNB - 1)
              atomicAdd(&lc[lb], 1u);
            else
              ++over_l;
          }
          if (fl.want_lp) lsum += expf(l - lm);
        }
      }
    }
  }
  const unsigned long long oz = bsum_u(over_z, sh), ol = bsum_u(over_l, sh);
  const double ls = bsum_d(lsum, sh);  // ends with a barrier: the histograms are complete
  for (int i = threadIdx.x; i < kNB; i += kT) {
    const uint32_t c = cnt[i] + (i == kNB - 1 ? static_cast<uint32_t>(oz) : 0u);
    if (c) atomicAdd(&h->zcount[i], c);
    const unsigned long long m = mlo[i] + (static_cast<unsigned long long>(mhi[i]) << 32);
    if (m) atomicAdd(&h->zmass[i], m);
    const uint32_t d = lc[i] + (i == kNB - 1 ? static_cast<uint32_t>(ol) : 0u);
    if (d) atomicAdd(&h->lcount[i], d);
  }
  if (threadIdx.x == 0) L.part(r, s)->lse = ls;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&h->ticket2, 1u) == static_cast<unsigned>(L.S - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < kNB; i += kT) {
    cnt[i] = __ldcg(&h->zcount[i]);
    msum[i] = __ldcg(&h->zmass[i]);
    lc[i] = __ldcg(&h->lcount[i]);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0: sample_plan and sample_top_bin, in parallel walks
    if (fl.need_z)
      plan_warp(p, V, cnt, msum, &h->plan);
    else if (threadIdx.x == 0)
      h->plan = SamplePlan{};
    const int lb = fl.need_l ? top_bin_warp(lc, min(V, p.top_logprobs)) : -1;
    if (threadIdx.x == 0) {
      h->lbin = lb;
      h->zmax = zm;
      h->lmax = lm;
    }
  }
}

__device__ __forceinline__ unsigned long long sort_key(float v, int id) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) |
         (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ float key_value(unsigned long long k) {
  return key_float(static_cast<uint32_t>(k >> 32));
}
__device__ __forceinline__ int key_id(unsigned long long k) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(k));
}

// Sorts keys[0, n) (n a power of two <= kSortCap) largest first.
__device__ void bitonic_desc(unsigned long long* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kT) {
        const int x = i ^ j;
        if (x > i) {
          const unsigned long long a = keys[i], c = keys[x];
          const bool desc = (i & k) == 0;
          if (desc ? a < c : a > c) keys[i] = c, keys[x] = a;
        }
      }
      __syncthreads();
    }
  }
}

struct Hist256 {
  uint32_t c[256], lo[256], hi[256];
  uint32_t rc[256];            // counts by digit from the top (bin 255 - d)
  unsigned long long rw[256];  // masses likewise
  uint32_t prefix;
  unsigned long long carry;
};

// Over the listed tokens with z >= floor_z: the value t at which, walking down from the
// top, the count reaches `need` (by_mass false), or double(base + mass of {z >= t}) first
// reaches `target` (by_mass true). Four passes of 8 bits over order-preserving keys; the
// same decision as sample_floors' walk, which the sorted path makes.
__device__ float list_select(const int32_t* ids, uint32_t n, const float* z, float zm,
                             float floor_z, bool by_mass, uint64_t need, uint64_t base,
                             double target, Hist256& hs) {
  uint32_t prefix = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int d = threadIdx.x; d < 256; d += kT) hs.c[d] = 0, hs.lo[d] = 0, hs.hi[d] = 0;
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < n; j += kT) {
      const float v = z[__ldcg(ids + j)];
      const uint32_t k = order_key(v);
      if (!(v >= floor_z) || (k & mask) != prefix) continue;
      const unsigned d = (k >> shift) & 255u;
      if (by_mass)
        add_mass(&hs.lo[d], &hs.hi[d], sample_mass_q(v, zm));
      else
        atomicAdd(&hs.c[d], 1u);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += kT) {
      hs.rc[255 - d] = hs.c[d];
      hs.rw[255 - d] =
          by_mass ? hs.lo[d] + (static_cast<unsigned long long>(hs.hi[d]) << 32) : 0ull;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: the first digit from the top that reaches
      unsigned long long bc = 0, bw = 0;
      bool reached = false;
      int bin;
      if (by_mass)
        bin = first_reach<256>(
            hs.rc, hs.rw,
            [&](unsigned long long, unsigned long long w) {
              return static_cast<double>(base + w) >= target;
            },
            &bc, &bw, &reached);
      else
        bin = first_reach<256>(
            hs.rc, nullptr, [&](unsigned long long c, unsigned long long) { return c >= need; },
            &bc, &bw, &reached);
      if (threadIdx.x == 0) {
        int pick;
        if (reached) {
          pick = 255 - bin;
          if (by_mass)
            base += bw;
          else
            need -= bc;
        } else {  // rounding left the target just out of reach: the lowest digit present
          pick = 0;
          for (int d = 0; d < 256; ++d)
            if (by_mass ? hs.rw[255 - d] != 0 : hs.rc[255 - d] != 0) {
              pick = d;
              break;
            }
        }
        hs.prefix = prefix | (static_cast<uint32_t>(pick) << shift);
        hs.carry = by_mass ? base : need;
      }
    }
    __syncthreads();
    prefix = hs.prefix;
    if (by_mass)
      base = hs.carry;
    else
      need = hs.carry;
    __syncthreads();
  }
  return key_float(prefix);
}

// 3: candidates and the sure set's draw; the row's last block finishes the row.
template <typename T>
__global__ void __launch_bounds__(kT) k_draw(SampleBatch b, Layout L) {
  __shared__ unsigned long long keys[kSortCap];
  __shared__ unsigned long long ms[kSortCap];
  __shared__ Scratch sh;
  __shared__ Hist256 hs;
  __shared__ double slse;
  __shared__ bool last;
  const int r = blockIdx.y, s = blockIdx.x;
  const SampleParams p = b.params[r];
  const int V = b.vocab;
  const RowFlags fl(p, V);
  RowHead* h = L.head(r);
  pdl_wait();  // the plan and histograms of launch 2
  const SamplePlan pl = h->plan;
  const float zm = h->zmax, lm = h->lmax;
  const int lbin = h->lbin;
  const T* row = row_of<T>(b, r);
  const float* z = L.z(r);
  int32_t* cand = L.cand(r);
  int32_t* raw = L.raw(r);
  const int c0 = s * L.chunk, c1 = min(V, c0 + L.chunk);
  double best = 0;
  int bi = -1;
  const float log_min_p = p.min_p > 0.0f ? logf(p.min_p) : 0.f;
  if (!fl.greedy || fl.need_l) {
    for (int base = c0; base < c1; base += kT * kU) {
      float zv[kU], lv[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = base + u * kT + static_cast<int>(threadIdx.x);
        const bool in = i < c1;
        zv[u] = !fl.greedy && in ? z[i] : 0.f;
        lv[u] = fl.need_l && in ? dev::to_f(row[i]) : 0.f;
      }
      if (!fl.greedy) {
        // The sure set: approximate scores first; only a token whose approximation comes
        // within its error of the warp's best approximation (or of this thread's best
        // exact score) can be the argmax, and only those get the exact score.
        int bn[kU];
        double a[kU];
        double m = -INFINITY;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = base + u * kT + static_cast<int>(threadIdx.x);
          bn[u] = i < c1 ? sample_bin(zv[u], zm) : kNB;
          a[u] = -INFINITY;
          if (i < c1 && bn[u] < pl.b0 && keep_sure(zv[u], zm, p.min_p, log_min_p)) {
            a[u] = score_approx(zv[u], p, static_cast<uint32_t>(i));
            m = fmax(m, a[u]);
          }
        }
        for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = base + u * kT + static_cast<int>(threadIdx.x);
          if (a[u] == -INFINITY || a[u] + 4e-5 < m || (bi >= 0 && a[u] + 4e-5 < best)) continue;
          const double sc = sample_score(zv[u], p, static_cast<uint32_t>(i));
          if (better(sc, i, best, bi)) best = sc, bi = i;
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = base + u * kT + static_cast<int>(threadIdx.x);
          append(i < c1 && bn[u] >= pl.b0 && bn[u] <= pl.b1, i, &h->ncand, cand);
        }
      }
      if (fl.need_l) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = base + u * kT + static_cast<int>(threadIdx.x);
          append(i < c1 && sample_bin(lv[u], lm) <= lbin, i, &h->nraw, raw);
        }
      }
    }
  }
  bi = bargmax(best, bi, sh);
  if (threadIdx.x == 0) {
    Partial* P = L.part(r, s);
    P->bid = bi;
    P->best = sh.dof;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&h->ticket3, 1u) == static_cast<unsigned>(L.S - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();

  // ---- the row's last block: the draw ----
  best = 0, bi = -1;
  if (fl.greedy) {
    for (int t = threadIdx.x; t < L.S; t += kT) {
      const int gi = __ldcg(&L.part(r, t)->gid);
      const float gv = __ldcg(&L.part(r, t)->gval);
      if (better(gv, gi, best, bi)) best = gv, bi = gi;
    }
  } else {
    for (int t = threadIdx.x; t < L.S; t += kT) {
      const int pi = __ldcg(&L.part(r, t)->bid);
      const double pv = __ldcg(&L.part(r, t)->best);
      if (better(pv, pi, best, bi)) best = pv, bi = pi;
    }
    const uint32_t n = __ldcg(&h->ncand);
    if (n > 0 && n <= static_cast<uint32_t>(kSortCap)) {
      int np = 1;
      while (np < static_cast<int>(n)) np <<= 1;
      for (int j = threadIdx.x; j < np; j += kT) {
        if (j < static_cast<int>(n)) {
          const int id = __ldcg(cand + j);
          keys[j] = sort_key(z[id], id);
        } else {
          keys[j] = 0;
        }
      }
      __syncthreads();
      bitonic_desc(keys, np);
      if (fl.has_p)
        for (int j = threadIdx.x; j < static_cast<int>(n); j += kT)
          ms[j] = sample_mass_q(key_value(keys[j]), zm);
      __syncthreads();
      // sample_floors, in parallel: the top-k floor is the top_k-th value; top-p's is at
      // the first sorted position whose prefix mass reaches the target (prefix sums over
      // the block; the condition is monotone, so the first is where it turns true).
      SampleFloors f;
      const int nn = static_cast<int>(n);
      if (fl.has_k) {
        const int64_t at = static_cast<int64_t>(p.top_k) - 1 - pl.prefix_count;
        f.k_floor = key_value(keys[at < 0 ? 0 : (at >= nn ? nn - 1 : at)]);
      }
      if (fl.has_p) {
        if (threadIdx.x == 0) sh.io = nn;
        __syncthreads();
        if (fl.has_k)
          for (int j = threadIdx.x; j < nn; j += kT)
            if (!(key_value(keys[j]) >= f.k_floor) &&
                (j == 0 || key_value(keys[j - 1]) >= f.k_floor))
              sh.io = j;  // the first value below the top-k floor
        __syncthreads();
        const int lim = sh.io;
        __syncthreads();
        block_scan_u64(ms, lim, sh);
        if (lim > 0) {
          const uint64_t total = fl.has_k ? static_cast<uint64_t>(ms[lim - 1]) : pl.total;
          const uint64_t base0 = fl.has_k ? 0 : pl.prefix_mass;
          const double target = static_cast<double>(p.top_p) * static_cast<double>(total);
          if (threadIdx.x == 0) sh.io = lim - 1;
          __syncthreads();
          for (int j = threadIdx.x; j < lim; j += kT) {
            const bool here = static_cast<double>(base0 + ms[j]) >= target;
            const bool before = j > 0 && static_cast<double>(base0 + ms[j - 1]) >= target;
            if (here && !before) sh.io = j;
          }
          __syncthreads();
          f.p_floor = key_value(keys[sh.io]);
          __syncthreads();
        }
      }
      for (int j = threadIdx.x; j < static_cast<int>(n); j += kT) {
        const float v = key_value(keys[j]);
        const int id = key_id(keys[j]);
        if (!sample_keep(v, zm, f.k_floor, f.p_floor, p.min_p)) continue;
        const double sc = sample_score(v, p, static_cast<uint32_t>(id));
        if (better(sc, id, best, bi)) best = sc, bi = id;
      }
    } else if (n > 0) {  // too many to sort: radix selection over the list
      SampleFloors f;
      if (fl.has_k)
        f.k_floor = list_select(cand, n, z, zm, -INFINITY, false,
                                static_cast<uint64_t>(p.top_k) - pl.prefix_count, 0, 0, hs);
      if (fl.has_p) {
        uint64_t total = pl.total, base = pl.prefix_mass;
        if (fl.has_k) {
          unsigned long long part = 0;
          for (uint32_t j = threadIdx.x; j < n; j += kT) {
            const float v = z[__ldcg(cand + j)];
            if (v >= f.k_floor) part += sample_mass_q(v, zm);
          }
          total = bsum_u(part, sh);
          base = 0;
        }
        const double target = static_cast<double>(p.top_p) * static_cast<double>(total);
        f.p_floor = list_select(cand, n, z, zm, f.k_floor, true, 0, base, target, hs);
      }
      for (uint32_t j = threadIdx.x; j < n; j += kT) {
        const int id = __ldcg(cand + j);
        const float v = z[id];
        if (!sample_keep(v, zm, f.k_floor, f.p_floor, p.min_p)) continue;
        const double sc = sample_score(v, p, static_cast<uint32_t>(id));
        if (better(sc, id, best, bi)) best = sc, bi = id;
      }
    }
  }
  int chosen = bargmax(best, bi, sh);
  if (chosen < 0) chosen = 0;

  // ---- logprobs ----
  if (threadIdx.x == 0) {
    double sum = 0;
    if (fl.want_lp)
      for (int t = 0; t < L.S; ++t) sum += __ldcg(&L.part(r, t)->lse);
    slse = fl.want_lp ? static_cast<double>(lm) + log(sum) : 0.0;
  }
  __syncthreads();
  const float lse = static_cast<float>(slse);
  SampleResult* res = b.results ? b.results + r : nullptr;
  if (res && fl.need_l) {
    const int k = min(p.top_logprobs, min(V, kSampleMaxTop));
    const uint32_t n = __ldcg(&h->nraw);
    if (n <= static_cast<uint32_t>(kSortCap)) {
      int np = 1;
      while (np < static_cast<int>(n)) np <<= 1;
      for (int j = threadIdx.x; j < np; j += kT) {
        if (j < static_cast<int>(n)) {
          const int id = __ldcg(raw + j);
          keys[j] = sort_key(dev::to_f(row[id]), id);
        } else {
          keys[j] = 0;
        }
      }
      __syncthreads();
      bitonic_desc(keys, np);
      if (threadIdx.x < static_cast<unsigned>(k) && threadIdx.x < n) {
        const int t = static_cast<int>(threadIdx.x);
        res->top_ids[t] = key_id(keys[t]);
        res->top_logprobs[t] = key_value(keys[t]) - lse;
      }
      if (threadIdx.x == 0) res->n_top = min(k, static_cast<int>(n));
    } else {  // many equal logits: rounds of argmax over the list
      double pv = INFINITY;
      int pi = -1;
      for (int t = 0; t < k; ++t) {
        double bv2 = 0;
        int bj = -1;
        for (uint32_t j = threadIdx.x; j < n; j += kT) {
          const int id = __ldcg(raw + j);
          const double v = dev::to_f(row[id]);
          const bool after = pi < 0 || v < pv || (v == pv && id > pi);
          if (after && better(v, id, bv2, bj)) bv2 = v, bj = id;
        }
        bj = bargmax(bv2, bj, sh);
        if (bj < 0) break;
        pv = dev::to_f(row[bj]);
        pi = bj;
        if (threadIdx.x == 0) {
          res->top_ids[t] = bj;
          res->top_logprobs[t] = static_cast<float>(pv) - lse;
          res->n_top = t + 1;
        }
      }
    }
  }
  if (threadIdx.x == 0) {
    if (res) {
      res->token = chosen;
      res->logprob = fl.want_lp ? dev::to_f(row[chosen]) - lse : 0.f;
      if (!fl.need_l) res->n_top = 0;
    }
    if (b.tokens) b.tokens[r] = chosen;
    if (b.update_state) {
      const int slot = b.state_row ? b.state_row[r] : r;
      if (b.seen) b.seen[static_cast<size_t>(slot) * V + chosen] = 1;
      if (b.counts) ++b.counts[static_cast<size_t>(slot) * V + chosen];
    }
  }
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0)
      v = 108;
    return v;
  }();
  return n;
}

}  // namespace staged

}  // namespace

static Status sample_check_batch(const SampleBatch& b) {
  if (b.vocab <= 0) return make_error(Errc::usage, "sampler: vocab must be > 0");
  if (b.rows <= 0) return Status::Ok();
  if (!b.logits || !b.params || (!b.results && !b.tokens))
    return make_error(Errc::usage, "sampler: null logits, params, or both results and tokens");
  if (b.logits_stride < static_cast<size_t>(b.vocab))
    return make_error(Errc::usage, "sampler: logits_stride is less than vocab");
  const size_t need = sample_workspace_bytes(b.rows, b.vocab);
  if (!b.workspace || b.workspace_bytes < need)
    return make_error(Errc::usage, "sampler: workspace of " + std::to_string(b.workspace_bytes) +
                                       " bytes is less than the " + std::to_string(need) +
                                       " needed (sample_workspace_bytes)");
  return Status::Ok();
}

Status sample_cuda_device_v1(const SampleBatch& b, void* stream) {
  SPARK_TRY(sample_check_batch(b));
  if (b.rows <= 0) return Status::Ok();
  SPARK_TRY(cuda_check_launch("sampler (v1)", kThreads, 0));
  auto st = static_cast<cudaStream_t>(stream);
  SPARK_DISPATCH_DTYPE(b.logits_dtype, T, sample_kernel_v1<T><<<b.rows, kThreads, 0, st>>>(b));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status sample_cuda_device(const SampleBatch& b, void* stream) {
  return sample_cuda_device(b, stream, SampleLaunch{});
}

Status sample_cuda_device(const SampleBatch& b, void* stream, const SampleLaunch& how) {
  SPARK_TRY(sample_check_batch(b));
  if (b.rows <= 0) return Status::Ok();
  if (b.rows > 65535) return make_error(Errc::usage, "sampler: more than 65535 rows in one batch");
  SPARK_TRY(cuda_check_launch("sampler", staged::kT, 0));
  // About how.blocks_per_sm blocks per multiprocessor over the batch, each at least
  // kSampleMinChunk tokens.
  const size_t V = static_cast<size_t>(b.vocab), R = static_cast<size_t>(b.rows);
  const size_t want = std::max<size_t>(1, static_cast<size_t>(std::max(1, how.blocks_per_sm)) *
                                              static_cast<size_t>(staged::sm_count()));
  size_t chunk = (V * R + want - 1) / want;
  chunk = std::max<size_t>(kSampleMinChunk,
                           (chunk + kSampleMinChunk - 1) / kSampleMinChunk * kSampleMinChunk);
  staged::Layout L;
  L.base = static_cast<char*>(b.workspace);
  L.rows = b.rows, L.vocab = b.vocab;
  L.chunk = static_cast<int>(std::min(chunk, V));
  L.S = static_cast<int>((V + static_cast<size_t>(L.chunk) - 1) / static_cast<size_t>(L.chunk));
  L.max_chunks = (V + kSampleMinChunk - 1) / kSampleMinChunk;
  const dim3 grid(static_cast<unsigned>(L.S), static_cast<unsigned>(b.rows));
  auto st = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(staged::kT);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = how.pdl ? 1 : 0;
  SPARK_DISPATCH_DTYPE(b.logits_dtype, T, {
    staged::k_scan<T><<<grid, staged::kT, 0, st>>>(b, L);
    SPARK_CUDA_TRY(cudaGetLastError());
    SPARK_CUDA_TRY(cudaLaunchKernelEx(&cfg, staged::k_hist<T>, b, L));
    SPARK_CUDA_TRY(cudaLaunchKernelEx(&cfg, staged::k_draw<T>, b, L));
  });
  return Status::Ok();
}

Status sample_state_reset_cuda_device(uint8_t* seen_row, int32_t* counts_row, int vocab,
                                      const int32_t* prompt, size_t n, void* stream) {
  if (vocab <= 0) return make_error(Errc::usage, "sample_state_reset: vocab must be > 0");
  if (n > 0 && !prompt) return make_error(Errc::usage, "sample_state_reset: null prompt");
  auto st = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(std::min(1024, (vocab + 255) / 256));
  state_reset_kernel<<<blocks, 256, 0, st>>>(seen_row, counts_row, vocab);
  SPARK_CUDA_TRY(cudaGetLastError());
  if (seen_row && n > 0) {
    state_mark_kernel<<<static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1024)), 256, 0,
                        st>>>(seen_row, vocab, prompt, n);
    SPARK_CUDA_TRY(cudaGetLastError());
  }
  return Status::Ok();
}

namespace {
// One block per row: mark the row's tokens seen and count its output tokens (the row was
// zeroed before). Same-value byte stores need no atomics; the counts do.
__global__ void state_build_kernel(uint8_t* seen, int32_t* counts, int vocab, const int32_t* tokens,
                                   const int32_t* start, const int32_t* out_start) {
  const int r = blockIdx.x;
  const int b = start[r], e = start[r + 1], o = b + out_start[r];
  const size_t row = static_cast<size_t>(r) * static_cast<size_t>(vocab);
  for (int i = b + static_cast<int>(threadIdx.x); i < e; i += blockDim.x) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= vocab) continue;
    seen[row + static_cast<size_t>(t)] = 1;
    if (i >= o) atomicAdd(counts + row + static_cast<size_t>(t), 1);
  }
}
}  // namespace

Status sample_state_build_cuda_device(uint8_t* seen, int32_t* counts, int vocab, int rows,
                                      const int32_t* tokens, const int32_t* start,
                                      const int32_t* out_start, void* stream) {
  if (vocab <= 0 || rows < 0)
    return make_error(Errc::usage, "sample_state_build: vocab must be > 0 and rows >= 0");
  if (rows == 0) return Status::Ok();
  if (!seen || !counts || !start || !out_start)
    return make_error(Errc::usage, "sample_state_build: null seen, counts, start or out_start");
  auto st = static_cast<cudaStream_t>(stream);
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(vocab);
  SPARK_CUDA_TRY(cudaMemsetAsync(seen, 0, n, st));
  SPARK_CUDA_TRY(cudaMemsetAsync(counts, 0, n * sizeof(int32_t), st));
  state_build_kernel<<<static_cast<unsigned>(rows), 256, 0, st>>>(seen, counts, vocab, tokens,
                                                                  start, out_start);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status argmax_cuda_device(DType dt, const void* x, size_t rows, size_t dim, int32_t* out,
                          void* stream) {
  if (dim == 0 || dim > 0x7fffffff)
    return make_error(Errc::usage, "argmax: dim must be in [1, 2^31)");
  if (rows == 0) return Status::Ok();
  if (!x || !out) return make_error(Errc::usage, "argmax: null pointer");
  if (rows > 0x7fffffff) return make_error(Errc::usage, "argmax: too many rows");
  auto st = static_cast<cudaStream_t>(stream);
  if (dt == DType::bf16)
    argmax_kernel_b<<<static_cast<unsigned>(rows), 1024, 0, st>>>(static_cast<const dev::bf16*>(x),
                                                                  dim, out);
  else
    argmax_kernel_f<<<static_cast<unsigned>(rows), 1024, 0, st>>>(static_cast<const float*>(x), dim,
                                                                  out);
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
