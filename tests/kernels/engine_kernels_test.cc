// Reference twins used by the engine: RoPE frequencies and rotation, paged attention.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/paged_attention.h"
#include "kernels/rope.h"

using namespace spark::kernels;

TEST_CASE("rope: llama3 scaling keeps high frequencies, divides low ones, blends the middle") {
  spark::hf::RopeScaling s;
  s.type = "llama3";
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position = 128;  // high band: wavelength < 32; low band: > 128
  auto plain = rope_inv_freq(16, 500000.0, {});
  auto scaled = rope_inv_freq(16, 500000.0, s);
  REQUIRE(scaled.size() == 8);
  CHECK(scaled[0] == plain[0]);                                     // wavelength 6.3
  CHECK(scaled[7] == doctest::Approx(plain[7] / 8).epsilon(1e-6));  // very long wavelength
  const double wl1 = 2 * M_PI / plain[1];                           // 32.5: in the blend band
  REQUIRE(wl1 > 32);
  REQUIRE(wl1 < 128);
  const double smooth = (128 / wl1 - 1) / 3;
  CHECK(scaled[1] ==
        doctest::Approx((1 - smooth) * plain[1] / 8 + smooth * plain[1]).epsilon(1e-6));
  spark::hf::RopeScaling lin;
  lin.type = "linear";
  lin.factor = 4;
  CHECK(rope_inv_freq(16, 10000.0, lin)[3] ==
        doctest::Approx(rope_inv_freq(16, 10000.0, {})[3] / 4));
}

TEST_CASE("rope: rotation pairs element i with i + head_dim/2 and keeps the norm") {
  std::vector<float> x = {1, 0, 0, 0, 0, 1, 0, 0};  // one head of 8
  auto inv = rope_inv_freq(8, 10000.0, {});
  int32_t pos = 3;
  rope_apply_ref(x.data(), 1, 1, 8, &pos, inv.data());
  CHECK(x[0] == doctest::Approx(std::cos(3.0)));
  CHECK(x[4] == doctest::Approx(std::sin(3.0)));
  double n1 = x[1] * x[1] + x[5] * x[5];
  CHECK(n1 == doctest::Approx(1.0));
  int32_t zero = 0;
  std::vector<float> y = {0.5f, -1, 2, 3, 4, 5, 6, 7};
  auto y0 = y;
  rope_apply_ref(y.data(), 1, 1, 8, &zero, inv.data());
  CHECK(y == y0);  // position 0 is the identity
}

TEST_CASE("paged attention: equals contiguous attention, GQA and sliding window included") {
  const int bs = 2, nkv = 1, hd = 2, nh = 2, T = 5, blocks = 4;
  std::vector<float> kpool(blocks * bs * nkv * hd, 0), vpool(kpool.size(), 0);
  PagedKVLayer kv{kpool.data(), vpool.data(), bs, nkv, hd};
  std::vector<int32_t> table = {3, 0, 2};  // positions 0-1 -> block 3, 2-3 -> block 0, 4 -> block 2
  std::vector<int32_t> pos = {0, 1, 2, 3, 4};
  std::vector<float> k(T * hd), v(T * hd), q(T * nh * hd);
  for (int i = 0; i < T * hd; ++i) {
    k[i] = std::sin(0.7f * i);
    v[i] = std::cos(0.3f * i) + 0.1f * i;
  }
  for (int i = 0; i < T * nh * hd; ++i) q[i] = std::sin(1.3f * i + 0.2f);
  paged_kv_write_ref(kv, table.data(), pos.data(), T, k.data(), v.data());
  for (int window : {0, 2}) {
    CAPTURE(window);
    std::vector<float> out(q.size());
    paged_attention_ref(kv, table.data(), pos.data(), T, nh, q.data(), out.data(), 0.5f, window);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nh; ++h) {
        const int first = window ? std::max(0, t - window + 1) : 0;
        double mx = -1e30, sum = 0;
        std::vector<double> s;
        for (int u = first; u <= t; ++u) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += q[(t * nh + h) * hd + i] * k[u * hd + i];
          s.push_back(d * 0.5);
          mx = std::max(mx, d * 0.5);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int i = 0; i < hd; ++i) {
          double acc = 0;
          for (int u = first; u <= t; ++u) acc += s[u - first] / sum * v[u * hd + i];
          CHECK(out[(t * nh + h) * hd + i] == doctest::Approx(acc).epsilon(1e-5));
        }
      }
  }
}

TEST_CASE("decode split plan: the used splits tile [first, ctx) exactly, within the cap") {
  // Every (context, window, cap) the kernel can meet at small sizes, and a sweep of long ones.
  auto check = [](int ctx, int window, int cap) {
    CAPTURE(ctx);
    CAPTURE(window);
    CAPTURE(cap);
    const DecodeSplitPlan p = attention_decode_plan(ctx, window, cap);
    const int first = window > 0 ? std::max(0, ctx - window) : 0;
    REQUIRE(p.first == first);
    REQUIRE(p.used >= 1);
    REQUIRE(p.used <= cap);
    REQUIRE(p.chunk % kDecodeMinChunk == 0);
    // Split s covers [first + s*chunk, min(ctx, first + (s+1)*chunk)): non-empty, and the
    // union is [first, ctx) with nothing twice.
    CHECK(first + (p.used - 1) * p.chunk < ctx);
    CHECK(first + p.used * p.chunk >= ctx);
    // No coarser than needed: one minimum chunk fewer per split would not fit the cap.
    if (p.chunk > kDecodeMinChunk)
      CHECK((ctx - first + p.chunk - kDecodeMinChunk - 1) / (p.chunk - kDecodeMinChunk) > cap);
  };
  for (int ctx = 1; ctx <= 700; ++ctx)
    for (int window : {0, 1, 5, 64, 65, 300})
      for (int cap : {1, 2, 3, 7, 64}) check(ctx, window, cap);
  for (int ctx : {4095, 4096, 4097, 32768, 131072, 1 << 20})
    for (int cap : {1, 5, 64}) check(ctx, 0, cap);
  CHECK(attention_decode_plan(0, 0, 4).used == 0);

  // The cap: enough slots for the target number of blocks, never more than the bound uses.
  CHECK(attention_decode_split_cap(1, 8, 33792) == kDecodeTargetBlocks / 8);
  CHECK(attention_decode_split_cap(8, 8, 4096) == kDecodeTargetBlocks / 64);
  CHECK(attention_decode_split_cap(64, 8, 4096) == 1);
  CHECK(attention_decode_split_cap(1, 1, 1 << 20) == kDecodeMaxSplits);
  CHECK(attention_decode_split_cap(1, 8, 100) == 2);  // 100 positions fill two chunks at most
  CHECK(attention_decode_split_cap(3, 0, 100) == 1);
  for (int n = 1; n <= 300; ++n)
    for (int kvb : {1, 2, 8, 40}) {
      const int cap = attention_decode_split_cap(n, kvb, 1 << 16);
      CHECK(cap >= 1);
      CHECK(cap <= attention_decode_split_cap(n, 1, 1 << 16));  // sizes the workspace
    }
}

TEST_CASE("decode split twin: split-K with log-sum-exp merge equals plain attention (fp32)") {
  // Fresh random caches in shuffled blocks; GQA, windows, contexts around chunk edges.
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> U(-2, 2);
  struct Shape {
    int nh, nkv, hd, bs, ctx, window, cap;
  };
  const Shape shapes[] = {
      {4, 1, 8, 16, 1, 0, 64},       {4, 2, 16, 16, 63, 0, 64},  {4, 2, 16, 16, 64, 0, 64},
      {4, 2, 16, 16, 65, 0, 64},     {8, 2, 32, 8, 1000, 0, 3},  {8, 8, 24, 16, 2000, 700, 64},
      {32, 8, 128, 16, 4100, 0, 64}, {16, 1, 64, 32, 513, 0, 1}, {2, 1, 256, 16, 300, 100, 5},
  };
  for (const auto& sh : shapes) {
    CAPTURE(sh.nh);
    CAPTURE(sh.hd);
    CAPTURE(sh.ctx);
    CAPTURE(sh.window);
    CAPTURE(sh.cap);
    const int nblk = (sh.ctx + sh.bs - 1) / sh.bs;
    const size_t row = static_cast<size_t>(sh.nkv) * sh.hd;
    std::vector<float> kpool(static_cast<size_t>(nblk) * sh.bs * row), vpool(kpool.size());
    for (auto& f : kpool) f = U(rng);
    for (auto& f : vpool) f = U(rng);
    std::vector<int32_t> table(static_cast<size_t>(nblk));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    PagedKVLayer kv{kpool.data(), vpool.data(), sh.bs, sh.nkv, sh.hd};
    std::vector<float> q(static_cast<size_t>(sh.nh) * sh.hd), ref(q.size()), got(q.size(), NAN);
    for (auto& f : q) f = U(rng);
    const float scale = 1.f / std::sqrt(static_cast<float>(sh.hd));
    const int32_t pos = sh.ctx - 1;
    // Without sinks, then with gpt-oss's sinks (each head's logit joins the merged
    // denominator once, whatever the number of splits): some heads barely touched, some
    // dominated, one weighing nothing.
    std::vector<float> sinks(static_cast<size_t>(sh.nh));
    for (int h = 0; h < sh.nh; ++h) sinks[static_cast<size_t>(h)] = static_cast<float>(h % 8) - 2.f;
    sinks[0] = 6.f;
    sinks.back() = -1e30f;
    const float* const cases[] = {nullptr, sinks.data()};
    for (const float* sk : cases) {
      CAPTURE(sk != nullptr);
      paged_attention_ref(kv, table.data(), &pos, 1, sh.nh, q.data(), ref.data(), scale, sh.window,
                          sk);
      attention_decode_split_ref(kv, table.data(), sh.ctx, sh.nh, q.data(), got.data(), scale,
                                 sh.window, sh.cap, sk);
      // fp32 sums of up to a few thousand terms of |v| <= 2 against a double reference.
      double max_err = 0;
      for (size_t i = 0; i < ref.size(); ++i)
        max_err =
            std::isnan(got[i]) ? INFINITY : std::max(max_err, std::fabs(double(got[i]) - ref[i]));
      CHECK(max_err <= 2e-5 * 2);
    }
    // The sinks change head 0's output (sink 6, well above a typical row maximum).
    std::vector<float> plain(q.size());
    paged_attention_ref(kv, table.data(), &pos, 1, sh.nh, q.data(), plain.data(), scale, sh.window);
    double diff = 0;
    for (int i = 0; i < sh.hd; ++i)
      diff = std::max(diff, std::fabs(double(plain[static_cast<size_t>(i)]) - got[i]));
    CHECK(diff > 1e-3);
  }
}
