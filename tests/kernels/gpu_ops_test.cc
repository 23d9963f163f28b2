// The engine's CUDA kernels against their CPU twins, over many shapes, on fresh random
// inputs (SPARK_TEST_SEED replays one), with every output poisoned first so an element
// the kernel did not write fails the bound. Skips with a printed reason without a GPU.
//
// bf16 bounds: the kernels compute in fp32 and round once to bf16; the twins compute in
// double (or fp32 for the same roundings) and round once too. Two roundings of values that
// differ by far less than a bf16 ulp land at most one ulp apart, so the bound is one ulp
// of the reference plus what the kernel's own fp32 or bf16 intermediates can add (stated
// per test).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/bias.h"
#include "kernels/cuda_runtime.h"
#include "kernels/embedding.h"
#include "kernels/launch.h"
#include "kernels/matmul.h"
#include "kernels/paged_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/sampler_core.h"
#include "kernels/swiglu.h"
#include "support/gpu.h"
#include "support/gpu_qkv_rope.h"
#include "support/gpu_values.h"
#include "support/sampler_cases.h"

using namespace spark;
using namespace spark::kernels;
using test::DeviceBuf;
using namespace spark::test::gpu;

namespace {

const DType kTypes[] = {DType::f32, DType::bf16};
// KV cache types: the above and e4m3 (KV_DTYPE=fp8).
const DType kKvTypes[] = {DType::f32, DType::bf16, DType::e4m3};

// A product's outputs against the twin within bound(i) (every element; of the largest
// outputs, where checking each costs seconds, every 97th), and none left unwritten.
template <typename Bound>
void check_products(const std::vector<float>& got, const std::vector<float>& ref, size_t elems,
                    Bound bound) {
  size_t bad = 0;
  const size_t stride = elems > 2000000 ? 97 : 1;
  for (size_t idx = 0; idx < ref.size(); idx += stride) {
    const double e = std::fabs(static_cast<double>(got[idx]) - ref[idx]);
    if (!(e <= bound(idx))) ++bad;
  }
  size_t unwritten = 0;
  for (float v : got) unwritten += std::isnan(v) ? 1 : 0;
  CHECK(bad == 0);
  CHECK(unwritten == 0);
}

// The 32k-token cases take long under compute-sanitizer: SPARK_TEST_NO_LARGE=1 leaves them
// out there (and says so).
bool large_cases() {
  const char* e = std::getenv("SPARK_TEST_NO_LARGE");
  if (e && std::string(e) == "1") {
    MESSAGE("SPARK_TEST_NO_LARGE=1: the 32k-token cases are left out");
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("gpu embedding: rows copied exactly, ids outside the vocabulary give zeros") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("embedding"));
  struct Shape {
    size_t vocab, dim, n;
  } shapes[] = {{1, 1, 1},         {10, 7, 5},    {1000, 64, 33},
                {32000, 4096, 17}, {50, 24, 300}, {7, 4097, 3}};
  for (auto t : kTypes)
    for (auto sh : shapes) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(sh.vocab);
      CAPTURE(sh.dim);
      auto table = as_stored(randoms(rng, sh.vocab * sh.dim, -3, 3), t);
      std::vector<int32_t> ids(sh.n);
      std::uniform_int_distribution<int32_t> id(-2, static_cast<int32_t>(sh.vocab) + 1);
      for (auto& i : ids) i = id(rng);
      std::vector<float> ref(sh.n * sh.dim);
      embedding_ref(table.data(), sh.vocab, sh.dim, ids.data(), sh.n, ref.data());
      auto dt = to_dev(table, t);
      auto di = ints_to_dev(ids);
      auto out = poisoned(sh.n * sh.dim, t);
      auto s =
          embedding_cuda_device(t, dt.get(), sh.vocab, sh.dim, di.get(), sh.n, out.get(), nullptr);
      REQUIRE_MESSAGE(s.ok(), s.message());
      REQUIRE(cuda_synchronize().ok());
      double err = 0;
      CHECK(outside(
                from_dev(out), ref, [](size_t) { return 0.0; }, &err) == 0);
    }
}

TEST_CASE("gpu add_rmsnorm: residual add then RMSNorm, within one ulp of the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("add_rmsnorm"));
  // bf16: hidden + delta is the same float sum rounded the same way on both sides (exact
  // match required); the normalised output differs by the fp32-vs-double rms only, far
  // below half an ulp, so one ulp bounds it. f32: a few fp32 ulps of |y| < 24.
  struct Shape {
    size_t rows, dim;
  } shapes[] = {{1, 1}, {3, 7}, {5, 100}, {17, 1000}, {64, 4096}, {2, 8195}, {3, 20000}, {333, 64}};
  for (auto t : kTypes)
    for (bool with_delta : {true, false})
      for (auto sh : shapes) {
        CAPTURE(std::string(dtype_name(t)));
        CAPTURE(with_delta);
        CAPTURE(sh.rows);
        CAPTURE(sh.dim);
        auto h = as_stored(randoms(rng, sh.rows * sh.dim, -4, 4), t);
        auto d = as_stored(randoms(rng, sh.rows * sh.dim, -2, 2), t);
        auto w = as_stored(randoms(rng, sh.dim, 0.25f, 2.f), t);
        auto href = h;
        std::vector<float> yref(h.size());
        add_rmsnorm_ref(href.data(), with_delta ? d.data() : nullptr, w.data(), yref.data(),
                        sh.rows, sh.dim, 1e-5f, t);
        auto dh = to_dev(h, t), dd = to_dev(d, t), dw = to_dev(w, t);
        auto dy = poisoned(h.size(), t);
        auto s = add_rmsnorm_cuda_device(t, dh.get(), with_delta ? dd.get() : nullptr, dw.get(),
                                         dy.get(), sh.rows, sh.dim, 1e-5f, nullptr);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(cuda_synchronize().ok());
        double err = 0;
        CHECK(outside(
                  from_dev(dh), href, [](size_t) { return 0.0; }, &err) == 0);
        auto bound = [&](size_t i) {
          return t == DType::bf16 ? bf16_ulp(yref[i]) : 4e-6 * (1 + std::fabs(yref[i]));
        };
        CHECK(outside(from_dev(dy), yref, bound, &err) == 0);
        MESSAGE("add_rmsnorm " << std::string(dtype_name(t)) << " " << sh.rows << "x" << sh.dim
                               << " max err " << err);
      }
}

TEST_CASE("gpu rope: default, linear and llama3 scaling, fused per-head q/k norm, strided rows") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("rope"));
  // fp32 angle, sincosf within 2 ulp and two fp32 products: |err| <= 1e-6 * (|x0| + |x1|)
  // for angles up to 32k rad (positions up to 32k), so one bf16 ulp plus that bounds bf16.
  hf::RopeScaling lin, l3;
  lin.type = "linear", lin.factor = 4;
  l3.type = "llama3", l3.factor = 8, l3.original_max_position = 8192;
  struct Case {
    int nh, nkv, hd;
    size_t T;
    bool norm;
    hf::RopeScaling sc;
  } cases[] = {{4, 2, 16, 5, false, {}},  {32, 8, 128, 7, false, l3}, {28, 4, 128, 3, true, {}},
               {2, 1, 24, 9, true, lin},  {8, 8, 64, 33, false, {}},  {1, 1, 256, 2, true, l3},
               {64, 8, 128, 1, true, {}}, {3, 1, 512, 2, false, {}}};
  for (auto t : kTypes)
    for (const auto& c : cases) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(c.hd);
      CAPTURE(c.nh);
      CAPTURE(c.norm);
      const size_t stride = static_cast<size_t>((c.nh + 2 * c.nkv) * c.hd);  // fused QKV row
      auto qkv = as_stored(randoms(rng, c.T * stride, -2, 2), t);
      auto qn = as_stored(randoms(rng, static_cast<size_t>(c.hd), 0.5f, 1.5f), t);
      auto kn = as_stored(randoms(rng, static_cast<size_t>(c.hd), 0.5f, 1.5f), t);
      std::vector<int32_t> pos(c.T);
      std::uniform_int_distribution<int32_t> pd(0, 32767);
      for (auto& p : pos) p = pd(rng);
      auto inv = rope_inv_freq(c.hd, 500000.0, c.sc);
      auto ref = qkv;
      RopeArgs a;
      a.dtype = t, a.q = ref.data(), a.q_stride = stride, a.n_heads = c.nh;
      a.k = ref.data() + static_cast<size_t>(c.nh * c.hd), a.k_stride = stride,
      a.n_kv_heads = c.nkv;
      a.head_dim = c.hd, a.n_tokens = c.T, a.positions = pos.data(), a.inv_freq = inv.data();
      a.q_norm = c.norm ? qn.data() : nullptr, a.k_norm = c.norm ? kn.data() : nullptr;
      rope_ref(a);
      auto d = to_dev(qkv, t), dqn = to_dev(qn, t), dkn = to_dev(kn, t);
      auto dpos = ints_to_dev(pos);
      auto dinv = DeviceBuf<float>::from(inv);
      RopeArgs g = a;
      g.q = d.get();
      g.k = static_cast<char*>(d.get()) + static_cast<size_t>(c.nh * c.hd) * dtype_size(t);
      g.positions = dpos.get(), g.inv_freq = dinv.get();
      g.q_norm = c.norm ? dqn.get() : nullptr, g.k_norm = c.norm ? dkn.get() : nullptr;
      auto s = rope_cuda_device(g, nullptr);
      REQUIRE_MESSAGE(s.ok(), s.message());
      REQUIRE(cuda_synchronize().ok());
      auto got = from_dev(d);
      double err = 0;
      const double scale = c.norm ? 4.0 : 3.0;  // |x| bound after the norm (weights <= 1.5)
      auto bound = [&](size_t i) {
        return (t == DType::bf16 ? bf16_ulp(ref[i]) : 0.0) + 2e-6 * scale +
               1e-6 * std::fabs(ref[i]);
      };
      CHECK(outside(got, ref, bound, &err) == 0);  // v (untouched) must match too
      MESSAGE("rope " << std::string(dtype_name(t)) << " hd " << c.hd << " max err " << err);
    }
}

TEST_CASE("gpu rope with the KV write: bit for bit what rope and then the KV write give") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("rope_kv"));
  struct Case {
    int nh, nkv, hd;
    size_t T;
    bool norm;
  } cases[] = {{32, 8, 128, 1, false}, {28, 4, 128, 3, true}, {4, 2, 16, 5, false},
               {8, 8, 64, 33, true},   {2, 1, 256, 2, false}, {3, 1, 512, 2, true}};
  for (auto t : kTypes)
    for (auto ct : kKvTypes)
      for (const auto& c : cases) {
        CAPTURE(std::string(dtype_name(t)));
        CAPTURE(std::string(dtype_name(ct)));
        CAPTURE(c.hd);
        CAPTURE(c.T);
        const size_t stride = static_cast<size_t>((c.nh + 2 * c.nkv) * c.hd);
        const size_t row = static_cast<size_t>(c.nkv * c.hd);
        const int slots_n = 64;
        auto qkv = as_stored(randoms(rng, c.T * stride, -2, 2), t);
        auto qn = as_stored(randoms(rng, static_cast<size_t>(c.hd), 0.5f, 1.5f), t);
        auto kn = as_stored(randoms(rng, static_cast<size_t>(c.hd), 0.5f, 1.5f), t);
        std::vector<int32_t> pos(c.T), slot(c.T);
        std::uniform_int_distribution<int32_t> pd(0, 32767), sd(0, slots_n - 1);
        for (auto& p : pos) p = pd(rng);
        std::vector<int32_t> perm(slots_n);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (size_t i = 0; i < c.T; ++i) slot[i] = perm[i % slots_n];
        if (c.T > 2) slot[1] = -1, slot[2] = slots_n;  // skipped: outside the pool
        auto inv = rope_inv_freq(c.hd, 500000.0, {});
        auto dqn = to_dev(qn, t), dkn = to_dev(kn, t);
        auto dpos = ints_to_dev(pos), dslot = ints_to_dev(slot);
        auto dinv = DeviceBuf<float>::from(inv);
        auto a_qkv = to_dev(qkv, t), b_qkv = to_dev(qkv, t);
        auto a_k = poisoned(slots_n * row, ct), a_v = poisoned(slots_n * row, ct);
        auto b_k = poisoned(slots_n * row, ct), b_v = poisoned(slots_n * row, ct);
        const size_t es = dtype_size(t);
        auto args = [&](Dev& d) {
          RopeArgs g;
          g.dtype = t, g.q = d.get(), g.q_stride = stride, g.n_heads = c.nh;
          g.k = static_cast<char*>(d.get()) + static_cast<size_t>(c.nh * c.hd) * es;
          g.k_stride = stride, g.n_kv_heads = c.nkv, g.head_dim = c.hd, g.n_tokens = c.T;
          g.positions = dpos.get(), g.inv_freq = dinv.get();
          g.q_norm = c.norm ? dqn.get() : nullptr, g.k_norm = c.norm ? dkn.get() : nullptr;
          return g;
        };
        // A: rope, then the KV write of the rotated k and of v.
        RopeArgs ga = args(a_qkv);
        auto s = rope_cuda_device(ga, nullptr);
        REQUIRE_MESSAGE(s.ok(), s.message());
        PagedKVDevice kv;
        kv.k = a_k.get(), kv.v = a_v.get(), kv.dtype = ct, kv.block_size = 16;
        kv.n_kv_heads = c.nkv, kv.head_dim = c.hd, kv.num_blocks = slots_n / 16;
        s = paged_kv_write_cuda_device(kv, dslot.get(), c.T, t, ga.k, stride,
                                       static_cast<char*>(ga.k) + row * es, stride, nullptr);
        REQUIRE_MESSAGE(s.ok(), s.message());
        // B: one launch.
        RopeArgs gb = args(b_qkv);
        gb.k_cache = b_k.get(), gb.v_cache = b_v.get(), gb.cache_dtype = ct;
        gb.cache_slots = slots_n, gb.slots = dslot.get();
        gb.v = static_cast<char*>(gb.k) + row * es, gb.v_stride = stride;
        s = rope_cuda_device(gb, nullptr);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(cuda_synchronize().ok());
        auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
          return x.size() == y.size() &&
                 std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
        };
        CHECK(same(from_dev(a_qkv), from_dev(b_qkv)));
        CHECK(same(from_dev(a_k), from_dev(b_k)));
        CHECK(same(from_dev(a_v), from_dev(b_v)));
        // The written slots hold values (not the poison), the skipped ones none.
        auto bk = from_dev(b_k);
        size_t written = 0;
        for (size_t i = 0; i < bk.size(); ++i) written += std::isnan(bk[i]) ? 0 : 1;
        size_t want = 0;
        for (int32_t sl : slot) want += sl >= 0 && sl < slots_n ? row : 0;
        CHECK(written == want);
      }
}

TEST_CASE("gpu rmsnorm_fold_weight: a norm's weight folded into a product's, bit for bit") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("fold weight"));
  for (auto shape : {std::pair<size_t, size_t>{1, 8}, {3, 4096}, {4099, 64}}) {
    const size_t rows = shape.first, cols = shape.second;
    CAPTURE(rows);
    CAPTURE(cols);
    auto w = as_stored(randoms(rng, rows * cols, -2, 2), DType::bf16);
    auto g = as_stored(randoms(rng, cols, 0.2f, 3.0f), DType::bf16);
    std::vector<bf16_bits> wb(w.size()), gb(g.size());
    for (size_t i = 0; i < w.size(); ++i) wb[i] = float_to_bf16(w[i]);
    for (size_t i = 0; i < g.size(); ++i) gb[i] = float_to_bf16(g[i]);
    rmsnorm_fold_weight_ref(wb.data(), rows, cols, gb.data());
    auto dw = to_dev(w, DType::bf16), dg = to_dev(g, DType::bf16);
    REQUIRE(rmsnorm_fold_weight_cuda_device(static_cast<bf16_bits*>(dw.get()), rows, cols,
                                            static_cast<const bf16_bits*>(dg.get()), nullptr)
                .ok());
    REQUIRE(cuda_synchronize().ok());
    const auto got = from_dev(dw);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i] != bf16_to_float(wb[i]);
    CHECK(differ == 0);
    // The fold is the product, rounded once: row r, column c.
    CHECK(bf16_to_float(wb[cols + 1 < wb.size() ? cols + 1 : 0]) ==
          bf16_to_float(float_to_bf16(w[cols + 1 < w.size() ? cols + 1 : 0] *
                                      g[cols + 1 < w.size() ? 1 : 0])));
  }
}

TEST_CASE("gpu head_rmsnorm and bias_add match their twins") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("head_rmsnorm"));
  for (auto t : kTypes)
    for (int hd : {16, 24, 128, 256})
      for (size_t T : {size_t{1}, size_t{13}}) {
        CAPTURE(std::string(dtype_name(t)));
        CAPTURE(hd);
        const int nh = 5;
        const size_t stride = static_cast<size_t>(nh * hd + 8);
        auto x = as_stored(randoms(rng, T * stride, -3, 3), t);
        auto w = as_stored(randoms(rng, static_cast<size_t>(hd), 0.5f, 1.5f), t);
        auto ref = x;
        head_rmsnorm_ref(ref.data(), stride, T, nh, hd, w.data(), 1e-6f, t);
        auto dx = to_dev(x, t), dw = to_dev(w, t);
        auto s = head_rmsnorm_cuda_device(t, dx.get(), stride, T, nh, hd, dw.get(), 1e-6f, nullptr);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(cuda_synchronize().ok());
        double err = 0;
        CHECK(outside(
                  from_dev(dx), ref,
                  [&](size_t i) {
                    return (t == DType::bf16 ? bf16_ulp(ref[i]) : 0.0) +
                           4e-6 * (1 + std::fabs(ref[i]));
                  },
                  &err) == 0);
      }
  for (auto t : kTypes)
    for (size_t dim : {size_t{1}, size_t{3}, size_t{4096}, size_t{5121}}) {
      const size_t rows = 7;
      auto x = as_stored(randoms(rng, rows * dim, -3, 3), t);
      auto b = as_stored(randoms(rng, dim, -1, 1), t);
      auto ref = x;
      bias_add_ref(ref.data(), b.data(), rows, dim, t);
      auto dx = to_dev(x, t), db = to_dev(b, t);
      REQUIRE(bias_add_cuda_device(t, dx.get(), db.get(), rows, dim, nullptr).ok());
      REQUIRE(cuda_synchronize().ok());
      double err = 0;
      CHECK(outside(
                from_dev(dx), ref, [](size_t) { return 0.0; }, &err) == 0);  // one rounding each
    }
}

namespace {

// A paged cache with random block tables for several sequences, filled on the device by
// paged_kv_write_cuda_device and on the host by the twin.
struct PagedSetup {
  int bs, nkv, hd, num_blocks, max_blocks;
  DType kv_t;
  std::vector<int32_t> ctx;         // per sequence
  std::vector<int32_t> tables;      // [seqs][max_blocks]
  std::vector<float> kpool, vpool;  // host twin pools (values as stored)
  Dev dk, dv;
  DeviceBuf<int32_t> dtables, dlens;
  PagedKVDevice dev() const {
    PagedKVDevice p;
    p.k = dk.get(), p.v = dv.get(), p.dtype = kv_t, p.block_size = bs, p.n_kv_heads = nkv;
    p.head_dim = hd, p.num_blocks = num_blocks;
    return p;
  }
};

PagedSetup make_paged(std::mt19937& rng, DType kv_t, int bs, int nkv, int hd,
                      std::vector<int32_t> ctx, DType src_t) {
  PagedSetup P;
  P.bs = bs, P.nkv = nkv, P.hd = hd, P.kv_t = kv_t, P.ctx = ctx;
  int total = 0, maxb = 1;
  for (int c : ctx) total += (c + bs - 1) / bs, maxb = std::max(maxb, (c + bs - 1) / bs);
  P.num_blocks = total + 3;
  P.max_blocks = maxb;
  std::vector<int32_t> perm(static_cast<size_t>(P.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  P.tables.assign(ctx.size() * static_cast<size_t>(maxb), -1);
  size_t next = 0;
  std::vector<int32_t> slots;
  for (size_t s = 0; s < ctx.size(); ++s)
    for (int p = 0; p < ctx[s]; ++p) {
      if (p % bs == 0)
        P.tables[s * static_cast<size_t>(maxb) + static_cast<size_t>(p / bs)] = perm[next++];
      slots.push_back(P.tables[s * static_cast<size_t>(maxb) + static_cast<size_t>(p / bs)] * bs +
                      p % bs);
    }
  const size_t row = static_cast<size_t>(nkv * hd);
  const size_t pool = static_cast<size_t>(P.num_blocks) * static_cast<size_t>(bs) * row;
  // Source rows as the model would produce them (src_t), strided inside a wider row.
  const size_t stride = row + 8;
  auto k = as_stored(randoms(rng, slots.size() * stride, -2, 2), src_t);
  auto v = as_stored(randoms(rng, slots.size() * stride, -2, 2), src_t);
  P.kpool.assign(pool, 0.f), P.vpool.assign(pool, 0.f);
  PagedKVLayer L{P.kpool.data(), P.vpool.data(), bs, nkv, hd};
  paged_kv_write_slots_ref(L, slots.data(), slots.size(), k.data(), stride, v.data(), stride, kv_t);
  P.dk = poisoned(pool, kv_t), P.dv = poisoned(pool, kv_t);
  auto dkk = to_dev(k, src_t), dvv = to_dev(v, src_t);
  auto dslots = DeviceBuf<int32_t>::from(slots);
  auto s = paged_kv_write_cuda_device(P.dev(), dslots.get(), slots.size(), src_t, dkk.get(), stride,
                                      dvv.get(), stride, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  P.dtables = DeviceBuf<int32_t>::from(P.tables);
  P.dlens = DeviceBuf<int32_t>::from(ctx);
  return P;
}

// Compares the device pools with the twin's where the twin wrote (the rest stays poison).
void check_pools(const PagedSetup& P) {
  auto gk = from_dev(P.dk), gv = from_dev(P.dv);
  const size_t row = static_cast<size_t>(P.nkv * P.hd);
  size_t bad = 0, written = 0;
  for (size_t s = 0; s < P.ctx.size(); ++s)
    for (int p = 0; p < P.ctx[s]; ++p) {
      const size_t slot = static_cast<size_t>(
          P.tables[s * static_cast<size_t>(P.max_blocks) + static_cast<size_t>(p / P.bs)] * P.bs +
          p % P.bs);
      for (size_t i = 0; i < row; ++i, ++written)
        if (!(gk[slot * row + i] == P.kpool[slot * row + i]) ||
            !(gv[slot * row + i] == P.vpool[slot * row + i]))
          ++bad;
    }
  CHECK(written > 0);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE(
    "gpu paged KV write: bf16, f32 and fp8 caches from bf16 and f32 rows, through block tables") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("kv_write"));
  for (auto kv_t : kKvTypes)
    for (auto src_t : kTypes) {
      CAPTURE(std::string(dtype_name(kv_t)));
      CAPTURE(std::string(dtype_name(src_t)));
      auto P = make_paged(rng, kv_t, 16, 2, 24, {1, 17, 40}, src_t);
      check_pools(P);
    }
}

namespace {

// Runs decode or prefill for sequences with contexts `ctx` and query counts `qlen` and
// compares sampled query rows (every row when `all`) with paged_attention_ref.
// Decode runs the split-K kernel (twice: its counters must be back at zero after the
// first launch) or, with `partitioned`, the previous kernel; `ctx_bound` > 0 sizes the launch
// for contexts up to it, as a captured graph does.
void attention_case_run(std::mt19937& rng, bool decode, DType kv_t, DType q_t, int nh, int nkv,
                        int hd, int bs, const std::vector<int32_t>& ctx,
                        const std::vector<int32_t>& qlen, int window, size_t max_checked_rows,
                        bool partitioned, int ctx_bound, int variant,
                        const std::vector<float>& sinks = {}, bool ref_without_sinks = false) {
  CAPTURE(decode);
  CAPTURE(sinks.size());
  CAPTURE(variant);
  CAPTURE(partitioned);
  CAPTURE(ctx_bound);
  CAPTURE(std::string(dtype_name(kv_t)));
  CAPTURE(std::string(dtype_name(q_t)));
  CAPTURE(nh);
  CAPTURE(nkv);
  CAPTURE(hd);
  CAPTURE(window);
  CAPTURE(ctx[0]);
  auto P = make_paged(rng, kv_t, bs, nkv, hd, ctx, DType::bf16);
  std::vector<int32_t> qstart{0};
  for (int q : qlen) qstart.push_back(qstart.back() + q);
  const size_t T = static_cast<size_t>(qstart.back());
  const size_t qrow = static_cast<size_t>(nh * hd), qstride = qrow + 16;
  auto q = as_stored(randoms(rng, T * qstride, -2, 2), q_t);
  auto dq = to_dev(q, q_t);
  auto dout = poisoned(T * qrow, q_t);
  auto dqs = DeviceBuf<int32_t>::from(qstart);
  AttentionBatch b;
  b.dtype = q_t, b.q = dq.get(), b.q_stride = qstride, b.out = dout.get(), b.out_stride = qrow;
  b.n_heads = nh, b.kv = P.dev(), b.block_tables = P.dtables.get(),
  b.max_blocks_per_seq = P.max_blocks;
  b.seq_lens = P.dlens.get(), b.query_start = dqs.get(), b.n_seqs = static_cast<int>(ctx.size());
  b.n_tokens = T, b.max_query_len = *std::max_element(qlen.begin(), qlen.end());
  b.max_seq_len = std::max(ctx_bound, *std::max_element(ctx.begin(), ctx.end())),
  b.scale = 1.f / std::sqrt(static_cast<float>(hd));
  b.window = window;
  DeviceBuf<float> dsinks;
  if (!sinks.empty()) {
    dsinks = DeviceBuf<float>::from(sinks);
    b.sinks = dsinks.get();
  }
  (decode ? b.decode_variant : b.prefill_variant) = variant;
  // A graph's tables are as wide as the bound; past each context they hold -1, which a
  // kernel that reads beyond its context would follow out of the pool.
  DeviceBuf<int32_t> wide;
  if (ctx_bound > 0) {
    const int width = (ctx_bound + bs - 1) / bs;
    std::vector<int32_t> t(ctx.size() * static_cast<size_t>(width), -1);
    for (size_t sq = 0; sq < ctx.size(); ++sq)
      std::copy_n(P.tables.begin() + static_cast<ptrdiff_t>(sq) * P.max_blocks, P.max_blocks,
                  t.begin() + static_cast<ptrdiff_t>(sq) * width);
    wide = DeviceBuf<int32_t>::from(t);
    b.block_tables = wide.get(), b.max_blocks_per_seq = width;
  }
  DeviceMemory ws;
  if (decode) {
    const size_t need =
        partitioned ? attention_decode_partitioned_workspace_bytes(b.n_seqs, nh, hd, b.max_seq_len)
                    : attention_decode_workspace_bytes(b.n_seqs, nh, hd, b.max_seq_len);
    if (need) {
      auto m = DeviceMemory::allocate(need);
      REQUIRE(m.ok());
      ws = std::move(*m);
      // Split-K's counters must start at zero; poison the rest.
      std::vector<uint8_t> init(need, 0xFF);
      if (!partitioned) std::fill(init.begin(), init.end(), 0);
      REQUIRE(ws.copy_from_host(init.data(), need).ok());
      b.workspace = ws.get(), b.workspace_bytes = need;
    }
  }
  auto run = [&] {
    return !decode       ? attention_prefill_cuda_device(b, nullptr)
           : partitioned ? attention_decode_partitioned_cuda_device(b, nullptr)
                         : attention_decode_cuda_device(b, nullptr);
  };
  auto s = run();
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  if (decode && !partitioned) {  // again, on a poisoned output: the counters were reset
    std::vector<uint8_t> ff(dout.n * dtype_size(q_t), 0xFF);
    REQUIRE(dout.mem.copy_from_host(ff.data(), ff.size()).ok());
    s = run();
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
  }
  auto got = from_dev(dout);
  float vmax = 0;
  for (float v : P.vpool) vmax = std::max(vmax, std::fabs(v));
  PagedKVLayer L{P.kpool.data(), P.vpool.data(), bs, nkv, hd};
  size_t bad = 0, checked = 0;
  double max_err = 0;
  for (size_t sq = 0; sq < ctx.size(); ++sq) {
    const int n = qlen[sq];
    // Rows 0, step, 2 step, ... and always the last one (the longest context).
    const int step =
        static_cast<int>(std::max<size_t>(1, static_cast<size_t>(n) / max_checked_rows));
    std::vector<int> rows;
    for (int i = 0; i < n; i += step) rows.push_back(i);
    if (rows.back() != n - 1) rows.push_back(n - 1);
    for (int row : rows) {
      const int32_t pos = ctx[sq] - n + row;
      const size_t tok = static_cast<size_t>(qstart[sq] + row);
      std::vector<float> qf(q.begin() + static_cast<ptrdiff_t>(tok * qstride),
                            q.begin() + static_cast<ptrdiff_t>(tok * qstride + qrow));
      std::vector<float> ref(qrow);
      paged_attention_ref(L, P.tables.data() + sq * static_cast<size_t>(P.max_blocks), &pos, 1, nh,
                          qf.data(), ref.data(), b.scale, window,
                          sinks.empty() || ref_without_sinks ? nullptr : sinks.data());
      for (size_t e = 0; e < qrow; ++e) {
        // Decode: fp32 throughout, one rounding at the end. Prefill and decode on the tensor
        // cores (variant 4): P is rounded to bf16
        // for the tensor cores (relative 2^-9 per weight, so 2^-8 * max|v| after the
        // normalisation), and an f32 cache or f32 q is rounded to bf16 as well (another
        // 2^-8 relative on scores of at most hd * 4 * scale, i.e. e^(2^-8 * 2 * sqrt(hd))
        // on the weights).
        double bound = (q_t == DType::bf16 ? bf16_ulp(ref[e]) : 0.0) + 2e-5 * vmax;
        if (!decode || variant >= 4) {  // prefill, and decode on the tensor cores
          bound += 0x1p-8 * vmax;
          if (kv_t == DType::f32 || q_t == DType::f32)
            bound += (std::exp(0x1p-8 * 2 * 4 * std::sqrt(static_cast<double>(hd))) - 1) * 2 * vmax;
        }
        const double err = std::fabs(static_cast<double>(got[tok * qrow + e]) - ref[e]);
        if (!(err <= bound)) ++bad;
        max_err = std::isnan(err) ? INFINITY : std::max(max_err, err);
        ++checked;
      }
    }
  }
  // Rows not checked against the reference must still have been written.
  size_t unwritten = 0;
  for (float v : got) unwritten += std::isnan(v) ? 1 : 0;
  MESSAGE(std::string(decode ? "decode" : "prefill")
          << " variant " << variant << " kv " << std::string(dtype_name(kv_t)) << " hd " << hd
          << " heads " << nh << "/" << nkv << " ctx " << ctx[0] << " max err " << max_err);
  CHECK(checked > 0);
  if (ref_without_sinks)  // the sinks change the result beyond the tolerance: not dropped
    CHECK(bad > checked / 2);
  else
    CHECK(bad == 0);
  CHECK(unwritten == 0);
}

// Decode at variant 0 runs twice: as the engine would (the short-context kernel where the
// bound allows it) and with split-K forced (variant 2), so both kernels see every shape.
void attention_case(std::mt19937& rng, bool decode, DType kv_t, DType q_t, int nh, int nkv, int hd,
                    int bs, const std::vector<int32_t>& ctx, const std::vector<int32_t>& qlen,
                    int window, size_t max_checked_rows, bool partitioned = false,
                    int ctx_bound = 0, int variant = 0) {
  attention_case_run(rng, decode, kv_t, q_t, nh, nkv, hd, bs, ctx, qlen, window, max_checked_rows,
                     partitioned, ctx_bound, variant);
  if (decode && !partitioned && variant == 0)
    attention_case_run(rng, decode, kv_t, q_t, nh, nkv, hd, bs, ctx, qlen, window, max_checked_rows,
                       partitioned, ctx_bound, 2);
}

}  // namespace

TEST_CASE("gpu decode attention (split-K) over the paged cache: GQA, splits, windows, bounds") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode"));
  for (auto kv_t : kKvTypes) {
    // Chunk edges (63, 64, 65 positions), a bound far above the contexts (a graph's), one
    // split slot per sequence (many sequences), group 5 (G rounded up), head_dim 24 and 256.
    attention_case(rng, true, kv_t, DType::bf16, 32, 8, 128, 16, {1, 63, 64, 65, 129, 300},
                   {1, 1, 1, 1, 1, 1}, 0, 1);
    attention_case(rng, true, kv_t, DType::bf16, 32, 8, 128, 16, {1, 200, 4000}, {1, 1, 1}, 0, 1,
                   false, 33792);
    // The benchmark's variant (4 rows per batch, 3 blocks per multiprocessor).
    attention_case(rng, true, kv_t, DType::bf16, 32, 8, 128, 16, {1, 65, 200, 4000}, {1, 1, 1, 1},
                   0, 1, false, 33792, 1);
    attention_case(rng, true, kv_t, DType::bf16, 12, 4, 96, 16, {700, 3}, {1, 1}, 300, 1, false, 0,
                   1);
    std::vector<int32_t> many(80), ones(80, 1);
    for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int32_t>(1 + 37 * i);
    attention_case(rng, true, kv_t, DType::bf16, 8, 8, 64, 16, many, ones, 0, 1);
    attention_case(rng, true, kv_t, DType::bf16, 10, 2, 128, 16, {777, 5}, {1, 1}, 0, 1);
    attention_case(rng, true, kv_t, DType::f32, 2, 1, 24, 8, {100, 3}, {1, 1}, 0, 1);
    attention_case(rng, true, kv_t, DType::bf16, 16, 1, 64, 16, {4100}, {1}, 0, 1);  // chunks
    attention_case(rng, true, kv_t, DType::bf16, 8, 2, 256, 32, {513, 2}, {1, 1}, 0, 1);
    attention_case(rng, true, kv_t, DType::bf16, 8, 8, 128, 12, {2000, 50}, {1, 1}, 700,
                   1);  // window; a block size that is not a power of two
    attention_case(rng, true, kv_t, DType::bf16, 4, 2, 16, 16, {5, 257, 33}, {1, 1, 1}, 0, 1, false,
                   5000);
    // Groups of 8 heads (Qwen3-MoE), the most registers a lane: splits of one batch and of
    // several, and a long context in blocks of one position.
    attention_case(rng, true, kv_t, DType::bf16, 32, 4, 128, 16, {1, 31, 33, 3000, 9000},
                   {1, 1, 1, 1, 1}, 0, 1, false, 33792);
    attention_case(rng, true, kv_t, DType::bf16, 16, 2, 128, 1, {20000}, {1}, 0, 1);
  }
  if (large_cases())  // a 32k context
    attention_case(rng, true, DType::bf16, DType::bf16, 8, 2, 128, 16, {32768}, {1}, 0, 1);
}

TEST_CASE("gpu decode attention (short contexts): the whole range in shared memory") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode-short"));
  const int S = attention_decode_short_max(128, DType::bf16);
  MESSAGE("short-context bound, head_dim 128, bf16 cache: " << S);
  REQUIRE(S >= 128);  // 1024 on an H200 and a GB10
  CHECK(S % 16 == 0);
  CHECK(attention_decode_short_max(128, DType::f32) <= S);  // fp32 rows take twice the room
  CHECK(attention_decode_short_max(256, DType::f32) > 0);
  CHECK(attention_decode_short_max(12, DType::bf16) == 0);  // not a multiple of 8
  // The engine's choice: the short kernel while its grid (8 blocks per sequence and KV
  // head) fits in one wave, and the context in its bound.
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  AttentionBatch pick;
  pick.n_heads = 32, pick.kv.n_kv_heads = 8, pick.kv.head_dim = 128, pick.kv.dtype = DType::bf16;
  pick.n_seqs = 1, pick.max_seq_len = S;
  CHECK(attention_decode_short_takes(pick) == (64 <= lim->sm_count));
  CHECK(attention_decode_short_bound(1, 32, 8, 128, DType::bf16) == (64 <= lim->sm_count ? S : 0));
  pick.max_seq_len = S + 1;
  CHECK_FALSE(attention_decode_short_takes(pick));
  pick.max_seq_len = S, pick.n_seqs = lim->sm_count;  // many waves
  CHECK_FALSE(attention_decode_short_takes(pick));
  CHECK(attention_decode_short_bound(lim->sm_count, 32, 8, 128, DType::bf16) == 0);
  pick.decode_variant = 2;
  pick.n_seqs = 1;
  CHECK_FALSE(attention_decode_short_takes(pick));
  pick.decode_variant = 3;
  pick.n_seqs = lim->sm_count;
  CHECK(attention_decode_short_takes(pick));
  // The kernel itself (variant 3) on contexts up to the bound, and the bound as a graph
  // captures it (wide tables holding -1 past each context): GQA 4 (Llama 3), MHA, group 5
  // and 12 (chunks of 8 heads), head_dim 24 to 256, fp32 q and out, a window, a block size
  // that is not a power of two, many sequences, one position; then as the engine picks at
  // one sequence (variant 0, with split-K forced beside it).
  attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, {1, 63, 64, 65, 200, S},
                 {1, 1, 1, 1, 1, 1}, 0, 1, false, S, 3);
  attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, {S - 1, 17}, {1, 1}, 0, 1,
                 false, 0, 3);
  attention_case(rng, true, DType::bf16, DType::bf16, 8, 8, 64, 16, {S, 3}, {1, 1}, 0, 1, false, 0,
                 3);
  attention_case(rng, true, DType::bf16, DType::bf16, 10, 2, 128, 16, {150, 5}, {1, 1}, 0, 1, false,
                 0, 3);
  attention_case(rng, true, DType::bf16, DType::bf16, 24, 2, 64, 16, {99, 130}, {1, 1}, 0, 1, false,
                 0, 3);
  attention_case(rng, true, DType::f32, DType::f32, 2, 1, 24, 8, {100, 3}, {1, 1}, 0, 1, false, 0,
                 3);
  const int S32 = attention_decode_short_max(128, DType::f32);
  attention_case(rng, true, DType::f32, DType::bf16, 16, 4, 128, 16, {S32, 31}, {1, 1}, 0, 1, false,
                 S32, 3);
  const int S256 = attention_decode_short_max(256, DType::bf16);
  attention_case(rng, true, DType::bf16, DType::bf16, 8, 2, 256, 32, {S256, 2}, {1, 1}, 0, 1, false,
                 0, 3);
  attention_case(rng, true, DType::bf16, DType::bf16, 8, 8, 128, 12, {S, 50}, {1, 1}, 70, 1, false,
                 0, 3);
  std::vector<int32_t> many(80), ones(80, 1);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int32_t>(1 + (37 * i) % S);
  attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, many, ones, 0, 1, false, 0,
                 3);
  for (int ctx : {1, 7, 256, S})
    attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, {ctx}, {1}, 0, 1, false, S);

  // Past its bound the short kernel refuses (the dispatcher takes split-K there).
  auto P = make_paged(rng, DType::bf16, 16, 8, 128, {S + 1}, DType::bf16);
  auto q = to_dev(std::vector<float>(32 * 128, 0.5f), DType::bf16);
  auto out = poisoned(32 * 128, DType::bf16);
  std::vector<int32_t> qs{0, 1};
  auto dqs = DeviceBuf<int32_t>::from(qs);
  AttentionBatch b;
  b.q = q.get(), b.q_stride = 32 * 128, b.out = out.get(), b.out_stride = 32 * 128;
  b.n_heads = 32, b.kv = P.dev(), b.block_tables = P.dtables.get();
  b.max_blocks_per_seq = P.max_blocks, b.seq_lens = P.dlens.get(), b.query_start = dqs.get();
  b.n_seqs = 1, b.n_tokens = 1, b.max_query_len = 1, b.max_seq_len = S + 1;
  b.scale = 0.1f;
  const size_t need = attention_decode_workspace_bytes(1, 32, 128, S + 1);
  auto ws = DeviceMemory::allocate(need);
  REQUIRE(ws.ok());
  std::vector<uint8_t> zeros(need, 0);
  REQUIRE(ws->copy_from_host(zeros.data(), need).ok());
  b.workspace = ws->get(), b.workspace_bytes = need;
  auto st = attention_decode_short_cuda_device(b, nullptr);
  REQUIRE_FALSE(st.ok());
  CHECK(st.error().code == Errc::usage);
  CHECK(st.message().find(std::to_string(S)) != std::string::npos);
  CHECK(attention_decode_cuda_device(b, nullptr).ok());  // split-K
  CHECK(cuda_synchronize().ok());
}

TEST_CASE(
    "gpu decode attention (short contexts), history ready: the query's own row is read after "
    "the wait") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode-short-history"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  if (attention_decode_short_max(128, DType::bf16) == 0) {
    MESSAGE("skipped: no short-context kernel on this GPU (it needs clusters, sm_90)");
    return;
  }
  // As a decode step runs it: the rows before each query's position are in the cache, its
  // own row is poison until the KV write launched just ahead (programmatic launch, no
  // synchronisation between the two) writes it; the kernel copies the earlier rows before
  // it waits for that write and its own row after, so the result is the twin's.
  struct Programmatic {
    Programmatic() { set_programmatic_launch(true); }
    ~Programmatic() { set_programmatic_launch(false); }
  } programmatic;
  for (auto kv_t : {DType::bf16, DType::e4m3}) {
    const int nh = 32, nkv = 4, hd = 128, bs = 16;
    const std::vector<int32_t> ctx{1, 37, 200, 512};
    CAPTURE(std::string(dtype_name(kv_t)));
    auto P = make_paged(rng, kv_t, bs, nkv, hd, ctx, DType::bf16);
    const size_t row = static_cast<size_t>(nkv * hd);
    std::vector<int32_t> own_slots;
    std::vector<float> k_own, v_own, kpoison = P.kpool, vpoison = P.vpool;
    for (size_t sq = 0; sq < ctx.size(); ++sq) {
      const int p = ctx[sq] - 1;
      const size_t slot = static_cast<size_t>(
          P.tables[sq * static_cast<size_t>(P.max_blocks) + static_cast<size_t>(p / bs)] * bs +
          p % bs);
      own_slots.push_back(static_cast<int32_t>(slot));
      for (size_t i = 0; i < row; ++i) {
        k_own.push_back(P.kpool[slot * row + i]);
        v_own.push_back(P.vpool[slot * row + i]);
        kpoison[slot * row + i] = vpoison[slot * row + i] = NAN;
      }
    }
    P.dk = to_dev(kpoison, kv_t), P.dv = to_dev(vpoison, kv_t);
    auto dk_own = to_dev(k_own, DType::f32), dv_own = to_dev(v_own, DType::f32);
    auto dslots = DeviceBuf<int32_t>::from(own_slots);
    const size_t qrow = static_cast<size_t>(nh * hd);
    auto q = as_stored(randoms(rng, ctx.size() * qrow, -2, 2), DType::bf16);
    auto dq = to_dev(q, DType::bf16);
    auto dout = poisoned(ctx.size() * qrow, DType::bf16);
    AttentionBatch b;
    b.q = dq.get(), b.q_stride = qrow, b.out = dout.get(), b.out_stride = qrow;
    b.n_heads = nh, b.kv = P.dev(), b.block_tables = P.dtables.get();
    b.max_blocks_per_seq = P.max_blocks, b.seq_lens = P.dlens.get();
    b.n_seqs = static_cast<int>(ctx.size()), b.n_tokens = ctx.size(), b.max_query_len = 1;
    b.max_seq_len = 512, b.scale = 1.f / std::sqrt(static_cast<float>(hd));
    b.decode_variant = 3, b.history_ready = true;
    const size_t need = attention_decode_workspace_bytes(b.n_seqs, nh, hd, b.max_seq_len);
    auto ws = DeviceMemory::allocate(need);
    REQUIRE(ws.ok());
    std::vector<uint8_t> zeros(need, 0);
    REQUIRE(ws->copy_from_host(zeros.data(), need).ok());
    b.workspace = ws->get(), b.workspace_bytes = need;
    REQUIRE(paged_kv_write_cuda_device(P.dev(), dslots.get(), own_slots.size(), DType::f32,
                                       dk_own.get(), row, dv_own.get(), row, nullptr)
                .ok());
    REQUIRE(attention_decode_cuda_device(b, nullptr).ok());
    REQUIRE(cuda_synchronize().ok());
    auto got = from_dev(dout);
    PagedKVLayer L{P.kpool.data(), P.vpool.data(), bs, nkv, hd};
    float vmax = 0;
    for (float v : P.vpool) vmax = std::max(vmax, std::fabs(v));
    size_t bad = 0;
    double max_err = 0;
    for (size_t sq = 0; sq < ctx.size(); ++sq) {
      const int32_t pos = ctx[sq] - 1;
      std::vector<float> ref(qrow);
      paged_attention_ref(L, P.tables.data() + sq * static_cast<size_t>(P.max_blocks), &pos, 1, nh,
                          q.data() + sq * qrow, ref.data(), b.scale, 0, nullptr);
      for (size_t e = 0; e < qrow; ++e) {
        const double err = std::fabs(static_cast<double>(got[sq * qrow + e]) - ref[e]);
        if (!(err <= bf16_ulp(ref[e]) + 2e-5 * vmax)) ++bad;
        max_err = std::isnan(err) ? INFINITY : std::max(max_err, err);
      }
    }
    MESSAGE("history ready, " << dtype_name(kv_t) << " cache: max err " << max_err);
    CHECK(bad == 0);
  }
}

namespace {

// Forces the pre-Hopper paths for one scope (SPARK_CUDA_FALLBACKS=1 in sparkd).
struct ForcedFallbacks {
  ForcedFallbacks() { set_cuda_fallbacks(true); }
  ~ForcedFallbacks() { set_cuda_fallbacks(false); }
  ForcedFallbacks(const ForcedFallbacks&) = delete;
  ForcedFallbacks& operator=(const ForcedFallbacks&) = delete;
};

}  // namespace

TEST_CASE("gpu decode attention with the fallbacks forced: no clusters, the twin's results") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode-fallbacks"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  const int S = attention_decode_short_max(128, DType::bf16);
  CHECK((S > 0) == cuda_hopper_paths(lim->cc_major, false));
  // The GPU's own choice at one sequence (the short kernel on sm_90 and later).
  for (int ctx : {1, 65, 256})
    attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, {ctx}, {1}, 0, 1);
  ForcedFallbacks forced;
  // What an sm_80 GPU sees: no short-context kernel, so the plain and split-K ones run.
  CHECK(attention_decode_short_max(128, DType::bf16) == 0);
  CHECK(attention_decode_short_bound(1, 32, 8, 128, DType::bf16) == 0);
  AttentionBatch pick;
  pick.n_heads = 32, pick.kv.n_kv_heads = 8, pick.kv.head_dim = 128, pick.kv.dtype = DType::bf16;
  pick.n_seqs = 1, pick.max_seq_len = 64;
  CHECK_FALSE(attention_decode_short_takes(pick));
  for (int ctx : {1, 65, 256})
    attention_case(rng, true, DType::bf16, DType::bf16, 32, 8, 128, 16, {ctx}, {1}, 0, 1);
  attention_case(rng, true, DType::bf16, DType::bf16, 10, 2, 128, 16, {150, 5}, {1, 1}, 0, 1);
  attention_case(rng, true, DType::f32, DType::f32, 2, 1, 24, 8, {100, 3}, {1, 1}, 0, 1);
  // The GLM-4.5 fixture's heads (4 of head_dim 32 over 2 KV heads, blocks of 8) at n = 8.
  attention_case(rng, true, DType::bf16, DType::bf16, 4, 2, 32, 8, {40, 47, 56, 63, 71, 80, 88, 96},
                 {1, 1, 1, 1, 1, 1, 1, 1}, 0, 1);
}

TEST_CASE("gpu decode attention (partitioned, the previous kernel) over the paged cache") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode_partitioned"));
  for (auto kv_t : kKvTypes) {
    attention_case(rng, true, kv_t, DType::bf16, 32, 8, 128, 16, {1, 7, 300, 1000}, {1, 1, 1, 1}, 0,
                   1, true);
    attention_case(rng, true, kv_t, DType::bf16, 4, 2, 16, 16, {5, 257, 33}, {1, 1, 1}, 0, 1, true);
    attention_case(rng, true, kv_t, DType::f32, 2, 1, 24, 8, {100, 3}, {1, 1}, 0, 1, true);
    attention_case(rng, true, kv_t, DType::bf16, 16, 1, 64, 16, {4100}, {1}, 0, 1,
                   true);  // group 16: chunks
    attention_case(rng, true, kv_t, DType::bf16, 8, 2, 256, 32, {513, 2}, {1, 1}, 0, 1, true);
    attention_case(rng, true, kv_t, DType::bf16, 8, 8, 128, 16, {2000, 50}, {1, 1}, 700, 1,
                   true);  // window
  }
  if (large_cases())  // a 32k context
    attention_case(rng, true, DType::bf16, DType::bf16, 8, 2, 128, 16, {32768}, {1}, 0, 1, true);
}

// gpt-oss: each head's sink logit joins the softmax denominator once, also when the
// context is split over partitions (the reduce adds it) and under a sliding window.
TEST_CASE("gpu decode attention sinks (partitioned) against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode_sinks"));
  const int nh = 8;
  std::vector<float> mixed(nh), large(nh, 30.f), tiny(nh, -1e30f);
  for (int h = 0; h < nh; ++h) mixed[static_cast<size_t>(h)] = static_cast<float>(h) - 3.f;
  for (const auto* sk : {&mixed, &large, &tiny})
    for (int window : {0, 100}) {
      attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {1, 37, 300},
                         {1, 1, 1}, window, 1, true, 0, 0, *sk);  // one partition: direct
      attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {4500, 2}, {1, 1},
                         window, 1, true, 0, 0, *sk);  // split: the reduce adds the sink
    }
}

namespace {

// gpt-oss's shape: 64 heads over 8 KV heads there, fewer here; head_dim 64. Sinks on both
// sides of the scores (scores are within a few units of 0): some heads barely touched,
// some dominated by the sink, one that weighs nothing.
std::vector<float> gptoss_sinks(int nh) {
  std::vector<float> sk(static_cast<size_t>(nh));
  for (int h = 0; h < nh; ++h) sk[static_cast<size_t>(h)] = static_cast<float>(h % 8) - 2.f;
  sk[0] = 6.f;
  sk[static_cast<size_t>(nh - 1)] = -1e30f;
  return sk;
}

}  // namespace

// Prefill with sinks: each row's denominator gets exp(sink - m) once, at the end, on every
// prefill kernel (the engine's choice, the previous kernel, the tiled kernel at 64 and 128
// queries a block, the skewed kernel where shared memory allows), with gpt-oss's sliding
// window of 128 over contexts past it, and chunked prefill over a cached prefix.
TEST_CASE("gpu attention sinks prefill: every kernel, window 128, chunked over a prefix") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("prefill_sinks"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  std::vector<int> variants{0, 1, 2, 3};
  if (lim->smem_per_block_optin >= 104960) variants.push_back(4);
  if (lim->smem_per_block_optin >= 174848) variants.push_back(6);
  const int nh = 8;
  const auto sk = gptoss_sinks(nh);
  for (int variant : variants)
    for (int window : {0, 128}) {
      CAPTURE(variant);
      CAPTURE(window);
      // Whole prompts past the window, ragged.
      attention_case_run(rng, false, DType::bf16, DType::bf16, nh, 2, 64, 16, {300, 129, 5},
                         {300, 129, 5}, window, 1000, false, 0, variant, sk);
      // Chunked prefill: 200 new tokens after a cached prefix of 500, and a mixed step's
      // one-token chunk beside it.
      attention_case_run(rng, false, DType::bf16, DType::bf16, nh, 2, 64, 16, {700, 90}, {200, 1},
                         window, 1000, false, 0, variant, sk);
    }
  // fp32 cache and queries, GQA 4, on the engine's choice.
  attention_case_run(rng, false, DType::f32, DType::f32, nh, 2, 64, 16, {260}, {260}, 128, 1000,
                     false, 0, 0, sk);
  // The sinks matter: against the twin without them the kernel's rows are off.
  attention_case_run(rng, false, DType::bf16, DType::bf16, nh, 2, 64, 16, {300}, {300}, 128, 1000,
                     false, 0, 0, std::vector<float>(nh, 10.f), true);
}

// Split-K with the products on the tensor cores (decode_variant 4): positions in tiles of 16
// with the group's heads as the mma's columns, dimensions permuted between the loads and
// the fragments, P transposed in registers. Tile and chunk edges (15-17, 63-65 positions),
// groups of 1, 4, 5, 8 and 12 (chunks of 8), head_dim 32, 64 and 128, a window, block sizes of
// 1 and 12, fp32 q and out, a graph's bound, sinks, bf16 and e4m3 caches; the bound is
// prefill's (P in bf16).
TEST_CASE("gpu decode attention (split-K on the tensor cores): against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode_tc"));
  for (auto kv_t : {DType::bf16, DType::e4m3}) {
    auto tc = [&](int nh, int nkv, int hd, int bs, const std::vector<int32_t>& ctx, int window,
                  int bound, DType q_t = DType::bf16, const std::vector<float>& sinks = {}) {
      attention_case_run(rng, true, kv_t, q_t, nh, nkv, hd, bs, ctx,
                         std::vector<int32_t>(ctx.size(), 1), window, 1, false, bound, 4, sinks);
    };
    tc(32, 4, 128, 16, {1, 15, 16, 17, 63, 64, 65, 129, 300}, 0, 0);  // Qwen3-MoE's group of 8
    tc(32, 4, 128, 16, {1, 200, 4000, 9000}, 0, 33792);
    tc(32, 8, 128, 16, {1, 65, 200, 4000}, 0, 33792);  // Llama 3's group of 4
    tc(8, 8, 64, 16, {3, 777}, 0, 0);                  // one head a KV head
    tc(10, 2, 128, 16, {777, 5}, 0, 0);                // group 5
    tc(24, 2, 64, 16, {99, 1300}, 0, 0);               // group 12: chunks of 8 and 4
    tc(8, 8, 128, 12, {2000, 50}, 700, 0);             // window; block size 12
    tc(16, 2, 128, 1, {20000}, 0, 0);                  // block size 1
    tc(8, 2, 64, 16, {100, 3}, 0, 0, DType::f32);      // fp32 q and out
    tc(16, 4, 32, 16, {1, 40, 3000}, 0, 0);            // head_dim 32 (the engine's fixtures)
    tc(64, 8, 64, 16, {4500, 130, 2}, 128, 0, DType::bf16, gptoss_sinks(64));  // gpt-oss
    tc(64, 8, 64, 16, {4097, 300}, 0, 33792, DType::bf16, gptoss_sinks(64));
  }
  if (large_cases())
    attention_case_run(rng, true, DType::bf16, DType::bf16, 32, 4, 128, 16, {32768}, {1}, 0, 1,
                       false, 0, 4);

  // What it does not take is refused by name: other caches and head sizes.
  CHECK(attention_decode_tc_fits(DType::bf16, 128));
  CHECK(attention_decode_tc_fits(DType::e4m3, 64));
  CHECK_FALSE(attention_decode_tc_fits(DType::f32, 128));
  CHECK_FALSE(attention_decode_tc_fits(DType::bf16, 256));
  for (auto [kv_t, hd] : {std::pair{DType::f32, 128}, std::pair{DType::bf16, 96}}) {
    auto P = make_paged(rng, kv_t, 16, 2, hd, {40}, DType::bf16);
    auto q = to_dev(std::vector<float>(static_cast<size_t>(8 * hd), 0.5f), DType::bf16);
    auto out = poisoned(static_cast<size_t>(8 * hd), DType::bf16);
    std::vector<int32_t> qs{0, 1};
    auto dqs = DeviceBuf<int32_t>::from(qs);
    AttentionBatch b;
    b.q = q.get(), b.q_stride = static_cast<size_t>(8 * hd), b.out = out.get();
    b.out_stride = static_cast<size_t>(8 * hd);
    b.n_heads = 8, b.kv = P.dev(), b.block_tables = P.dtables.get();
    b.max_blocks_per_seq = P.max_blocks, b.seq_lens = P.dlens.get(), b.query_start = dqs.get();
    b.n_seqs = 1, b.n_tokens = 1, b.max_query_len = 1, b.max_seq_len = 40, b.scale = 0.1f;
    b.decode_variant = 4;
    const size_t need = attention_decode_workspace_bytes(1, 8, hd, 40);
    auto ws = DeviceMemory::allocate(need);
    REQUIRE(ws.ok());
    std::vector<uint8_t> zeros(need, 0);
    REQUIRE(ws->copy_from_host(zeros.data(), need).ok());
    b.workspace = ws->get(), b.workspace_bytes = need;
    auto st = attention_decode_cuda_device(b, nullptr);
    REQUIRE_FALSE(st.ok());
    CHECK(st.error().code == Errc::usage);
    CHECK(st.message().find("tensor cores") != std::string::npos);
    CHECK(st.message().find(std::to_string(hd)) != std::string::npos);
  }
}

// Split-K decode with sinks at long contexts: the sink joins the merged denominator once
// (a sink per split would weigh it `used` times), also when a single split writes the
// output directly, under a window, and at a graph's bound far above the contexts.
TEST_CASE("gpu attention sinks split-K decode: long contexts, windows, graph bounds") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("decode_split_sinks"));
  const int nh = 8;
  const auto sk = gptoss_sinks(nh);
  for (int variant : {1, 2})
    for (int window : {0, 128}) {
      attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {4500, 8192, 2, 64},
                         {1, 1, 1, 1}, window, 1, false, 0, variant, sk);
      attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {4097, 300}, {1, 1},
                         window, 1, false, 33792, variant, sk);
    }
  attention_case_run(rng, true, DType::f32, DType::f32, 16, 2, 128, 16, {5000}, {1}, 0, 1, false, 0,
                     2, gptoss_sinks(16));
  // The sinks matter, on split and direct outputs alike.
  attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {6000, 40}, {1, 1}, 0, 1,
                     false, 0, 2, std::vector<float>(nh, 10.f), true);
}

// The short-context decode kernel with sinks: the cluster's merge adds the sink once.
TEST_CASE("gpu attention sinks short-context decode: the cluster merge adds the sink once") {
  if (test::skip_without_cuda()) return;
  const int S = attention_decode_short_max(64, DType::bf16);
  if (S == 0) {
    MESSAGE("SKIP: no short-context decode kernel on this device (needs clusters, sm_90+)");
    return;
  }
  std::mt19937 rng(test::fresh_seed("decode_short_sinks"));
  const int nh = 8;
  const auto sk = gptoss_sinks(nh);
  for (int window : {0, 128}) {
    attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {S, 200, 9, 1},
                       {1, 1, 1, 1}, window, 1, false, S, 3, sk);
    attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {S - 1, 129}, {1, 1},
                       window, 1, false, 0, 0, sk);  // the engine's pick at 2 sequences
  }
  attention_case_run(rng, true, DType::bf16, DType::bf16, nh, 2, 64, 16, {S, 100}, {1, 1}, 0, 1,
                     false, 0, 3, std::vector<float>(nh, 10.f), true);
}

// The engine's kernel (variant 0: the tiled kernel, its block size picked from the grid)
// and the previous kernel (variant 1) on the same shapes.
TEST_CASE("gpu prefill attention: causal, GQA, cached prefixes, ragged batches, up to 32k") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("prefill"));
  for (int variant : {0, 1}) {
    for (auto kv_t : kKvTypes) {
      attention_case(rng, false, kv_t, DType::bf16, 8, 2, 128, 16, {1, 65, 200}, {1, 65, 200}, 0,
                     1000, false, 0, variant);
      attention_case(rng, false, kv_t, DType::bf16, 4, 2, 16, 16, {300, 77}, {100, 77}, 0, 1000,
                     false, 0, variant);  // prefix
      attention_case(rng, false, kv_t, DType::bf16, 2, 1, 24, 8, {130}, {130}, 0, 1000, false, 0,
                     variant);
      attention_case(rng, false, kv_t, DType::bf16, 4, 4, 64, 16, {500, 31}, {129, 31}, 100, 1000,
                     false, 0, variant);  // window
      attention_case(rng, false, kv_t, DType::bf16, 4, 1, 256, 16, {190}, {190}, 0, 1000, false, 0,
                     variant);
    }
    attention_case(rng, false, DType::bf16, DType::f32, 4, 2, 128, 16, {70}, {70}, 0, 1000, false,
                   0, variant);
    attention_case(rng, false, DType::bf16, DType::bf16, 32, 8, 128, 16, {2048}, {2048}, 0, 64,
                   false, 0, variant);
  }
  if (large_cases()) {  // a 32k prompt; 1000 new tokens after an 8000-token prefix
    attention_case(rng, false, DType::bf16, DType::bf16, 8, 2, 128, 16, {32768}, {32768}, 0, 24);
    attention_case(rng, false, DType::bf16, DType::bf16, 4, 1, 128, 16, {9000}, {1000}, 0, 40);
  }
}

// The tiled kernel with each block size forced (64 queries: variant 2, 128: 3; where the
// device has 105 KiB of shared memory a block, 256: 4, and 256 rescaling on every tile: 5;
// with 171 KiB, 256 in two groups of warps out of phase: 6) on
// the shapes its paths depend on: head_dim 64/128/256 and padded ones (24, 96), GQA groups
// 1/4/8, prompt lengths on both sides of the 64- and 128-row tiles and of the 64-key tile
// (the diagonal tiles, the warps that sit out the last tiles, rows past the end), chunked
// prefill after a cached prefix, block sizes that are not powers of two, windows, fp32
// caches and fp32 queries.
TEST_CASE("gpu prefill attention (tiled kernel): tiles, head sizes, GQA groups, prefixes") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("prefill_tiled"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  std::vector<int> variants{2, 3};
  if (lim->smem_per_block_optin >= 104960)
    variants.insert(variants.end(), {4, 5});
  else
    MESSAGE("variants 4 and 5 not run: " << lim->smem_per_block_optin
                                         << " bytes of shared memory a block, 104960 needed");
  if (lim->smem_per_block_optin >= 174848)
    variants.push_back(6);
  else
    MESSAGE("variant 6 not run: " << lim->smem_per_block_optin
                                  << " bytes of shared memory a block, 174848 needed");
  for (int variant : variants)
    for (auto kv_t : kKvTypes) {
      // Group 1; one-row, tile-edge and ragged prompts in one batch.
      attention_case(rng, false, kv_t, DType::bf16, 8, 8, 64, 16, {1, 63, 64, 127, 128, 129, 300},
                     {1, 63, 64, 127, 128, 129, 300}, 0, 1000, false, 0, variant);
      // Group 4 (Llama-3-8B's heads scaled down), a length that is no multiple of any tile.
      attention_case(rng, false, kv_t, DType::bf16, 16, 4, 128, 16, {1000}, {1000}, 0, 100, false,
                     0, variant);
      // Chunked prefill: new tokens after prefixes already in the cache, one of them long.
      attention_case(rng, false, kv_t, DType::bf16, 16, 2, 128, 16, {700, 1077, 65}, {200, 300, 65},
                     0, 100, false, 0, variant);
      // Group 8, head_dim 256 (always 64-query blocks) with a prefix.
      attention_case(rng, false, kv_t, DType::bf16, 8, 1, 256, 16, {333, 97}, {333, 40}, 0, 100,
                     false, 0, variant);
      // Padded head sizes; a block size of 12 (no shifts) under a prefix.
      attention_case(rng, false, kv_t, DType::bf16, 4, 1, 96, 16, {259}, {259}, 0, 1000, false, 0,
                     variant);
      attention_case(rng, false, kv_t, DType::bf16, 4, 1, 24, 12, {500}, {211}, 0, 1000, false, 0,
                     variant);
      // A window shorter than a tile, over a prefix and without one.
      attention_case(rng, false, kv_t, DType::bf16, 8, 2, 128, 16, {600, 300}, {600, 100}, 50, 100,
                     false, 0, variant);
    }
  for (int variant : variants)
    attention_case(rng, false, DType::bf16, DType::f32, 8, 2, 64, 16, {200, 130}, {200, 60}, 0,
                   1000, false, 0, variant);
}

TEST_CASE("gpu argmax and sampler pick the same tokens as the CPU twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("sampler"));
  for (int V : {1, 7, 1000, 32000, 151936}) {
    CAPTURE(V);
    const int rows = 24;
    auto logits = randoms(rng, static_cast<size_t>(rows) * static_cast<size_t>(V), -8, 8);
    // A few rows with ties and a dominant token, so tie rules are exercised.
    for (int r = 0; r < 3 && V > 2; ++r) {
      logits[static_cast<size_t>(r) * V + 1] = 20, logits[static_cast<size_t>(r) * V + 2] = 20;
    }
    std::vector<int32_t> am(rows);
    argmax_ref(logits.data(), static_cast<size_t>(rows), static_cast<size_t>(V), am.data());
    auto dl = to_dev(logits, DType::f32);
    auto dam = DeviceBuf<int32_t>::poisoned(rows);
    REQUIRE(
        argmax_cuda_device(DType::f32, dl.get(), rows, static_cast<size_t>(V), dam.get(), nullptr)
            .ok());
    REQUIRE(cuda_synchronize().ok());
    CHECK(dam.host() == am);

    std::vector<SampleParams> ps(rows);
    std::vector<uint8_t> seen(static_cast<size_t>(rows) * V, 0);
    std::vector<int32_t> counts(static_cast<size_t>(rows) * V, 0);
    std::uniform_int_distribution<int> tok(0, V - 1);
    for (int r = 0; r < rows; ++r) {
      auto& p = ps[r];
      p.seed = rng(), p.request = rng(), p.step = rng() % 1000;
      p.temperature = r % 6 == 0 ? 0.f : 0.3f + 0.2f * (r % 5);
      p.top_k = r % 4 == 1 ? 1 + r : 0;
      p.top_p = r % 3 == 2 ? 0.9f : 1.f;
      p.min_p = r % 5 == 3 ? 0.05f : 0.f;
      p.repetition_penalty = r % 2 ? 1.3f : 1.f;
      p.presence_penalty = r % 7 == 4 ? 0.5f : 0.f;
      p.frequency_penalty = r % 7 == 5 ? -0.7f : 0.f;
      p.logprobs = 1;
      p.top_logprobs = r % 21;
      for (int i = 0; i < 20; ++i) {
        const int t = tok(rng);
        seen[static_cast<size_t>(r) * V + t] = 1;
        counts[static_cast<size_t>(r) * V + t] += i % 3;
      }
    }
    auto dparams = DeviceBuf<SampleParams>::from(ps);
    auto dseen = DeviceBuf<uint8_t>::from(seen);
    auto dcounts = DeviceBuf<int32_t>::from(counts);
    auto dres = DeviceBuf<SampleResult>::poisoned(rows);
    auto dtok = DeviceBuf<int32_t>::poisoned(rows);
    auto ws = DeviceMemory::allocate(sample_workspace_bytes(rows, V));
    REQUIRE(ws.ok());
    SampleBatch b;
    b.logits = dl.get(), b.logits_stride = static_cast<size_t>(V), b.vocab = V, b.rows = rows;
    b.params = dparams.get(), b.seen = dseen.get(), b.counts = dcounts.get(),
    b.results = dres.get();
    b.tokens = dtok.get(), b.workspace = ws->get(), b.workspace_bytes = ws->size();
    auto s = sample_cuda_device(b, nullptr);
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
    auto res = dres.host();
    auto toks = dtok.host();
    auto seen_after = dseen.host();
    auto counts_after = dcounts.host();
    size_t same = 0;
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      auto ref = sample_ref(logits.data() + static_cast<size_t>(r) * V, V, ps[r],
                            seen.data() + static_cast<size_t>(r) * V,
                            counts.data() + static_cast<size_t>(r) * V);
      same += res[r].token == ref.token;
      CHECK(res[r].token == ref.token);
      CHECK(toks[r] == ref.token);
      CHECK(res[r].logprob == doctest::Approx(ref.logprob).epsilon(1e-5).scale(1));
      CHECK(res[r].n_top == ref.n_top);
      for (int i = 0; i < ref.n_top && i < res[r].n_top; ++i) {
        CHECK(res[r].top_ids[i] == ref.top_ids[i]);
        CHECK(res[r].top_logprobs[i] ==
              doctest::Approx(ref.top_logprobs[i]).epsilon(1e-5).scale(1));
      }
      // The state records the draw.
      CHECK(seen_after[static_cast<size_t>(r) * V + res[r].token] == 1);
      CHECK(counts_after[static_cast<size_t>(r) * V + res[r].token] ==
            counts[static_cast<size_t>(r) * V + res[r].token] + 1);
    }
    MESSAGE("sampler V " << V << ": " << same << "/" << rows << " rows drew the CPU twin's token");
  }
}

// One batch through the device sampler against sample_ref row by row: the same token,
// the same alternatives, logprobs within 1e-5 (the log-sum-exp is summed in another
// order). The workspace starts poisoned, and the batch runs twice on it (the second run
// must not depend on what the first left there; it launches without PDL and splits rows
// into fewer, longer chunks).
void sampler_batch_case(std::mt19937& rng, int V, int rows, DType dt, size_t stride, int mix0) {
  CAPTURE(V);
  CAPTURE(rows);
  CAPTURE(static_cast<int>(dt));
  std::vector<float> logits(static_cast<size_t>(rows) * stride, 0.f);
  std::vector<int> kinds(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    kinds[static_cast<size_t>(r)] = (r + mix0) % test::kSampleRowKindCount;
    auto l = test::sample_row(rng, V, kinds[static_cast<size_t>(r)]);
    if (dt == DType::bf16)
      for (auto& v : l) v = bf16_to_float(float_to_bf16(v));  // the twin sees what the device reads
    std::copy(l.begin(), l.end(),
              logits.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(r) * stride));
  }
  std::vector<SampleParams> ps(static_cast<size_t>(rows));
  std::vector<uint8_t> seen(static_cast<size_t>(rows) * V, 0);
  std::vector<int32_t> counts(static_cast<size_t>(rows) * V, 0);
  std::uniform_int_distribution<int> tok(0, V - 1);
  for (int r = 0; r < rows; ++r) {
    ps[static_cast<size_t>(r)] =
        test::sample_mix((mix0 * 13 + r * 29) % test::kSampleMixCount, V, rng());
    for (int i = 0; i < 16; ++i) {
      const size_t t = static_cast<size_t>(r) * V + static_cast<size_t>(tok(rng));
      seen[t] = 1;
      counts[t] += i % 3;
    }
  }
  auto dl = to_dev(logits, dt);
  auto dparams = DeviceBuf<SampleParams>::from(ps);
  auto dseen = DeviceBuf<uint8_t>::from(seen);
  auto dcounts = DeviceBuf<int32_t>::from(counts);
  const size_t wbytes = sample_workspace_bytes(rows, V);
  auto ws = DeviceMemory::allocate(wbytes);
  REQUIRE(ws.ok());
  std::vector<uint8_t> ff(wbytes, 0xFF);
  REQUIRE(ws->copy_from_host(ff.data(), ff.size()).ok());
  std::vector<SampleResult> ref(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r)
    ref[static_cast<size_t>(r)] = sample_ref(
        logits.data() + static_cast<size_t>(r) * stride, V, ps[static_cast<size_t>(r)],
        seen.data() + static_cast<size_t>(r) * V, counts.data() + static_cast<size_t>(r) * V);
  for (int run = 0; run < 2; ++run) {
    CAPTURE(run);
    auto dres = DeviceBuf<SampleResult>::poisoned(static_cast<size_t>(rows));
    auto dtok = DeviceBuf<int32_t>::poisoned(static_cast<size_t>(rows));
    SampleBatch b;
    b.logits_dtype = dt;
    b.logits = dl.get(), b.logits_stride = stride, b.vocab = V, b.rows = rows;
    b.params = dparams.get(), b.seen = dseen.get(), b.counts = dcounts.get();
    b.update_state = false;
    b.results = dres.get(), b.tokens = dtok.get();
    b.workspace = ws->get(), b.workspace_bytes = ws->size();
    SampleLaunch how;
    how.pdl = run == 0;  // the second run without programmatic dependent launch,
    how.blocks_per_sm = run == 0 ? how.blocks_per_sm : 1;  // and with longer chunks
    auto s = sample_cuda_device(b, nullptr, how);
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
    auto res = dres.host();
    auto toks = dtok.host();
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      CAPTURE(test::kSampleRowKinds[kinds[static_cast<size_t>(r)]]);
      const auto& p = ps[static_cast<size_t>(r)];
      CAPTURE(p.temperature);
      CAPTURE(p.top_k);
      CAPTURE(p.top_p);
      CAPTURE(p.min_p);
      CAPTURE(p.top_logprobs);
      const auto& want = ref[static_cast<size_t>(r)];
      const auto& got = res[static_cast<size_t>(r)];
      CHECK(got.token == want.token);
      CHECK(toks[static_cast<size_t>(r)] == want.token);
      const bool lp = p.logprobs != 0 || p.top_logprobs > 0;
      if (lp && std::isfinite(want.logprob))
        CHECK(got.logprob == doctest::Approx(want.logprob).epsilon(1e-5).scale(1));
      CHECK(got.n_top == want.n_top);
      for (int i = 0; i < want.n_top && i < got.n_top; ++i) {
        CHECK(got.top_ids[i] == want.top_ids[i]);
        if (std::isfinite(want.top_logprobs[i]))
          CHECK(got.top_logprobs[i] ==
                doctest::Approx(want.top_logprobs[i]).epsilon(1e-5).scale(1));
      }
    }
  }
}

TEST_CASE("gpu sampler: staged kernels draw the twin's tokens over row kinds, mixes and batches") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("sampler staged"));
  int mix0 = 0;
  for (int V : {1, 7, 4099, 32000, 128256, 151936}) {
    for (int rows : {1, 8, 33}) {
      sampler_batch_case(rng, V, rows, DType::f32, static_cast<size_t>(V), mix0++);
      if (rows == 8) sampler_batch_case(rng, V, rows, DType::bf16, static_cast<size_t>(V), mix0++);
    }
  }
  sampler_batch_case(rng, 4099, 9, DType::f32, 4099 + 5, mix0++);  // rows apart in memory
}

TEST_CASE("gpu sampler with the fallbacks forced and with programmatic launch: the twin's tokens") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("sampler fallbacks"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  int mix = 0;
  // The sm_90 launch (programmatic, kernels waiting with griddepcontrol) where the GPU has it.
  if (cuda_hopper_paths(lim->cc_major, false)) {
    set_programmatic_launch(true);
    for (int rows : {1, 8}) sampler_batch_case(rng, 32000, rows, DType::f32, 32000, mix++);
    set_programmatic_launch(false);
  }
  // The sm_80 launch: what the engine does with SPARK_CUDA_FALLBACKS=1.
  ForcedFallbacks forced;
  set_programmatic_launch(cuda_hopper_paths(lim->cc_major, cuda_fallbacks()));
  CHECK_FALSE(programmatic_launch());
  for (int rows : {1, 8, 33}) sampler_batch_case(rng, 32000, rows, DType::f32, 32000, mix++);
  sampler_batch_case(rng, 4099, 8, DType::bf16, 4099, mix++);
}

TEST_CASE("gpu sampler state reset marks the prompt and clears counts") {
  if (test::skip_without_cuda()) return;
  const int V = 1000;
  auto dseen = DeviceBuf<uint8_t>::poisoned(V);
  auto dcounts = DeviceBuf<int32_t>::poisoned(V);
  std::vector<int32_t> prompt = {3, 999, 3, -1, 1000, 0};
  auto dp = DeviceBuf<int32_t>::from(prompt);
  REQUIRE(sample_state_reset_cuda_device(dseen.get(), dcounts.get(), V, dp.get(), prompt.size(),
                                         nullptr)
              .ok());
  REQUIRE(cuda_synchronize().ok());
  auto seen = dseen.host();
  auto counts = dcounts.host();
  for (int i = 0; i < V; ++i) {
    CHECK(seen[i] == ((i == 3 || i == 999 || i == 0) ? 1 : 0));
    CHECK(counts[i] == 0);
  }
}

TEST_CASE("gpu sampler state build: token lists give the twin's seen and counts rows") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("state_build"));
  for (int V : {1, 37, 151936}) {
    CAPTURE(V);
    const int rows = 6;
    std::uniform_int_distribution<int> tok(-2, V + 1);
    std::vector<int32_t> flat, start{0}, out_start;
    std::vector<std::vector<int32_t>> lists(rows);
    for (int r = 0; r < rows; ++r) {
      lists[static_cast<size_t>(r)].resize(static_cast<size_t>(r == 2 ? 0 : 1 + 700 * r));
      for (auto& t : lists[static_cast<size_t>(r)]) t = r == 5 ? 0 : tok(rng);  // row 5: one id
      flat.insert(flat.end(), lists[static_cast<size_t>(r)].begin(),
                  lists[static_cast<size_t>(r)].end());
      start.push_back(static_cast<int32_t>(flat.size()));
      out_start.push_back(static_cast<int32_t>(lists[static_cast<size_t>(r)].size() / 3));
    }
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(V);
    auto dseen = DeviceBuf<uint8_t>::poisoned(n);
    auto dcounts = DeviceBuf<int32_t>::poisoned(n);
    auto dflat = DeviceBuf<int32_t>::from(flat), dstart = DeviceBuf<int32_t>::from(start),
         dout = DeviceBuf<int32_t>::from(out_start);
    auto s = sample_state_build_cuda_device(dseen.get(), dcounts.get(), V, rows, dflat.get(),
                                            dstart.get(), dout.get(), nullptr);
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
    auto seen = dseen.host();
    auto counts = dcounts.host();
    for (int r = 0; r < rows; ++r) {
      CAPTURE(r);
      std::vector<uint8_t> sref(static_cast<size_t>(V));
      std::vector<int32_t> cref(static_cast<size_t>(V));
      const auto& l = lists[static_cast<size_t>(r)];
      sample_state_build_ref(sref.data(), cref.data(), V, l.data(), static_cast<int>(l.size()),
                             out_start[static_cast<size_t>(r)]);
      const size_t off = static_cast<size_t>(r) * static_cast<size_t>(V);
      CHECK(std::equal(sref.begin(), sref.end(), seen.begin() + static_cast<ptrdiff_t>(off)));
      CHECK(std::equal(cref.begin(), cref.end(), counts.begin() + static_cast<ptrdiff_t>(off)));
    }
  }
}

TEST_CASE("gpu matrix products: cuBLASLt and the own decode kernel against the twin") {
  if (test::skip_without_cuda()) return;
  auto mm = Matmul::create();
  REQUIRE_MESSAGE(mm.ok(), mm.error().message);
  MESSAGE("cuBLASLt from " << (*mm)->library_path());
  std::mt19937 rng(test::fresh_seed("matmul"));
  // fp32 accumulation of exact bf16 products, in any order: |err| <= k * 2^-24 * sum|a w|
  // (the classical gamma_k bound), plus one bf16 ulp of the result for a bf16 output. The
  // own kernel adds bias and the old output in fp32 and rounds once, as the twin does.
  // cuBLASLt's epilogue on a bf16 output (bias, or accumulating into it) was seen on the
  // H200 to round an intermediate to bf16 first, so there the bound adds one bf16 ulp of
  // the intermediates' magnitude (sum|a w| + |bias| + |old out|) for each such rounding.
  struct Shape {
    size_t m, n, k;
  } shapes[] = {{1, 1, 8},       {1, 4096, 4096},  {3, 1000, 96},  {8, 1024, 4096},
                {17, 333, 264},  {32, 4096, 1024}, {33, 128, 512}, {64, 512, 4096},
                {1, 128256, 64}, {200, 256, 128},  {2, 77, 2056},  {4, 1031, 264},
                {1, 129, 14336}};
  // Every form of the own kernel at the rows it takes (the streaming form at m <= 4 in each
  // register shape, once under programmatic launch; the tensor-core form at any m <= 32).
  // The tensor-core form also in each of its shapes (row tiles a warp x k warps a block; one
  // row tile above 8 rows) and once under programmatic launch.
  struct Form {
    MatmulBackend be;
    OwnVariant v;
    bool pdl;
    int rt = 0, kw = 0;
  };
  std::vector<Form> forms = {{MatmulBackend::cublaslt, OwnVariant::automatic, false},
                             {MatmulBackend::own, OwnVariant::automatic, false},
                             {MatmulBackend::own, OwnVariant::mma, false},
                             {MatmulBackend::own, OwnVariant::mma, true},
                             {MatmulBackend::own, OwnVariant::gemv_r1_u8, false},
                             {MatmulBackend::own, OwnVariant::gemv_r1_u4, false},
                             {MatmulBackend::own, OwnVariant::gemv_r2_u4, false},
                             {MatmulBackend::own, OwnVariant::gemv_r2_u8, false},
                             {MatmulBackend::own, OwnVariant::automatic, true}};
  for (int rt : {1, 2, 4})
    for (int kw : {8, 16}) forms.push_back({MatmulBackend::own, OwnVariant::mma, false, rt, kw});
  for (auto sh : shapes)
    for (auto ot : kTypes)
      for (const Form& form : forms)
        for (int mode : {0, 1, 2, 3}) {
          const bool with_bias = mode & 1, acc = mode & 2;
          const MatmulBackend be = form.be;
          if (be == MatmulBackend::own && sh.m > kMatmulOwnMaxRows) continue;
          const bool gemv_form = form.v != OwnVariant::automatic && form.v != OwnVariant::mma;
          if (gemv_form && sh.m > kMatmulGemvMaxRows) continue;
          if (form.rt > 1 && sh.m > 8) continue;
          if (be == MatmulBackend::own && form.v != OwnVariant::automatic && sh.n * sh.k > 20000000)
            continue;  // the largest shape once per backend is enough
          CAPTURE(sh.m);
          CAPTURE(sh.n);
          CAPTURE(sh.k);
          CAPTURE(std::string(dtype_name(ot)));
          CAPTURE(std::string(matmul_backend_name(be)));
          CAPTURE(std::string(own_variant_name(form.v)));
          CAPTURE(form.pdl);
          CAPTURE(form.rt);
          CAPTURE(form.kw);
          CAPTURE(with_bias);
          CAPTURE(acc);
          auto a = as_stored(randoms(rng, sh.m * sh.k, -1, 1), DType::bf16);
          auto w = as_stored(randoms(rng, sh.n * sh.k, -1, 1), DType::bf16);
          auto bias = as_stored(randoms(rng, sh.n, -1, 1), DType::bf16);
          auto out0 = as_stored(randoms(rng, sh.m * sh.n, -1, 1), ot);
          auto ref = out0;
          matmul_ref(a.data(), w.data(), ref.data(), sh.m, sh.n, sh.k,
                     with_bias ? bias.data() : nullptr, acc, ot);
          auto da = to_dev(a, DType::bf16), dw = to_dev(w, DType::bf16),
               db = to_dev(bias, DType::bf16);
          Dev dout = acc ? to_dev(out0, ot) : poisoned(sh.m * sh.n, ot);
          MatmulArgs args;
          args.a = da.get(), args.lda = sh.k, args.w = dw.get(), args.ldw = sh.k,
          args.out = dout.get();
          args.out_dtype = ot, args.ldo = sh.n, args.m = sh.m, args.n = sh.n, args.k = sh.k;
          args.bias = with_bias ? db.get() : nullptr, args.accumulate = acc, args.backend = be;
          set_programmatic_launch(form.pdl);
          auto s = form.v == OwnVariant::automatic ? (*mm)->run(args, nullptr)
                   : form.rt > 0 ? matmul_own_mma_cuda_device(&args, 1, nullptr, form.rt, form.kw)
                                 : matmul_own_group_cuda_device(&args, 1, nullptr, form.v);
          set_programmatic_launch(false);
          REQUIRE_MESSAGE(s.ok(), s.message());
          REQUIRE(cuda_synchronize().ok());
          auto got = from_dev(dout);
          const int epilogue_roundings =
              be == MatmulBackend::cublaslt && ot == DType::bf16 ? int{with_bias} + int{acc} : 0;
          auto bound = [&](size_t idx) {
            const size_t i = idx / sh.n, j = idx % sh.n;
            double mag = 0;
            for (size_t t = 0; t < sh.k; ++t)
              mag += std::fabs(static_cast<double>(a[i * sh.k + t]) * w[j * sh.k + t]);
            if (with_bias) mag += std::fabs(bias[j]);
            if (acc) mag += std::fabs(out0[idx]);
            return static_cast<double>(sh.k + 2) * 0x1p-24 * mag +
                   (ot == DType::bf16 ? bf16_ulp(ref[idx]) : 0.0) +
                   epilogue_roundings * bf16_ulp(mag);
          };
          check_products(got, ref, sh.m * sh.n, bound);
        }
}

TEST_CASE("gpu own kernel: RMSNorm inside the products (both forms), against the twin") {
  if (test::skip_without_cuda()) return;
  auto mm = Matmul::create();
  REQUIRE_MESSAGE(mm.ok(), mm.error().message);
  std::mt19937 rng(test::fresh_seed("matmul norm"));
  // The twin (matmul_norm_ref) scales each row of a by 1 / rms and by norm_w in double and
  // takes the product of those unrounded values. The kernel: a * norm_w rounded to fp32
  // (2^-24 relative a term), the fp32 FMA chain (gamma_k of sum|a r nw w|), the sum of
  // squares in fp32 (gamma_k relative, half of it in the root), rsqrtf (2 ulp) and the
  // scaling (1 ulp): |err| <= (1.5 k + 8) 2^-24 mag, plus the bias and the old output's
  // magnitudes in the same way, plus one ulp of a bf16 result.
  // The tensor-core form (from 3 rows, up to 8) takes the folded norm only (norm_unit), in
  // each of its shapes; the sums of squares of its warps' shares of k meet in shared memory.
  struct Shape {
    size_t m, n, k;
  } shapes[] = {{1, 4096, 4096}, {2, 1000, 896},  {3, 77, 264},   {4, 129, 2056},
                {1, 1, 8},       {2, 333, 14336}, {1, 28672, 64}, {8, 1000, 896},
                {5, 129, 2056},  {8, 4096, 4096}, {7, 33, 14336}};
  struct Form {
    OwnVariant v;
    int rt = 0, kw = 0;
  };
  std::vector<Form> forms = {{OwnVariant::automatic},  {OwnVariant::gemv_r1_u8},
                             {OwnVariant::gemv_r1_u4}, {OwnVariant::gemv_r2_u4},
                             {OwnVariant::gemv_r2_u8}, {OwnVariant::gemv_r2_u2},
                             {OwnVariant::mma}};
  for (int rt : {1, 2, 4})
    for (int kw : {8, 16}) forms.push_back({OwnVariant::mma, rt, kw});
  for (auto sh : shapes)
    for (auto ot : kTypes)
      for (const Form& form : forms)
        for (int mode = 0; mode < 4; ++mode) {
          const bool with_bias = mode & 1, acc = mode & 2;
          // Mode 1: the norm's weight folded into w (norm_unit): the scale alone, against
          // the twin with a weight of ones.
          const bool unit = mode == 1;
          const bool mma = form.v == OwnVariant::mma;
          if (form.v != OwnVariant::automatic && sh.n * sh.k > 2000000 && mode != 3 &&
              !(mma && unit))
            continue;
          if (mma ? !unit : (form.v != OwnVariant::automatic || !unit) && sh.m > kMatmulGemvMaxRows)
            continue;  // a norm with its weight: the streaming form; mma: the folded one
          CAPTURE(sh.m);
          CAPTURE(sh.n);
          CAPTURE(sh.k);
          CAPTURE(std::string(dtype_name(ot)));
          CAPTURE(std::string(own_variant_name(form.v)));
          CAPTURE(form.rt);
          CAPTURE(form.kw);
          CAPTURE(with_bias);
          CAPTURE(acc);
          CAPTURE(unit);
          // A residual row with a large mean square, as a layer's are.
          auto a = as_stored(randoms(rng, sh.m * sh.k, -8, 8), DType::bf16);
          auto nw = as_stored(randoms(rng, sh.k, 0.5f, 1.5f), DType::bf16);
          if (unit) std::fill(nw.begin(), nw.end(), 1.0f);
          auto w = as_stored(randoms(rng, sh.n * sh.k, -1, 1), DType::bf16);
          auto bias = as_stored(randoms(rng, sh.n, -1, 1), DType::bf16);
          auto out0 = as_stored(randoms(rng, sh.m * sh.n, -1, 1), ot);
          const float eps = 1e-5f;
          auto ref = out0;
          matmul_norm_ref(a.data(), nw.data(), eps, w.data(), ref.data(), sh.m, sh.n, sh.k,
                          with_bias ? bias.data() : nullptr, acc, ot);
          auto da = to_dev(a, DType::bf16), dnw = to_dev(nw, DType::bf16),
               dw = to_dev(w, DType::bf16), db = to_dev(bias, DType::bf16);
          Dev dout = acc ? to_dev(out0, ot) : poisoned(sh.m * sh.n, ot);
          MatmulArgs args;
          args.a = da.get(), args.lda = sh.k, args.w = dw.get(), args.ldw = sh.k;
          args.out = dout.get(), args.out_dtype = ot, args.ldo = sh.n, args.m = sh.m;
          args.n = sh.n, args.k = sh.k, args.bias = with_bias ? db.get() : nullptr;
          args.accumulate = acc, args.norm_w = unit ? nullptr : dnw.get(), args.norm_eps = eps;
          args.norm_unit = unit;
          auto run = [&](const MatmulArgs& x) {
            return form.v == OwnVariant::automatic ? (*mm)->run(x, nullptr)
                   : mma ? matmul_own_mma_cuda_device(&x, 1, nullptr, form.rt, form.kw)
                         : matmul_own_group_cuda_device(&x, 1, nullptr, form.v);
          };
          set_programmatic_launch(mode == 3 || (mma && form.rt == 0));
          auto s = run(args);
          set_programmatic_launch(false);
          REQUIRE_MESSAGE(s.ok(), s.message());
          REQUIRE(cuda_synchronize().ok());
          auto got = from_dev(dout);
          std::vector<double> rinv(sh.m);
          for (size_t i = 0; i < sh.m; ++i) {
            double ss = 0;
            for (size_t t = 0; t < sh.k; ++t)
              ss += static_cast<double>(a[i * sh.k + t]) * a[i * sh.k + t];
            rinv[i] = 1.0 / std::sqrt(ss / static_cast<double>(sh.k) + eps);
          }
          auto bound = [&](size_t idx) {
            const size_t i = idx / sh.n, j = idx % sh.n;
            double mag = 0;
            for (size_t t = 0; t < sh.k; ++t)
              mag += std::fabs(static_cast<double>(a[i * sh.k + t]) * nw[t] * w[j * sh.k + t]);
            mag *= rinv[i];
            double rest = 0;
            if (with_bias) rest += std::fabs(bias[j]);
            if (acc) rest += std::fabs(out0[idx]);
            return (1.5 * static_cast<double>(sh.k) + 8) * 0x1p-24 * (mag + rest) +
                   (ot == DType::bf16 ? bf16_ulp(ref[idx]) : 0.0);
          };
          check_products(got, ref, sh.m * sh.n, bound);
          double err = 0;

          // SwiGLU over the normalised input: a [gate | up] weight of 2 n rows.
          if (acc || sh.n * sh.k > 20000000 || (mma && sh.n * sh.k > 2000000)) continue;
          auto wgu = as_stored(randoms(rng, 2 * sh.n * sh.k, -1, 1), DType::bf16);
          auto bgu = as_stored(randoms(rng, 2 * sh.n, -1, 1), DType::bf16);
          std::vector<float> gu(sh.m * 2 * sh.n), yref(sh.m * sh.n);
          matmul_norm_ref(a.data(), nw.data(), eps, wgu.data(), gu.data(), sh.m, 2 * sh.n, sh.k,
                          with_bias ? bgu.data() : nullptr, false, ot);
          swiglu_ref(gu.data(), yref.data(), sh.m, sh.n);
          for (auto& f : yref) f = round_to(ot, f);
          auto dwgu = to_dev(wgu, DType::bf16), dbgu = to_dev(bgu, DType::bf16);
          auto dy = poisoned(sh.m * sh.n, ot);
          MatmulArgs x = args;
          x.w = dwgu.get(), x.out = dy.get(), x.accumulate = false, x.swiglu = true;
          x.bias = with_bias ? dbgu.get() : nullptr;
          s = run(x);
          REQUIRE_MESSAGE(s.ok(), s.message());
          REQUIRE(cuda_synchronize().ok());
          auto gy = from_dev(dy);
          auto mag_of = [&](size_t i, size_t row) {
            double mag = 0;
            for (size_t t = 0; t < sh.k; ++t)
              mag += std::fabs(static_cast<double>(a[i * sh.k + t]) * nw[t] * wgu[row * sh.k + t]);
            return mag * rinv[i] + (with_bias ? std::fabs(bgu[row]) : 0.0);
          };
          auto sbound = [&](size_t idx) {
            const size_t i = idx / sh.n, j = idx % sh.n, n = sh.n;
            const double g = gu[i * 2 * n + j], u = gu[i * 2 * n + n + j];
            const double f = (1.5 * static_cast<double>(sh.k) + 8) * 0x1p-24;
            const double eg = f * mag_of(i, j) + (ot == DType::bf16 ? bf16_ulp(g) : 0.0);
            const double eu = f * mag_of(i, n + j) + (ot == DType::bf16 ? bf16_ulp(u) : 0.0);
            const double silu = g / (1 + std::exp(-g));
            return 1.1 * std::fabs(u) * eg + std::fabs(silu) * eu + 1e-6 * std::fabs(yref[idx]) +
                   (ot == DType::bf16 ? 2 * bf16_ulp(yref[idx]) : 0.0);
          };
          CHECK(outside(gy, yref, sbound, &err) == 0);
        }
  // The norm needs the streaming form, and says so.
  auto da = DeviceBuf<bf16_bits>::from(std::vector<bf16_bits>(8 * 64, 0));
  auto dw = DeviceBuf<bf16_bits>::from(std::vector<bf16_bits>(64 * 64, 0));
  auto dnw = DeviceBuf<bf16_bits>::from(std::vector<bf16_bits>(64, 0));
  auto dy = DeviceBuf<bf16_bits>::poisoned(8 * 64);
  MatmulArgs m;
  m.a = da.get(), m.lda = 64, m.w = dw.get(), m.ldw = 64, m.out = dy.get(), m.ldo = 64;
  m.m = 2, m.n = 64, m.k = 64, m.norm_w = dnw.get(), m.norm_eps = 1e-5f;
  CHECK(matmul_own_group_cuda_device(&m, 1, nullptr, OwnVariant::mma)
            .message()
            .find("streaming form") != std::string::npos);
  m.m = 8;
  CHECK((*mm)->run(m, nullptr).message().find("at most 4 rows") != std::string::npos);
  m.m = 2, m.norm_eps = -1;
  CHECK((*mm)->run(m, nullptr).message().find("norm eps") != std::string::npos);
  REQUIRE(cuda_synchronize().ok());
}

namespace {

// One case of the q/k/v products with RoPE and the KV write in their epilogue against the
// reference: the q/k/v group in `form`, then rope (with its per-head norms where asked) and
// its KV write. The epilogue must give their bits in q, k, v and both caches, written slots
// and skipped ones (outside the pool) alike.
struct QkvRopeCase {
  int nh, nkv, hd;
  size_t k, m;
  DType t, ct;  // outputs, cache
  bool bias = false, pdl = false;
  int in_norm = 0;  // the input norm inside the products: 0 none, 1 with its weight, 2 folded
  bool q_norm = false, k_norm = false;
  OwnVariant form = OwnVariant::gemv_r2_u4;
};

void qkv_rope_case(std::mt19937& rng, const QkvRopeCase& c) {
  CAPTURE(c.nh);
  CAPTURE(c.hd);
  CAPTURE(c.m);
  CAPTURE(c.k);
  CAPTURE(std::string(dtype_name(c.t)));
  CAPTURE(std::string(dtype_name(c.ct)));
  CAPTURE(c.bias);
  CAPTURE(c.pdl);
  CAPTURE(c.in_norm);
  CAPTURE(c.q_norm);
  CAPTURE(c.k_norm);
  test::gpu::QkvRopeIo io(rng, c.nh, c.nkv, c.hd, c.m, c.t, c.ct);
  const size_t* width = io.width;
  auto da = to_dev(as_stored(randoms(rng, c.m * c.k, -1, 1), DType::bf16), DType::bf16);
  auto dnw = to_dev(as_stored(randoms(rng, c.k, 0.5f, 1.5f), DType::bf16), DType::bf16);
  std::vector<Dev> dw, db;
  for (int i = 0; i < 3; ++i) {
    dw.push_back(
        to_dev(as_stored(randoms(rng, width[i] * c.k, -0.5f, 0.5f), DType::bf16), DType::bf16));
    db.push_back(to_dev(as_stored(randoms(rng, width[i], -1, 1), DType::bf16), DType::bf16));
  }
  using Out = test::gpu::QkvRopeIo::Out;
  auto parts_for = [&](Out& o, MatmulArgs* a) {
    for (int i = 0; i < 3; ++i) {
      a[i] = MatmulArgs{};
      a[i].a = da.get(), a[i].lda = c.k, a[i].w = dw[static_cast<size_t>(i)].get();
      a[i].ldw = c.k, a[i].out = o.y[i].get(), a[i].out_dtype = c.t, a[i].ldo = width[i];
      a[i].m = c.m, a[i].n = width[i], a[i].k = c.k;
      a[i].bias = c.bias ? db[static_cast<size_t>(i)].get() : nullptr;
      if (c.in_norm == 1) a[i].norm_w = dnw.get(), a[i].norm_eps = 1e-5f;
      if (c.in_norm == 2) a[i].norm_unit = true, a[i].norm_eps = 1e-5f;
    }
  };
  io.compare<MatmulArgs>(
      c.pdl, c.q_norm, c.k_norm, parts_for,
      [&](const MatmulArgs* a) { return matmul_own_group_cuda_device(a, 3, nullptr, c.form); },
      [](const MatmulArgs* a, const RopeArgs& r) {
        return matmul_qkv_rope_cuda_device(a, r, nullptr);
      });
}

}  // namespace

TEST_CASE(
    "gpu own kernel: q/k/v with the per-head norms (Qwen3), RoPE and the KV write in the "
    "epilogue, bit for bit") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("qkv head norms"));
  auto lim = cuda_device_limits();
  REQUIRE(lim.ok());
  const bool takes = matmul_qkv_rope_head_norms(1, 128);
  CHECK(takes == (lim->cluster_launch && cuda_hopper_paths(lim->cc_major, false)));
  CHECK_FALSE(matmul_qkv_rope_head_norms(3, 128));  // the tensor-core form's rows
  CHECK_FALSE(matmul_qkv_rope_head_norms(1, 256));  // a cluster of 16 blocks
  CHECK_FALSE(matmul_qkv_rope_head_norms(1, 96));
  if (!takes) {
    MESSAGE("skipped: no thread block clusters on this GPU (the engine runs the RoPE kernel)");
    return;
  }
  struct Shape {
    int nh, nkv, hd;
    size_t k, m;
  } shapes[] = {{32, 4, 128, 2048, 1},  // Qwen3-30B-A3B
                {32, 8, 128, 4096, 2},  // Qwen3-8B, two rows
                {14, 2, 64, 896, 1},    // a cluster of 4 blocks
                {4, 2, 32, 64, 2},      // a cluster of 2
                {8, 8, 128, 64, 1}};
  for (const auto& sh : shapes)
    for (auto t : kTypes)
      for (int mode = 0; mode < 6; ++mode) {
        // The input norm: none (0, 3), with its weight (1, 4), folded (2, 5); 3-5 with bias,
        // programmatic launch and an fp8 cache; q_norm alone in mode 4, k_norm alone in 5.
        QkvRopeCase c{sh.nh,
                      sh.nkv,
                      sh.hd,
                      sh.k,
                      sh.m,
                      t,
                      mode >= 3   ? DType::e4m3
                      : mode == 1 ? DType::f32
                                  : DType::bf16};
        c.bias = c.pdl = mode >= 3;
        c.in_norm = mode % 3;
        c.q_norm = mode != 5, c.k_norm = mode != 4;
        qkv_rope_case(rng, c);
      }
}

TEST_CASE("gpu own kernel: q/k/v with RoPE and the KV write in the epilogue, bit for bit") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("qkv rope"));
  struct Shape {
    int nh, nkv, hd;
    size_t k, m;
  } shapes[] = {{32, 8, 128, 4096, 1}, {14, 2, 64, 896, 2}, {4, 4, 128, 64, 2},
                {2, 1, 256, 128, 1},   {3, 1, 512, 64, 3},  {8, 2, 16, 8, 4},
                {32, 8, 128, 4096, 8}, {14, 2, 64, 896, 5}, {8, 2, 16, 40, 8}};
  for (const auto& sh : shapes)
    for (auto t : kTypes)
      for (int mode = 0; mode < 8; ++mode) {
        // Modes 4 and 5: the input norm inside the products too (the reference group then
        // normalises as well); 6 and 7: the same norm with its weight folded (norm_unit).
        const bool norm = mode == 4 || mode == 5, unit = mode >= 6;
        if (norm && sh.m > kMatmulGemvMaxRows) continue;  // the streaming form's alone
        // Modes 0 and 6 write an fp8 (e4m3) cache; the others bf16 (1, 4, 5) or fp32.
        QkvRopeCase c{sh.nh,
                      sh.nkv,
                      sh.hd,
                      sh.k,
                      sh.m,
                      t,
                      mode == 0 || mode == 6 ? DType::e4m3
                      : (mode & 2)           ? DType::f32
                                             : DType::bf16};
        c.bias = mode & 1;
        c.pdl = mode == 3 || mode == 5;
        c.in_norm = norm ? 1 : unit ? 2 : 0;
        // The reference group runs the form the epilogue's launch runs: the streaming form
        // at 1-2 rows and for a norm with its weight, else the tensor-core form, whose
        // automatic shape is the same for the group and for the RoPE launch (one tile is 16
        // weight rows in both).
        c.form = sh.m <= 2 || norm ? OwnVariant::gemv_r2_u4 : OwnVariant::mma;
        qkv_rope_case(rng, c);
      }
  // What the epilogue does not take is refused, naming it.
  auto da = DeviceBuf<bf16_bits>::from(std::vector<bf16_bits>(2 * 64, 0));
  auto dw = DeviceBuf<bf16_bits>::from(std::vector<bf16_bits>(256 * 64, 0));
  auto y0 = DeviceBuf<bf16_bits>::poisoned(2 * 128), y1 = DeviceBuf<bf16_bits>::poisoned(2 * 64),
       y2 = DeviceBuf<bf16_bits>::poisoned(2 * 64), kc = DeviceBuf<bf16_bits>::poisoned(64 * 64),
       vc = DeviceBuf<bf16_bits>::poisoned(64 * 64), nw = DeviceBuf<bf16_bits>::poisoned(64);
  auto dpos = ints_to_dev(std::vector<int32_t>{1, 2}),
       dslot = ints_to_dev(std::vector<int32_t>{3, 4});
  auto dinv = DeviceBuf<float>::from(rope_inv_freq(64, 10000.0, {}));
  void* outs[3] = {y0.get(), y1.get(), y2.get()};
  const size_t widths[3] = {128, 64, 64};
  MatmulArgs a[3];
  for (int i = 0; i < 3; ++i) {
    a[i].a = da.get(), a[i].lda = 64, a[i].w = dw.get(), a[i].ldw = 64, a[i].out = outs[i];
    a[i].ldo = widths[i], a[i].m = 2, a[i].n = widths[i], a[i].k = 64;
  }
  RopeArgs r;
  r.q = y0.get(), r.q_stride = 128, r.n_heads = 2, r.k = y1.get(), r.k_stride = 64;
  r.n_kv_heads = 1, r.head_dim = 64, r.n_tokens = 2, r.positions = dpos.get();
  r.inv_freq = dinv.get(), r.k_cache = kc.get(), r.v_cache = vc.get(), r.cache_slots = 64;
  r.slots = dslot.get(), r.v = y2.get(), r.v_stride = 64;
  REQUIRE(matmul_qkv_rope_cuda_device(a, r, nullptr).ok());
  auto refused = [&](MatmulArgs* parts, const RopeArgs& rr, const char* why) {
    CAPTURE(why);
    auto st = matmul_qkv_rope_cuda_device(parts, rr, nullptr);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find(why) != std::string::npos);
  };
  RopeArgs normed = r;
  normed.q_norm = nw.get();
  auto st_mma = matmul_qkv_rope_cuda_device(a, normed, nullptr, OwnVariant::mma);
  REQUIRE_FALSE(st_mma.ok());
  CHECK(st_mma.message().find("per-head norms") != std::string::npos);
  MatmulArgs three[3] = {a[0], a[1], a[2]};
  for (auto& x : three) x.m = 3;
  RopeArgs normed3 = normed;
  normed3.n_tokens = 3;
  refused(three, normed3, "per-head norms need 1-2 rows");
  RopeArgs partial = r;
  partial.rotary_dim = 32;
  refused(a, partial, "partial rotary");
  RopeArgs tokens = r;
  tokens.n_tokens = 1;
  refused(a, tokens, "n_tokens");
  MatmulArgs swapped[3] = {a[0], a[2], a[1]};
  refused(swapped, r, "part 1 must write rope's k");
  RopeArgs nokv = r;
  nokv.k_cache = nullptr;
  refused(a, nokv, "KV write");
  MatmulArgs nine[3] = {a[0], a[1], a[2]};
  for (auto& x : nine) x.m = 9;
  RopeArgs r9 = r;
  r9.n_tokens = 9;
  refused(nine, r9, "at most 8 rows, not 9");
  auto st = matmul_qkv_rope_cuda_device(a, r, nullptr, OwnVariant::gemv_r1_u8);
  CHECK(st.message().find("RoPE shape is gemv r2 u4, not gemv r1 u8") != std::string::npos);
  MatmulArgs w4[3] = {a[0], a[1], a[2]};
  for (auto& x : w4) x.norm_w = nw.get(), x.norm_eps = 1e-5f;
  st = matmul_qkv_rope_cuda_device(w4, r, nullptr, OwnVariant::mma);
  CHECK(st.message().find("fold the weight") != std::string::npos);
  REQUIRE(cuda_synchronize().ok());
}

TEST_CASE("gpu own kernel: q/k/v products in one launch, SwiGLU in the epilogue, vs the twins") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("matmul_group"));
  // The same fp32 bound as the single products (gamma_k of sum|a w| plus one ulp of a bf16
  // output). SwiGLU: the twin rounds the [gate | up] products to the output type (matmul_ref)
  // and applies swiglu_ref; the kernel rounds the same values, so after silu(g) * u in fp32
  // (a few ulps) the two differ by what the products differ by, times |d y / d g| <= 1.1 |u|
  // and |d y / d u| = |silu(g)|, plus one ulp of the bf16 result.
  struct Shape {
    size_t m, k;
    size_t n[3];
  } shapes[] = {{1, 4096, {4096, 1024, 1024}}, {8, 512, {256, 64, 64}}, {3, 96, {40, 8, 8}},
                {5, 264, {1000, 17, 333}},     {2, 64, {16, 16, 16}},   {4, 2056, {14336, 9, 1}},
                {1, 14336, {4096, 128, 8}}};
  for (auto sh : shapes)
    for (auto ot : kTypes)
      for (bool with_bias : {false, true}) {
        CAPTURE(sh.m);
        CAPTURE(sh.k);
        CAPTURE(sh.n[0]);
        CAPTURE(std::string(dtype_name(ot)));
        CAPTURE(with_bias);
        auto a = as_stored(randoms(rng, sh.m * sh.k, -1, 1), DType::bf16);
        auto da = to_dev(a, DType::bf16);
        auto mag_of = [&](const std::vector<float>& w, const std::vector<float>& bias, size_t i,
                          size_t j) {
          double mag = 0;
          for (size_t t = 0; t < sh.k; ++t)
            mag += std::fabs(static_cast<double>(a[i * sh.k + t]) * w[j * sh.k + t]);
          return mag + (with_bias ? std::fabs(bias[j]) : 0.0);
        };
        // The group: three products of different widths in one launch.
        std::vector<std::vector<float>> w(3), bias(3), ref(3);
        std::vector<Dev> dw, db, dout;
        MatmulArgs parts[3];
        for (int p = 0; p < 3; ++p) {
          const size_t n = sh.n[p];
          w[p] = as_stored(randoms(rng, n * sh.k, -1, 1), DType::bf16);
          bias[p] = as_stored(randoms(rng, n, -1, 1), DType::bf16);
          ref[p].assign(sh.m * n, 0.f);
          matmul_ref(a.data(), w[p].data(), ref[p].data(), sh.m, n, sh.k,
                     with_bias ? bias[p].data() : nullptr, false, ot);
          dw.push_back(to_dev(w[p], DType::bf16));
          db.push_back(to_dev(bias[p], DType::bf16));
          dout.push_back(poisoned(sh.m * n, ot));
        }
        for (int p = 0; p < 3; ++p) {
          MatmulArgs& x = parts[p];
          x.a = da.get(), x.lda = sh.k, x.w = dw[p].get(), x.ldw = sh.k, x.out = dout[p].get();
          x.out_dtype = ot, x.ldo = sh.n[p], x.m = sh.m, x.n = sh.n[p], x.k = sh.k;
          x.bias = with_bias ? db[p].get() : nullptr;
        }
        const OwnVariant form = sh.m > kMatmulGemvMaxRows ? OwnVariant::mma
                                : with_bias               ? OwnVariant::gemv_r2_u4
                                                          : OwnVariant::automatic;
        CAPTURE(std::string(own_variant_name(form)));
        set_programmatic_launch(with_bias);
        auto s = matmul_own_group_cuda_device(parts, 3, nullptr, form);
        set_programmatic_launch(false);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(cuda_synchronize().ok());
        for (int p = 0; p < 3; ++p) {
          CAPTURE(p);
          auto got = from_dev(dout[p]);
          double err = 0;
          auto bound = [&](size_t idx) {
            return static_cast<double>(sh.k + 2) * 0x1p-24 *
                       mag_of(w[p], bias[p], idx / sh.n[p], idx % sh.n[p]) +
                   (ot == DType::bf16 ? bf16_ulp(ref[p][idx]) : 0.0);
          };
          CHECK(outside(got, ref[p], bound, &err) == 0);
        }

        // SwiGLU: a [gate | up] weight of 2 n rows, n = the first width.
        const size_t n = sh.n[0];
        auto wgu = as_stored(randoms(rng, 2 * n * sh.k, -1, 1), DType::bf16);
        auto bgu = as_stored(randoms(rng, 2 * n, -1, 1), DType::bf16);
        std::vector<float> gu(sh.m * 2 * n), yref(sh.m * n);
        matmul_ref(a.data(), wgu.data(), gu.data(), sh.m, 2 * n, sh.k,
                   with_bias ? bgu.data() : nullptr, false, ot);
        swiglu_ref(gu.data(), yref.data(), sh.m, n);
        for (auto& f : yref) f = round_to(ot, f);
        auto dwgu = to_dev(wgu, DType::bf16), dbgu = to_dev(bgu, DType::bf16);
        auto dy = poisoned(sh.m * n, ot);
        MatmulArgs x;
        x.a = da.get(), x.lda = sh.k, x.w = dwgu.get(), x.ldw = sh.k, x.out = dy.get();
        x.out_dtype = ot, x.ldo = n, x.m = sh.m, x.n = n, x.k = sh.k, x.swiglu = true;
        x.bias = with_bias ? dbgu.get() : nullptr;
        s = matmul_own_group_cuda_device(&x, 1, nullptr, form);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(cuda_synchronize().ok());
        auto got = from_dev(dy);
        double err = 0;
        auto bound = [&](size_t idx) {
          const size_t i = idx / n, j = idx % n;
          const double g = gu[i * 2 * n + j], u = gu[i * 2 * n + n + j];
          const double eg = static_cast<double>(sh.k + 2) * 0x1p-24 * mag_of(wgu, bgu, i, j) +
                            (ot == DType::bf16 ? bf16_ulp(g) : 0.0);
          const double eu = static_cast<double>(sh.k + 2) * 0x1p-24 * mag_of(wgu, bgu, i, n + j) +
                            (ot == DType::bf16 ? bf16_ulp(u) : 0.0);
          const double silu = g / (1 + std::exp(-g));
          return 1.1 * std::fabs(u) * eg + std::fabs(silu) * eu + 1e-6 * std::fabs(yref[idx]) +
                 (ot == DType::bf16 ? 2 * bf16_ulp(yref[idx]) : 0.0);
        };
        CHECK(outside(got, yref, bound, &err) == 0);
        MESSAGE("own group m " << sh.m << " k " << sh.k << " " << dtype_name(ot)
                               << ": swiglu max err " << err);
      }
  // The engine's rule for a group: own for decode rows on up to 32 Mi weight elements.
  CHECK(matmul_group_prefers_own(1, 6u << 22));
  CHECK(!matmul_group_prefers_own(9, 6u << 22));
  CHECK(matmul_group_prefers_own(1, 117u << 20));
  CHECK(!matmul_group_prefers_own(3, 117u << 20));
  MatmulArgs bad;
  CHECK(matmul_own_group_cuda_device(&bad, 4, nullptr).message().find("group of 4") !=
        std::string::npos);
}

TEST_CASE("gpu device limits: queried, checked before launches, the device selected at start") {
  if (test::skip_without_cuda()) return;
  auto l = cuda_device_limits();
  REQUIRE_MESSAGE(l.ok(), l.error().message);
  MESSAGE(describe_device(*l) << ": " << l->sm_count << " SMs, " << l->smem_per_block_optin
                              << " bytes shared memory per block (opt-in), L2 " << l->l2_bytes);
  CHECK(l->sm_count > 0);
  CHECK(l->smem_per_block_optin >= l->smem_per_block);
  CHECK(l->smem_per_block >= 48 * 1024);
  auto sel = cuda_select_device(l->device);
  CHECK_MESSAGE(sel.ok(), sel.message());
  auto big = cuda_check_launch("test_kernel", 128, l->smem_per_block_optin + 1);
  CHECK(big.code() == Errc::resource);
  CHECK(big.message().find("test_kernel") != std::string::npos);
  CHECK(big.message().find("shared memory") != std::string::npos);
  CHECK(big.message().find(l->name) != std::string::npos);
  CHECK(cuda_check_launch("test_kernel", 4096, 0).message().find("threads") != std::string::npos);
  CHECK(cuda_check_launch("test_kernel", 256, 1024).ok());
}

TEST_CASE("gpu sampler masks: structured outputs' allowed ids, as the CPU twin draws them") {
  // Rows with masks (one allowed id, a few, half) and rows without (mask all ones), every
  // parameter mix, f32 and bf16 logits: the device draws sample_ref's token with the same
  // mask, and never an excluded id.
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("gpu_sampler_masks"));
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int V : {1000, 151936}) {
      const int rows = 12;
      const size_t words = (static_cast<size_t>(V) + 31) / 32;
      std::vector<float> logits(static_cast<size_t>(rows) * V);
      std::vector<uint32_t> mask(static_cast<size_t>(rows) * words, 0u);
      std::vector<SampleParams> ps(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        auto l = test::sample_row(rng, V, r % test::kSampleRowKindCount);
        if (dt == DType::bf16)
          for (auto& v : l) v = bf16_to_float(float_to_bf16(v));
        std::copy(l.begin(), l.end(), logits.begin() + static_cast<ptrdiff_t>(r) * V);
        uint32_t* m = mask.data() + static_cast<size_t>(r) * words;
        const int density = r % 4 == 0 ? 0 : r % 4 == 1 ? 1 : r % 4 == 2 ? 50 : 100;
        int allowed = 0;
        for (int i = 0; i < V; ++i)
          if (density == 100 ||
              (density == 0 ? i == (r * 37) % V : static_cast<int>(rng() % 100) < density))
            m[i >> 5] |= 1u << (i & 31), ++allowed;
        if (allowed == 0) m[0] |= 1u, allowed = 1;
        ps[static_cast<size_t>(r)] = test::sample_mix((r * 29) % test::kSampleMixCount, V, rng());
        if (ps[static_cast<size_t>(r)].top_k >= allowed) ps[static_cast<size_t>(r)].top_k = 0;
      }
      auto dl = to_dev(logits, dt);
      auto dparams = DeviceBuf<SampleParams>::from(ps);
      auto dmask = DeviceBuf<uint32_t>::from(mask);
      auto dres = DeviceBuf<SampleResult>::poisoned(static_cast<size_t>(rows));
      auto ws = DeviceMemory::allocate(sample_workspace_bytes(rows, V));
      REQUIRE(ws.ok());
      SampleBatch b;
      b.logits_dtype = dt;
      b.logits = dl.get(), b.logits_stride = static_cast<size_t>(V), b.vocab = V, b.rows = rows;
      b.params = dparams.get();
      b.update_state = false;
      b.mask = dmask.get(), b.mask_words = words;
      b.results = dres.get();
      b.workspace = ws->get(), b.workspace_bytes = ws->size();
      auto s = sample_cuda_device(b, nullptr);
      REQUIRE_MESSAGE(s.ok(), s.message());
      REQUIRE(cuda_synchronize().ok());
      auto res = dres.host();
      for (int r = 0; r < rows; ++r) {
        CAPTURE(V);
        CAPTURE(r);
        const uint32_t* m = mask.data() + static_cast<size_t>(r) * words;
        const auto want = sample_ref(logits.data() + static_cast<size_t>(r) * V, V,
                                     ps[static_cast<size_t>(r)], nullptr, nullptr, m);
        CHECK(sample_allowed(m, res[static_cast<size_t>(r)].token));
        CHECK(res[static_cast<size_t>(r)].token == want.token);
      }
    }
  }
}
