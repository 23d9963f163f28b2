// MXFP4 weights (kernels/mxfp4.h): the widening twin against values built here from the
// format's definition; the expert products' twin over MXFP4 experts against the same twin
// over those weights widened to float (plain experts and gpt-oss's options, a rank's slice of
// the experts, several rows); and the MXFP4 fields' checks.
#include "kernels/mxfp4.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/moe.h"
#include "support/moe_mxfp4_weights.h"

using namespace spark;
using namespace spark::kernels;

TEST_CASE("mxfp4 widen twin: codes packed low nibble first, times 2^(scale - 127)") {
  // The sixteen codes' values from the format: sign bit 3, exponent bits 2-1 (bias 1),
  // mantissa bit 0; exponent 0 is the subnormal 0 or 0.5.
  const double mags[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  for (int c = 0; c < 16; ++c) {
    CAPTURE(c);
    const double want = (c & 8) ? -mags[c & 7] : mags[c & 7];
    CHECK(mxfp4_e2m1_value(static_cast<uint8_t>(c)) == want);
  }
  CHECK(std::signbit(mxfp4_e2m1_value(8)));  // -0
  CHECK(mxfp4_scale_value(127) == 1.0);
  CHECK(mxfp4_scale_value(0) == std::ldexp(1.0, -127));
  CHECK(mxfp4_scale_value(130) == 8.0);
  CHECK(std::isnan(mxfp4_scale_value(0xff)));

  // A [5][96] weight read from row 1 (rows 1-3), padded rows and scale rows, into a padded
  // output: every value from a code and exponent chosen here.
  std::mt19937 rng(20261205);
  const size_t rows = 5, k = 96, ldb = k / 2 + 16, lds = k / 32 + 2, ldo = k + 5;
  std::vector<uint8_t> blocks(rows * ldb, 0x77), scales(rows * lds, 0xff);
  std::vector<double> want(rows * k);
  std::uniform_int_distribution<int> code(0, 15), sexp(100, 150);
  std::vector<int> sc(rows * (k / 32));
  for (size_t r = 0; r < rows; ++r)
    for (size_t b = 0; b < k / 32; ++b) {
      // Each block's scale: a random exponent, the extremes 0 (2^-127) and 1 in two blocks.
      int s = sexp(rng);
      if (r == 1 && b == 0) s = 0;
      if (r == 2 && b == 2) s = 1;
      sc[r * (k / 32) + b] = s;
      scales[r * lds + b] = static_cast<uint8_t>(s);
    }
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < k; ++c) {
      const int v = code(rng);
      // Column c: byte c / 2, the low nibble for even c, the high nibble for odd c.
      uint8_t& byte = blocks[r * ldb + c / 2];
      byte = c % 2 == 0 ? static_cast<uint8_t>((byte & 0xf0) | v)
                        : static_cast<uint8_t>((byte & 0x0f) | v << 4);
      const double mag = mags[v & 7] * std::pow(2.0, sc[r * (k / 32) + c / 32] - 127);
      want[r * k + c] = (v & 8) ? -mag : mag;
    }
  Mxfp4Weight w;
  w.blocks = blocks.data(), w.ldb = ldb, w.scales = scales.data(), w.lds = lds;
  std::vector<float> out(3 * ldo, -99.f);
  mxfp4_widen_ref(w, 1, 3, k, out.data(), ldo);
  size_t bad = 0, nonzero = 0;
  for (size_t r = 0; r < 3; ++r) {
    for (size_t c = 0; c < k; ++c) {
      const double wv = want[(r + 1) * k + c];
      bad += static_cast<double>(out[r * ldo + c]) != wv;  // exact
      nonzero += wv != 0;
    }
    for (size_t c = k; c < ldo; ++c) bad += out[r * ldo + c] != -99.f;  // padding untouched
  }
  CHECK(bad == 0);
  CHECK(nonzero > 200);
  // The smallest scale keeps 0.5 * 2^-127 exact (a float subnormal).
  CHECK(std::fabs(out[0]) <= std::ldexp(6.0, -127));
}

namespace {

// An IEEE fp16's value from its 16 bits, by the format's definition.
double fp16_value(uint32_t h) {
  const int e = static_cast<int>((h >> 10) & 0x1f), m = static_cast<int>(h & 0x3ff);
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000u) ? -mag : mag;
}

}  // namespace

TEST_CASE(
    "mxfp4 pair widening: codes k and k + 4 of a word as fp16, each the code's value * 2^-14") {
  // Every code in every position: word i holds codes (i + n) % 16 at nibble n, so each nibble
  // sees all sixteen; words with one code repeated and random words besides.
  std::vector<uint32_t> words;
  for (uint32_t i = 0; i < 16; ++i) {
    uint32_t w = 0, same = 0;
    for (uint32_t n = 0; n < 8; ++n) w |= ((i + n) % 16) << (4 * n), same |= i << (4 * n);
    words.push_back(w);
    words.push_back(same);
  }
  std::mt19937 rng(20261205);
  for (int i = 0; i < 256; ++i) words.push_back(static_cast<uint32_t>(rng()));
  size_t bad = 0;
  for (const uint32_t w : words)
    for (int k = 0; k < 4; ++k) {
      const uint32_t h = mxfp4_e2m1_pair_fp16(w, k);
      const auto code = [&](int n) { return static_cast<uint8_t>((w >> (4 * n)) & 0xf); };
      const double lo = fp16_value(h & 0xffff), hi = fp16_value(h >> 16);
      const double want_lo = std::ldexp(static_cast<double>(mxfp4_e2m1_value(code(k))), -14);
      const double want_hi = std::ldexp(static_cast<double>(mxfp4_e2m1_value(code(k + 4))), -14);
      bad += lo != want_lo || hi != want_hi;
      // The sign of -0 too: the kernels' products keep it as the float twin does.
      bad +=
          std::signbit(lo) != ((code(k) & 8) != 0) || std::signbit(hi) != ((code(k + 4) & 8) != 0);
    }
  CHECK(bad == 0);
  CHECK(words.size() > 250);
  CHECK(kMxfp4Fp16Unscale == std::ldexp(1.f, 14));
}

TEST_CASE("mxfp4 eight-code widening: every code of a word as fp16 in the mma's pairs") {
  std::vector<uint32_t> words;
  for (uint32_t i = 0; i < 16; ++i) {
    uint32_t w = 0;
    for (uint32_t n = 0; n < 8; ++n) w |= ((i + n) % 16) << (4 * n);
    words.push_back(w);
  }
  std::mt19937 rng(20261206);
  for (int i = 0; i < 256; ++i) words.push_back(static_cast<uint32_t>(rng()));
  // h[j] holds codes pair[j][0] (low half) and pair[j][1] (high half).
  const int pair[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
  size_t bad = 0;
  for (const uint32_t w : words) {
    uint32_t h[4];
    mxfp4_e2m1x8_fp16(w, h);
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        const auto code = static_cast<uint8_t>((w >> (4 * pair[j][half])) & 0xf);
        const double got = fp16_value(half ? h[j] >> 16 : h[j] & 0xffff);
        bad += got != std::ldexp(static_cast<double>(mxfp4_e2m1_value(code)), -14);
        bad += std::signbit(got) != ((code & 8) != 0);
      }
  }
  CHECK(bad == 0);
}

namespace {

struct Mx4TwinCase {
  int rows, top_k, hidden, inter, experts, expert0, held, shared;
  bool accumulate, gptoss;
};

// The twin over MXFP4 experts (host codes and scale bytes) against the twin over the same
// weights widened to float: the widening is exact, so the sums are the same numbers in the same
// order and the outputs equal bit for bit.
void check_mx4_twin(std::mt19937& rng, const Mx4TwinCase& c) {
  CAPTURE(c.rows);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.expert0);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  CAPTURE(c.gptoss);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  // gpt-oss: gate/up products of a few units, so the limit of 7 clamps some.
  const float ws = (c.gptoss ? 12.f : 1.f) / std::sqrt(static_cast<float>(H));
  const float wd = 1.f / std::sqrt(static_cast<float>(I));
  const auto gu = test::make_mxfp4(rng, E * 2 * I, H, ws / 3);
  const auto dn = test::make_mxfp4(rng, E * H, I, wd / 3);
  std::uniform_real_distribution<float> u(-1.f, 1.f), wdist(0.05f, 1.f);
  auto fill = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& f : v) f = round_to(DType::bf16, scale * u(rng));
    return v;
  };
  const auto x = fill(R * H, 1.f), prior = fill(R * H, 2.f);
  const auto gub = fill(E * 2 * I, 2.f), db = fill(E * H, 1.f);
  const auto sgu = fill(2 * S * H, 1.f / std::sqrt(float(H)));
  const auto sdn = fill(H * S, 0.2f);
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  const auto gu_f = gu.widened(), dn_f = dn.widened();
  MoeExpertsArgs f;
  f.x = x.data(), f.ids = ids.data(), f.weights = w.data(), f.rows = c.rows, f.top_k = c.top_k;
  f.hidden = c.hidden, f.gate_up = gu_f.data(), f.down = dn_f.data(), f.expert0 = c.expert0;
  f.experts = c.held, f.inter = c.inter, f.accumulate = c.accumulate;
  f.shared_inter = c.shared, f.shared_gate_up = sgu.data(), f.shared_down = sdn.data();
  if (c.gptoss) {
    f.gate_up_bias = gub.data(), f.down_bias = db.data(), f.interleaved = true;
    f.swiglu_limit = 7.f, f.swiglu_alpha = 1.702f;
  }
  std::vector<float> want = prior, got = prior;
  f.out = want.data();
  moe_experts_ref(f);
  MoeExpertsArgs q = f;
  q.gate_up = nullptr, q.down = nullptr;  // not read with MXFP4 experts
  q.gate_up_mx4 = gu.weight(), q.down_mx4 = dn.weight();
  q.out = got.data();
  moe_experts_ref(q);
  size_t differ = 0, moved = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    differ += !(got[i] == want[i]);  // NaN (a padding scale read) differs too
    moved += want[i] != (c.accumulate ? prior[i] : 0.f);
  }
  CHECK(differ == 0);
  CHECK(moved > want.size() / 2);  // the experts did add something
  // And the MXFP4 experts are not the float twin's other weights: other codes, other outputs.
  auto gu2 = gu;
  for (auto& b : gu2.blocks) b = static_cast<uint8_t>(b << 4 | b >> 4);  // nibbles swapped
  q.gate_up_mx4 = gu2.weight();
  std::vector<float> swapped = prior;
  q.out = swapped.data();
  moe_experts_ref(q);
  size_t changed = 0;
  for (size_t i = 0; i < want.size(); ++i) changed += swapped[i] != want[i];
  CHECK(changed > want.size() / 2);
}

}  // namespace

TEST_CASE("moe experts twin: MXFP4 experts equal the float twin on the widened weights") {
  std::mt19937 rng(20261207);
  const Mx4TwinCase cases[] = {
      {3, 2, 64, 32, 6, 0, 6, 0, false, false},   // plain experts
      {4, 4, 96, 64, 8, 2, 4, 32, true, false},   // a rank's experts [2, 6), shared, residual
      {5, 4, 64, 32, 8, 0, 8, 0, true, true},     // gpt-oss: interleaved, biases, limit 7
      {6, 4, 128, 64, 12, 4, 4, 0, false, true},  // gpt-oss, experts [4, 8) of 12
      {3, 4, 64, 32, 8, 0, 8, 32, false, true},   // gpt-oss with plain shared experts
  };
  for (const auto& c : cases) check_mx4_twin(rng, c);
}

TEST_CASE("moe experts check: bad MXFP4 fields are refused, naming the field") {
  alignas(16) static uint8_t blocks[8192], sc[1024];
  alignas(16) static float fscales[64];
  alignas(16) static uint16_t x[256];
  alignas(16) static float work[8192];
  static int32_t ids[4];
  static float weights[4];
  MoeExpertsArgs a;
  a.x = x, a.ids = ids, a.weights = weights, a.out = x, a.rows = 1, a.top_k = 2;
  a.hidden = 96, a.inter = 64, a.experts = 4, a.shared_inter = 32;
  a.shared_gate_up = x, a.shared_down = x;  // bf16 shared experts
  a.workspace = work, a.workspace_bytes = sizeof work;
  a.gate_up_mx4.blocks = blocks, a.gate_up_mx4.ldb = 48, a.gate_up_mx4.scales = sc;
  a.gate_up_mx4.lds = 3;
  a.down_mx4.blocks = blocks, a.down_mx4.ldb = 32, a.down_mx4.scales = sc, a.down_mx4.lds = 2;
  REQUIRE_MESSAGE(moe_experts_check(a).ok(), moe_experts_check(a).message());
  auto refused = [&](MoeExpertsArgs b, const std::string& what) {
    const auto s = moe_experts_check(b);
    CHECK_FALSE(s.ok());
    CHECK_MESSAGE(s.message().find(what) != std::string::npos, s.message());
  };
  {
    auto b = a;
    b.gate_up_mx4.ldb = 32;  // 96 columns need 48 bytes
    refused(b, "gate_up_mx4: ldb 32");
  }
  {
    auto b = a;
    b.down_mx4.lds = 1;  // 64 columns need 2 scales
    refused(b, "down_mx4: lds 1");
  }
  {
    auto b = a;
    b.down_mx4.blocks = blocks + 8;  // not 16-byte aligned
    refused(b, "down_mx4: blocks and ldb");
  }
  {
    auto b = a;
    b.gate_up_mx4.ldb = 56;  // >= 48 bytes, not a multiple of 16
    refused(b, "gate_up_mx4: blocks and ldb");
  }
  {
    auto b = a;
    b.down_mx4.scales = nullptr;
    refused(b, "down_mx4: null");
  }
  {
    auto b = a;
    b.down_mx4 = Mxfp4Weight{};  // gate/up MXFP4 without its down
    refused(b, "down_mx4");
  }
  {
    auto b = a;
    b.hidden = 80, b.gate_up_mx4.ldb = 48;  // a multiple of 8, not of 32
    refused(b, "multiples of 32");
  }
  {
    auto b = a;  // both formats
    Fp8Weight f;
    f.q = blocks, f.ldq = 96, f.scales = fscales, f.scale_ld = 1, f.row_shift = 0;
    b.gate_up_fp8 = f, f.ldq = 64, b.down_fp8 = f;
    refused(b, "one format");
  }
  {
    auto b = a;  // FP8 shared experts beside MXFP4 routed ones
    Fp8Weight f;
    f.q = blocks, f.ldq = 96, f.scales = fscales, f.scale_ld = 1, f.row_shift = 0;
    b.shared_gate_up_fp8 = f, f.ldq = 32, b.shared_down_fp8 = f;
    refused(b, "one format");
  }
}
