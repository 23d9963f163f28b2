// Reference twins used by the engine: RoPE frequencies and rotation, paged attention.
#include <doctest/doctest.h>

#include <cmath>
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
