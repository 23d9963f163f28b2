// Latent attention (DeepSeek-V3) on the GPU against its CPU twin (kernels/mla_ref.cc): the
// kv_a rows normalised, rotated and written to a bf16 paged cache, q_pe rotated in place,
// and the absorbed attention over decode batches (one range and the split ranges of 4k+
// contexts) and prefill chunks over cached prefixes, RoPE interleaved and not, through the
// tensor-core attention (latent 512) and the scalar one (smaller widths, or forced). Skips
// with a printed reason without a GPU.
//
// Bounds. The cache and the inputs are bf16 on both sides (the twin's cache rows are rounded
// as the GPU stores them); the kernel sums in fp32 where the twin sums in double, and rounds
// its output once to bf16. So an output is within one bf16 ulp of the twin's, plus what
// an fp32 sum over the latent and the context and a written cache value rounded the other
// way at a bf16 tie (one ulp of that value, 2^-8 relative) can move it: 2^-8 of the largest
// output of the case. Rotated q_pe and written rows: one bf16 ulp of the twin's value plus
// 2^-20 (fp32 cos/sin and the fp32 RMS).
//
// The tensor-core attention (bf16 cache, latent 512, the cases with scalar off) rounds the
// latent query and the softmax weights to bf16 for its products. A weight's rounding is up to
// 2^-9 of it (rms 2^-9 / sqrt(3), 1.1e-3); the query's moves a score by 6e-4 rms (2e-3 at
// most over 10^4 scores sampled at these values: latent query entries about 0.3, scale
// 0.072), so the weight by as much again. The weights are normalised by their rounded sum,
// so the context stays a convex combination of the rows; an output moves by those relative
// errors times the spread of the rows' own outputs, which over many rows is several times the
// output itself. A host emulation of the kernel's rounding over these shapes (16 to 128 heads,
// 2 to 4100 positions) moved outputs by up to 2.9e-3 of the largest (2^-8.4): too near 2^-8
// for a freshly seeded test, so those cases allow 2^-7 of it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "kernels/mla.h"
#include "support/gpu.h"
#include "support/gpu_values.h"

using namespace spark;
using namespace spark::kernels;
using namespace spark::test::gpu;

namespace {

struct MlaCase {
  int heads, nope, rope, v_dim, latent;
  bool interleave;
  int block_size;
  std::vector<int> ctx, qlen;  // per sequence: context length, new tokens (the last ones)
  int splits = 0;              // 0: mla_splits' choice
  bool scalar = false;         // the scalar attention kernel where the tensor-core one fits
};

void run_case(const MlaCase& c, std::mt19937& rng) {
  CAPTURE(c.heads);
  CAPTURE(c.latent);
  CAPTURE(c.interleave);
  CAPTURE(c.splits);
  CAPTURE(c.scalar);
  MlaShape s;
  s.heads = c.heads, s.nope = c.nope, s.rope = c.rope, s.v_dim = c.v_dim, s.latent = c.latent;
  s.interleave = c.interleave;
  s.rope_factor = 1.1f;
  s.scale = 1.f / std::sqrt(static_cast<float>(c.nope + c.rope));
  const int W = c.latent + c.rope, bs = c.block_size, nseq = static_cast<int>(c.ctx.size());
  const float eps = 1e-6f;
  int width = 0, blocks = 0, max_ctx = 0;
  bool decode = true;
  for (int i = 0; i < nseq; ++i) {
    width = std::max(width, (c.ctx[static_cast<size_t>(i)] + bs - 1) / bs);
    max_ctx = std::max(max_ctx, c.ctx[static_cast<size_t>(i)]);
    decode = decode && c.qlen[static_cast<size_t>(i)] == 1;
  }
  blocks = width * nseq + 3;
  // Block tables: a shuffled pool, so sequences' blocks interleave.
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(nseq * width));
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = perm[i];
  std::vector<int32_t> qs{0}, positions, slots;
  for (int i = 0; i < nseq; ++i) {
    const int L = c.ctx[static_cast<size_t>(i)], n = c.qlen[static_cast<size_t>(i)];
    for (int p = L - n; p < L; ++p) {
      positions.push_back(p);
      slots.push_back(tables[static_cast<size_t>(i * width + p / bs)] * bs + p % bs);
    }
    qs.push_back(static_cast<int32_t>(positions.size()));
  }
  const size_t T = positions.size(), H = static_cast<size_t>(c.heads);
  const size_t qk = static_cast<size_t>(c.nope + c.rope);
  // The cached prefix: random rows (as bf16 holds them) everywhere in the pool.
  std::vector<float> pool =
      as_stored(randoms(rng, static_cast<size_t>(blocks) * static_cast<size_t>(bs) * W, -1.f, 1.f),
                DType::bf16);
  std::vector<float> kv_a = as_stored(randoms(rng, T * W, -2.f, 2.f), DType::bf16);
  std::vector<float> q = as_stored(randoms(rng, T * H * qk, -1.f, 1.f), DType::bf16);
  const float wscale = std::sqrt(3.f / static_cast<float>(c.latent));
  std::vector<float> kv_b =
      as_stored(randoms(rng, H * static_cast<size_t>(c.nope + c.v_dim) * c.latent, -wscale, wscale),
                DType::bf16);
  std::vector<float> norm =
      as_stored(randoms(rng, static_cast<size_t>(c.latent), 0.9f, 1.1f), DType::bf16);
  std::vector<float> inv_freq(static_cast<size_t>(c.rope / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = std::pow(10000.f, -2.f * static_cast<float>(i) / static_cast<float>(c.rope));

  Dev d_pool = to_dev(pool, DType::bf16), d_kva = to_dev(kv_a, DType::bf16),
      d_q = to_dev(q, DType::bf16), d_kvb = to_dev(kv_b, DType::bf16),
      d_norm = to_dev(norm, DType::bf16), d_freq = to_dev(inv_freq, DType::f32),
      d_out = poisoned(T * H * static_cast<size_t>(c.v_dim), DType::bf16);
  auto d_tables = ints_to_dev(tables), d_pos = ints_to_dev(positions), d_slots = ints_to_dev(slots),
       d_qs = ints_to_dev(qs);
  MlaCudaArgs a;
  a.s = s;
  a.eps = eps;
  a.q = d_q.get(), a.kv_a = d_kva.get(), a.kv_norm = d_norm.get(), a.kv_b = d_kvb.get();
  a.inv_freq = static_cast<const float*>(d_freq.get());
  a.out = d_out.get();
  a.kv.k = d_pool.get();
  a.kv.dtype = DType::bf16;
  a.kv.block_size = bs;
  a.kv.n_kv_heads = 1;
  a.kv.head_dim = W;
  a.kv.num_blocks = blocks;
  a.block_tables = d_tables.get();
  a.max_blocks_per_seq = width;
  a.positions = d_pos.get(), a.slots = d_slots.get(), a.query_start = d_qs.get();
  a.n_seqs = nseq;
  a.n_tokens = T;
  a.max_seq_len = max_ctx;
  const auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  a.splits = c.splits > 0 ? c.splits : mla_splits(max_ctx, decode, T, c.heads, lim->sm_count);
  if (max_ctx > 4096 && decode) CHECK(a.splits > 1);  // the split path is what this case covers
  Dev ws = poisoned(mla_workspace_bytes(T, s, a.splits) / 4, DType::f32);
  a.workspace = ws.get();
  a.workspace_bytes = mla_workspace_bytes(T, s, a.splits);
  a.scalar_attention = c.scalar;
  const Status st = mla_cuda_device(a, nullptr);
  REQUIRE_MESSAGE(st.ok(), st.error().message);
  REQUIRE(cuda_synchronize().ok());

  // The twin: rows written (then rounded as the bf16 cache stores them), then attention.
  PagedKVLayer kv;
  kv.k = pool.data();
  kv.block_size = bs;
  kv.n_kv_heads = 1;
  kv.head_dim = W;
  std::vector<float> ref_out(T * H * static_cast<size_t>(c.v_dim));
  for (int i = 0; i < nseq; ++i) {
    const size_t t0 = static_cast<size_t>(qs[static_cast<size_t>(i)]),
                 n = static_cast<size_t>(qs[static_cast<size_t>(i) + 1]) - t0;
    mla_kv_write_ref(kv, tables.data() + i * width, positions.data() + t0, n, kv_a.data() + t0 * W,
                     norm.data(), eps, inv_freq.data(), s);
  }
  for (size_t t = 0; t < T; ++t)
    for (int j = 0; j < W; ++j) {
      float& v = pool[static_cast<size_t>(slots[t]) * W + static_cast<size_t>(j)];
      v = round_to(DType::bf16, v);
    }
  for (int i = 0; i < nseq; ++i) {
    const size_t t0 = static_cast<size_t>(qs[static_cast<size_t>(i)]),
                 n = static_cast<size_t>(qs[static_cast<size_t>(i) + 1]) - t0;
    mla_attention_ref(kv, tables.data() + i * width, positions.data() + t0, n,
                      q.data() + t0 * H * qk, kv_b.data(), inv_freq.data(),
                      ref_out.data() + t0 * H * static_cast<size_t>(c.v_dim), s);
  }
  double max_err = 0;
  const auto near = [](const std::vector<float>& ref) {
    return [&ref](size_t i) { return bf16_ulp(ref[i]) + 0x1p-20; };
  };
  // q_pe rotated in place (q_nope untouched), kv_a normalised and rotated in place, and the
  // pool: every written row and every cached one as it was.
  const auto got_q = from_dev(d_q);
  CHECK(outside(got_q, q, near(q), &max_err) == 0);
  const auto got_kva = from_dev(d_kva);
  CHECK(outside(got_kva, kv_a, near(kv_a), &max_err) == 0);
  const auto got_pool = from_dev(d_pool);
  CHECK(outside(got_pool, pool, near(pool), &max_err) == 0);
  const auto got = from_dev(d_out);
  double top = 0;
  for (float v : ref_out) top = std::max(top, std::fabs(static_cast<double>(v)));
  // The attention mla_cuda_device runs on the tensor cores (the bound above).
  const bool tensor_cores = !c.scalar && c.latent == 512 && (c.latent + c.rope) % 16 == 0;
  const double rel = tensor_cores ? 0x1p-7 : 0x1p-8;
  const size_t bad = outside(
      got, ref_out, [&](size_t i) { return bf16_ulp(ref_out[i]) + top * rel; }, &max_err);
  CAPTURE(max_err);
  CAPTURE(top);
  CHECK(bad == 0);
  CHECK(top > 0);
}

}  // namespace

TEST_CASE("gpu mla: decode of one and several sequences, short contexts, interleave on/off") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("mla decode"));
  run_case({4, 16, 8, 16, 32, true, 16, {1}, {1}}, rng);
  run_case({4, 16, 8, 16, 32, false, 16, {1}, {1}}, rng);
  run_case({5, 16, 8, 24, 32, false, 16, {5, 37, 100}, {1, 1, 1}}, rng);
  run_case({16,
            128,
            64,
            128,
            512,
            true,
            16,
            {300, 17, 511, 64, 2, 129, 250, 90},
            {1, 1, 1, 1, 1, 1, 1, 1}},
           rng);
  // The same batch through the scalar kernel (latent 512 takes the tensor cores otherwise).
  run_case({16,
            128,
            64,
            128,
            512,
            true,
            16,
            {300, 17, 511, 64, 2, 129, 250, 90},
            {1, 1, 1, 1, 1, 1, 1, 1},
            0,
            true},
           rng);
}

TEST_CASE("gpu mla: decode over 4k+ contexts takes the split ranges and their combine") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("mla split"));
  run_case({8, 128, 64, 128, 512, true, 16, {4100, 700}, {1, 1}}, rng);
  run_case({8, 128, 64, 128, 512, true, 16, {4100, 700}, {1, 1}, 0, true}, rng);
  run_case({6, 32, 16, 32, 64, false, 32, {5000, 3, 4097}, {1, 1, 1}}, rng);
  // Over 32 ranges the combine is its own launch, and a context shorter than the ranges leaves
  // the last ones empty (partials never written, in a poisoned workspace): the tensor cores'
  // attention at 256 ranges over contexts of 5000, 3 and 300; the scalar one at 40 and 64;
  // a rope of 6 (latent queries of 38 floats, the partials after them rounded to 16 bytes).
  run_case({16, 128, 64, 128, 512, true, 16, {5000, 3, 300}, {1, 1, 1}, 256}, rng);
  run_case({8, 128, 64, 128, 512, true, 16, {4100, 700}, {1, 1}, 40, true}, rng);
  run_case({6, 32, 16, 32, 64, false, 32, {5000, 3, 4097}, {1, 1, 1}, 64}, rng);
  run_case({3, 16, 6, 16, 32, true, 16, {4500, 131}, {1, 1}, 48}, rng);
  // Four decoding tokens (the products a group of tokens per block) over 40 ranges.
  run_case({16, 128, 64, 128, 512, true, 16, {5000, 40, 2100, 700}, {1, 1, 1, 1}, 40}, rng);
}

TEST_CASE("gpu mla: prefill chunks over cached prefixes, causal per row") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("mla prefill"));
  run_case({5, 128, 64, 128, 512, true, 16, {300}, {45}}, rng);
  // Grids large enough for the tensor-core kernel's groups of 32 and 64 heads (on a GPU with
  // the shared memory for them), the last group part empty: 24 heads, 40 heads.
  run_case({24, 128, 64, 128, 512, false, 16, {120}, {100}}, rng);
  run_case({40, 128, 64, 128, 512, true, 32, {150, 60}, {100, 60}}, rng);
  run_case({3, 16, 8, 16, 32, false, 16, {20, 70}, {20, 9}}, rng);
  // Ranges forced on a prefill: rows whose prefix ends before a range leave it empty.
  run_case({3, 16, 8, 16, 32, true, 16, {20, 70}, {20, 9}, 3}, rng);
}

TEST_CASE(
    "mla splits and workspace: one range for prefill; decode ranges that fill the "
    "multiprocessors, one per 32 positions at most, fewer for a batch") {
  CHECK(mla_splits(100000, false, 1, 128, 132) == 1);
  CHECK(mla_splits(1, true, 1, 128, 132) == 1);
  CHECK(mla_splits(32, true, 1, 16, 132) == 1);
  CHECK(mla_splits(33, true, 1, 16, 132) == 2);
  CHECK(mla_splits(129, true, 1, 16, 132) == 5);
  CHECK(mla_splits(1000, true, 1, 16, 132) == 32);
  CHECK(mla_splits(4096, true, 1, 128, 132) == 66);
  // Batch 1 of 128 heads: two blocks of 64 heads a range, 132 blocks on 132 SMs.
  CHECK(mla_splits(1 << 20, true, 1, 128, 132) == 66);
  // 16 heads: a block of two warps a range, two a multiprocessor (264), at most 256 ranges.
  CHECK(mla_splits(1 << 20, true, 1, 16, 132) == 256);
  CHECK(mla_splits(1 << 20, true, 1, 32, 132) == 132);
  CHECK(mla_splits(1 << 20, true, 1, 200, 132) == 33);
  CHECK(mla_splits(1 << 20, true, 1, 128, 48) == 24);
  CHECK(mla_splits(1 << 20, true, 8, 128, 132) == 9);
  CHECK(mla_splits(1 << 20, true, 32, 128, 132) == 3);
  CHECK(mla_splits(1 << 20, true, 512, 128, 132) == 1);
  CHECK(mla_splits(1000, true, 2, 16, 132) == 32);
  CHECK(mla_splits(1000, true, 8, 16, 132) == 32);
  CHECK(mla_splits(1000, true, 16, 16, 132) == 17);
  MlaShape s;
  s.heads = 16, s.latent = 512, s.rope = 64;
  // Per token and head: the latent query and q_pe (576 floats), per range max, sum, two of
  // padding and the latent context (516 floats), and the latent query again in bf16.
  CHECK(mla_workspace_bytes(3, s, 1) == 3 * 16 * ((576 + 516) * sizeof(float) + 576 * 2));
  CHECK(mla_workspace_bytes(3, s, 4) == 3 * 16 * ((576 + 4 * 516) * sizeof(float) + 576 * 2));
  CHECK(mla_workspace_bytes(0, s, 4) == 0);
  {
    // The latent queries rounded up to whole 16 bytes: 3 heads of 38 floats take 116.
    MlaShape o;
    o.heads = 3, o.latent = 32, o.rope = 6;
    CHECK(mla_workspace_bytes(1, o, 2) == (116 + 3 * 2 * 36) * sizeof(float) + 3 * 38 * 2);
  }
  // The reserve covers every decode step up to its tokens, each with its own ranges.
  const size_t r = mla_workspace_reserve(32, s, 1 << 20, true, 132);
  size_t most = 0;
  for (size_t n = 1; n <= 32; ++n) {
    const size_t b = mla_workspace_bytes(n, s, mla_splits(1 << 20, true, n, 16, 132));
    CHECK(r >= b);
    most = std::max(most, b);
  }
  CHECK(r == most);
  CHECK(r > mla_workspace_bytes(1, s, 256));
  CHECK(mla_workspace_reserve(100, s, 1 << 20, false, 132) == mla_workspace_bytes(100, s, 1));
}
