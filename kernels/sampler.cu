// The sampler on the GPU: one block of 1024 threads per row, following the definition in
// sampler.h step by step with the per-element arithmetic of sampler_core.h (this file is
// compiled with -fmad=false, so float expressions round as the CPU twin's do):
//   penalised, tempered logits -> workspace; top-k and top-p floors by 4-pass radix
//   selection over order-preserving 32-bit keys (counts for top-k, probability mass in
//   double for top-p); the draw as a block-wide argmax of the Gumbel-perturbed scores of
//   the kept tokens; logprobs by log-sum-exp and up to 20 rounds of a block argmax that
//   excludes what earlier rounds took.
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

// sample_keep's result, with its double exp only where z is within 1e-5 of the min-p
// threshold (elsewhere the float comparison cannot differ from it).
__device__ __forceinline__ bool keep_fast(float z, float zmax, float k_floor, float p_floor,
                                          float min_p, float log_min_p) {
  if (!(z >= k_floor) || !(z >= p_floor)) return false;
  if (min_p <= 0.0f) return true;
  const float d = z - zmax;  // rounded by at most |d| * 2^-24
  const float margin = 1e-5f + 1e-6f * fabsf(d);
  if (d >= log_min_p + margin) return true;
  if (d <= log_min_p - margin) return false;
  return sample_mass(z, zmax) >= static_cast<double>(min_p);
}

// A float evaluation of sample_score within 2e-5 of it: -log(u) from u or from 1 - u
// (exact in double) so it keeps its relative precision, then float logs (1 ulp each).
__device__ __forceinline__ double score_approx(float z, const SampleParams& p, uint32_t i) {
  const double u = philox_uniform(p.seed, p.request, p.step, i);
  const float t = u < 0.5 ? -logf(static_cast<float>(u)) : -log1pf(static_cast<float>(-(1.0 - u)));
  return static_cast<double>(z) + static_cast<double>(-logf(t));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel(SampleBatch b) {
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
      if (better(v, i, gbest, gi)) gbest = v, gi = i;
    } else {
      v = sample_temper(v, p.temperature);
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

}  // namespace

Status sample_cuda_device(const SampleBatch& b, void* stream) {
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
  SPARK_TRY(cuda_check_launch("sampler", kThreads, 0));
  auto st = static_cast<cudaStream_t>(stream);
  SPARK_DISPATCH_DTYPE(b.logits_dtype, T, sample_kernel<T><<<b.rows, kThreads, 0, st>>>(b));
  SPARK_CUDA_TRY(cudaGetLastError());
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
