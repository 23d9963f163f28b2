// The FP8 products' CPU twins and checks (kernels/fp8.h): the e4m3 decoder, the product
// against a plain widening of the weights (partial scale blocks, one scale row per weight
// row or per 128, bias, accumulate, SwiGLU), the dequantization's single rounding, and the
// argument errors, each naming what is wrong.
#include "kernels/fp8.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"

using namespace spark;
using namespace spark::kernels;

namespace {

double bf16_ulp_of(double r) {
  r = std::fabs(r);
  if (r < 0x1p-126) return 0x1p-133;
  return std::ldexp(1.0, std::ilogb(r) - 7);
}

// A random FP8 weight of `rows` x k with padded strides, no NaN codes.
struct HostFp8 {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  Fp8Weight w;
};

HostFp8 random_fp8(std::mt19937& rng, size_t rows, size_t k, int row_shift) {
  HostFp8 h;
  const size_t ldq = (k + 15) / 16 * 16 + 32, blocks = (k + 127) / 128, scale_ld = blocks + 1;
  const size_t srows = ((rows - 1) >> row_shift) + 1;
  h.q.resize(rows * ldq);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : h.q) {
    int c;
    do c = byte(rng);
    while ((c & 0x7f) == 0x7f);
    b = static_cast<uint8_t>(c);
  }
  std::uniform_real_distribution<float> sd(0.0005f, 0.004f);
  h.scales.resize(srows * scale_ld);
  for (auto& s : h.scales) s = sd(rng);
  h.w.q = h.q.data(), h.w.ldq = ldq, h.w.scales = h.scales.data(), h.w.scale_ld = scale_ld;
  h.w.row_shift = row_shift;
  return h;
}

// The weight as written out plainly: the code's value times the scale of its block.
double plain_weight(const HostFp8& h, size_t row, size_t col) {
  const size_t srow = row / (size_t{1} << h.w.row_shift), sblock = col / 128;
  return static_cast<double>(fp8_e4m3_value(h.q[row * h.w.ldq + col])) *
         h.scales[srow * h.w.scale_ld + sblock];
}

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = float_to_bf16(d(rng));
  return v;
}

}  // namespace

TEST_CASE("fp8 e4m3 decoder: the OCP e4m3fn values (no infinities, 0x7f and 0xff NaN)") {
  CHECK(fp8_e4m3_value(0x00) == 0.f);
  CHECK(std::signbit(fp8_e4m3_value(0x80)));
  CHECK(fp8_e4m3_value(0x01) == std::ldexp(1.f, -9));  // the smallest subnormal
  CHECK(fp8_e4m3_value(0x07) == 7 * std::ldexp(1.f, -9));
  CHECK(fp8_e4m3_value(0x08) == std::ldexp(1.f, -6));  // the smallest normal
  CHECK(fp8_e4m3_value(0x38) == 1.f);
  CHECK(fp8_e4m3_value(0x39) == 1.125f);
  CHECK(fp8_e4m3_value(0x7e) == 448.f);  // the largest
  CHECK(fp8_e4m3_value(0xfe) == -448.f);
  CHECK(std::isnan(fp8_e4m3_value(0x7f)));
  CHECK(std::isnan(fp8_e4m3_value(0xff)));
  // The positive codes in order, each value exactly 1/8 of its binade's step apart; the
  // negative codes mirror them.
  for (int c = 1; c < 0x7f; ++c) {
    CAPTURE(c);
    const float v = fp8_e4m3_value(static_cast<uint8_t>(c));
    const float prev = fp8_e4m3_value(static_cast<uint8_t>(c - 1));
    CHECK(v > prev);
    const int e = (c - 1) >> 3;  // the step is the lower code's binade's eighth
    CHECK(v - prev == std::ldexp(1.f, (e < 1 ? 1 : e) - 10));
    CHECK(fp8_e4m3_value(static_cast<uint8_t>(c | 0x80)) == -v);
  }
}

TEST_CASE("fp8 matmul twin: the product over plainly widened weights, bias, accumulate, swiglu") {
  std::mt19937 rng(20260);
  struct Case {
    size_t m, n, k;
    int row_shift;
  } cases[] = {{3, 37, 200, 0}, {2, 37, 208, 7},  {5, 37, 208, 0}, {1, 300, 256, 7},
               {4, 5, 16, 0},   {8, 140, 384, 7}, {1, 1, 144, 0}};
  for (const Case& c : cases)
    for (DType ot : {DType::f32, DType::bf16})
      for (int mode = 0; mode < 5; ++mode) {
        const bool with_bias = mode & 1, acc = mode == 2 || mode == 3, swiglu = mode == 4;
        CAPTURE(c.m);
        CAPTURE(c.n);
        CAPTURE(c.k);
        CAPTURE(c.row_shift);
        CAPTURE(std::string(dtype_name(ot)));
        CAPTURE(mode);
        const size_t wrows = swiglu ? 2 * c.n : c.n, lda = c.k + 8, ldo = c.n + 3;
        HostFp8 h = random_fp8(rng, wrows, c.k, c.row_shift);
        auto a = random_bf16(rng, c.m * lda, -1, 1);
        auto bias = random_bf16(rng, wrows, -0.5f, 0.5f);
        std::vector<float> o32(c.m * ldo);
        std::vector<uint16_t> o16(c.m * ldo);
        for (size_t i = 0; i < o32.size(); ++i) {
          o32[i] = std::uniform_real_distribution<float>(-1, 1)(rng);
          o16[i] = float_to_bf16(o32[i]);
        }
        const std::vector<float> prior32 = o32;
        const std::vector<uint16_t> prior16 = o16;
        Fp8MatmulArgs p;
        p.a = a.data(), p.lda = lda, p.w = h.w, p.out_dtype = ot, p.ldo = ldo;
        p.out = ot == DType::bf16 ? static_cast<void*>(o16.data()) : o32.data();
        p.m = c.m, p.n = c.n, p.k = c.k, p.bias = with_bias ? bias.data() : nullptr;
        p.accumulate = acc, p.swiglu = swiglu;
        // The twin takes any k; the device kernel (and so the check) multiples of 16.
        CHECK(fp8_matmul_check(p).ok() == (c.k % 16 == 0));
        fp8_matmul_ref(p);
        auto dot = [&](size_t i, size_t row, double* mag) {
          double s = 0;
          *mag = 0;
          for (size_t t = 0; t < c.k; ++t) {
            const double x = bf16_to_float(a[i * lda + t]) * plain_weight(h, row, t);
            s += x, *mag += std::fabs(x);
          }
          if (with_bias) s += bf16_to_float(bias[row]), *mag += std::fabs(bf16_to_float(bias[row]));
          return s;
        };
        size_t bad = 0;
        for (size_t i = 0; i < c.m; ++i) {
          for (size_t j = 0; j < c.n; ++j) {
            const size_t off = i * ldo + j;
            const double got = ot == DType::bf16 ? bf16_to_float(o16[off]) : o32[off];
            double want, bound, mg;
            if (swiglu) {
              double mu;
              const double g0 = dot(i, j, &mg), u0 = dot(i, c.n + j, &mu);
              const double g = round_to(ot, static_cast<float>(g0));
              const double u = round_to(ot, static_cast<float>(u0));
              want = g / (1 + std::exp(-g)) * u;
              // A sum within 1e-12 of a rounding boundary may round to the other side.
              const double eg = ot == DType::bf16 ? bf16_ulp_of(g) : 1e-6 * mg;
              const double eu = ot == DType::bf16 ? bf16_ulp_of(u) : 1e-6 * mu;
              const bool near_g = std::fabs(g - g0) > 0.5 * eg - 1e-12 * mg;
              const bool near_u = std::fabs(u - u0) > 0.5 * eu - 1e-12 * mu;
              bound = (ot == DType::bf16 ? bf16_ulp_of(want) : 1e-6 * std::fabs(want)) +
                      (near_g ? 1.1 * std::fabs(u) * eg : 0.0) +
                      (near_u ? std::fabs(want / u) * eu : 0.0);
            } else {
              want = dot(i, j, &mg);
              if (acc) {
                const double old = ot == DType::bf16 ? bf16_to_float(prior16[off]) : prior32[off];
                want += old, mg += std::fabs(old);
              }
              // Both round once to the output type: at most one bf16 ulp apart when the
              // sums straddle a rounding boundary, else equal.
              bound =
                  1e-12 * mg + (ot == DType::bf16 ? bf16_ulp_of(want) : 0x1p-23 * std::fabs(want));
            }
            if (!(std::fabs(got - want) <= bound)) ++bad;
          }
          // Columns past n are left alone.
          for (size_t j = c.n; j < ldo; ++j) {
            const size_t off = i * ldo + j;
            if (ot == DType::bf16 ? o16[off] != prior16[off] : o32[off] != prior32[off]) ++bad;
          }
        }
        CHECK(bad == 0);
      }
}

// RMSNorm inside the product (norm_w): the sum over a[k] * norm_w[k] * w[n][k], scaled by
// 1 / sqrt(mean(a^2) + eps), in double: the plain twin's sum over the same products, once
// more by hand.
TEST_CASE("fp8 matmul twin: RMSNorm of the input inside the product") {
  std::mt19937 rng(20261);
  const size_t m = 3, n = 40, k = 272, lda = k + 8;
  HostFp8 h = random_fp8(rng, n, k, 7);
  auto a = random_bf16(rng, m * lda, -2, 2);
  auto nw = random_bf16(rng, k, 0.5f, 1.5f);
  std::vector<float> out(m * n);
  Fp8MatmulArgs p;
  p.a = a.data(), p.lda = lda, p.w = h.w, p.out_dtype = DType::f32, p.out = out.data();
  p.ldo = n, p.m = m, p.n = n, p.k = k, p.norm_w = nw.data(), p.norm_eps = 1e-6f;
  fp8_matmul_ref(p);
  size_t bad = 0;
  for (size_t i = 0; i < m; ++i) {
    double ss = 0;
    for (size_t t = 0; t < k; ++t) ss += std::pow(bf16_to_float(a[i * lda + t]), 2);
    const double inv = 1 / std::sqrt(ss / k + 1e-6);
    for (size_t j = 0; j < n; ++j) {
      double s = 0;
      for (size_t t = 0; t < k; ++t)
        s += bf16_to_float(a[i * lda + t]) * bf16_to_float(nw[t]) * plain_weight(h, j, t);
      bad += std::fabs(out[i * n + j] - s * inv) > 1e-6 * (1 + std::fabs(s * inv));
    }
  }
  CHECK(bad == 0);
  // The device kernel's 16-byte loads of norm_w: a misaligned one is refused.
  p.norm_w = nw.data() + 1;
  auto s = fp8_matmul_check(p);
  REQUIRE_FALSE(s.ok());
  CHECK(s.message().find("norm_w") != std::string::npos);
}

TEST_CASE("fp8 dequantize twin: e4m3 x scale rounded to bf16 once, rows from row0") {
  std::mt19937 rng(7);
  for (int rs : {0, 7}) {
    const size_t rows = 300, k = 200;
    HostFp8 h = random_fp8(rng, rows, k, rs);
    const size_t row0 = 130, n = 150, ldo = k + 8;
    std::vector<uint16_t> out(n * ldo, 0xabcd);
    REQUIRE(fp8_dequantize_check(h.w, row0, n, k, out.data(), ldo).ok());
    fp8_dequantize_ref(h.w, row0, n, k, out.data(), ldo);
    size_t bad = 0;
    for (size_t r = 0; r < n; ++r) {
      for (size_t c = 0; c < k; ++c) {
        // The nearest bf16 to the exact product (ties to the even pattern), among the
        // neighbours of a first guess.
        const double x = plain_weight(h, row0 + r, c);
        const uint16_t g = float_to_bf16(static_cast<float>(x));
        uint16_t best = g;
        for (uint16_t cand : {static_cast<uint16_t>(g - 1), g, static_cast<uint16_t>(g + 1)}) {
          const double d = std::fabs(bf16_to_float(cand) - x),
                       db = std::fabs(bf16_to_float(best) - x);
          if (d < db || (d == db && (cand & 1) == 0)) best = cand;
        }
        if (out[r * ldo + c] != best) ++bad;
      }
      for (size_t c = k; c < ldo; ++c) bad += out[r * ldo + c] != 0xabcd;
    }
    CHECK(bad == 0);
  }
  // A product whose float rounding lands exactly on a bf16 tie: 1.125 x s with the exact
  // value just above (below) 1 + 2^-8 must round up (down), which rounding the float
  // product a second time would not do for the one above.
  int found = 0;
  for (int dir : {+1, -1}) {
    float s = static_cast<float>((1.0 + 0x1p-8) / 1.125);
    for (int step = 0; step < 64; ++step, s = std::nextafter(s, dir > 0 ? 2.f : 0.f)) {
      const double x = 1.125 * static_cast<double>(s);
      if (static_cast<float>(x) != 1.f + 0x1p-8f || x == 1.0 + 0x1p-8) continue;
      if ((x > 1.0 + 0x1p-8) != (dir > 0)) continue;
      uint8_t q = 0x39;  // 1.125
      Fp8Weight w;
      w.q = &q, w.ldq = 16, w.scales = &s, w.scale_ld = 1, w.row_shift = 0;
      uint16_t out = 0;
      fp8_dequantize_ref(w, 0, 1, 1, &out, 1);
      CAPTURE(x);
      CHECK(out == (dir > 0 ? 0x3f81 : 0x3f80));
      ++found;
      break;
    }
  }
  CHECK(found == 2);
}

TEST_CASE("fp8 matmul and dequantize checks: each bad argument named") {
  alignas(16) static uint16_t a[64] = {};
  alignas(16) static uint8_t q[4 * 64] = {};
  static float scales[4] = {1, 1, 1, 1};
  alignas(16) static uint16_t out[8] = {};
  auto good = [] {
    Fp8MatmulArgs p;
    p.a = a, p.lda = 32, p.w.q = q, p.w.ldq = 32, p.w.scales = scales, p.w.scale_ld = 1;
    p.w.row_shift = 0, p.out = out, p.out_dtype = DType::bf16, p.ldo = 4, p.m = 2, p.n = 4;
    p.k = 32;
    return p;
  };
  CHECK(fp8_matmul_check(good()).ok());
  struct Bad {
    const char* name;
    void (*spoil)(Fp8MatmulArgs&);
  } bads[] = {
      {"n ", [](Fp8MatmulArgs& p) { p.n = 0; }},
      {"k ", [](Fp8MatmulArgs& p) { p.k = 0; }},
      {"k 24", [](Fp8MatmulArgs& p) { p.k = 24, p.lda = 24, p.w.ldq = 32; }},
      {"null a ", [](Fp8MatmulArgs& p) { p.a = nullptr; }},
      {"null w.q", [](Fp8MatmulArgs& p) { p.w.q = nullptr; }},
      {"null w.scales", [](Fp8MatmulArgs& p) { p.w.scales = nullptr; }},
      {"null out", [](Fp8MatmulArgs& p) { p.out = nullptr; }},
      {"lda 16", [](Fp8MatmulArgs& p) { p.lda = 16; }},
      {"w.ldq 16", [](Fp8MatmulArgs& p) { p.w.ldq = 16; }},
      {"ldo 3", [](Fp8MatmulArgs& p) { p.ldo = 3; }},
      {"w.scale_ld 0", [](Fp8MatmulArgs& p) { p.w.scale_ld = 0; }},
      {"w.scale_ld 1", [](Fp8MatmulArgs& p) { p.k = 144, p.lda = 144, p.w.ldq = 144; }},
      {"w.row_shift 3", [](Fp8MatmulArgs& p) { p.w.row_shift = 3; }},
      {"lda 36", [](Fp8MatmulArgs& p) { p.lda = 36; }},
      {"a's rows", [](Fp8MatmulArgs& p) { p.a = a + 1; }},
      {"w.ldq 40", [](Fp8MatmulArgs& p) { p.w.ldq = 40; }},
      {"w.q's rows", [](Fp8MatmulArgs& p) { p.w.q = q + 8; }},
      {"swiglu with accumulate", [](Fp8MatmulArgs& p) { p.swiglu = p.accumulate = true; }},
  };
  for (const Bad& b : bads) {
    CAPTURE(b.name);
    Fp8MatmulArgs p = good();
    b.spoil(p);
    Status s = fp8_matmul_check(p);
    REQUIRE(!s.ok());
    CHECK(s.error().code == Errc::usage);
    CHECK(s.message().find("fp8 matmul") != std::string::npos);
    CHECK(s.message().find(b.name) != std::string::npos);
    // The decode entry point refuses it the same way, with or without CUDA in the build.
    Status d = fp8_gemv_cuda_device(p, nullptr);
    CHECK(d.message() == s.message());
  }
  // No rows: nothing to read, so no pointers needed; shape errors still count.
  Fp8MatmulArgs empty;
  empty.n = 4, empty.k = 32, empty.w.scale_ld = 1;
  CHECK(fp8_matmul_check(empty).ok());

  Fp8Weight w;
  w.q = q, w.ldq = 32, w.scales = scales, w.scale_ld = 1, w.row_shift = 0;
  CHECK(fp8_dequantize_check(w, 0, 4, 32, out, 32).ok());
  auto dq_err = [&](Fp8Weight ww, size_t k, const void* o, size_t ldo) {
    Status s = fp8_dequantize_check(ww, 0, 4, k, o, ldo);
    return s.ok() ? std::string() : s.message();
  };
  Fp8Weight wq = w, ws = w, wl = w, wr = w, wsl = w;
  wq.q = nullptr, ws.scales = nullptr, wl.ldq = 16, wr.row_shift = 1, wsl.scale_ld = 0;
  CHECK(dq_err(wq, 32, out, 32).find("null w.q") != std::string::npos);
  CHECK(dq_err(ws, 32, out, 32).find("null w.scales") != std::string::npos);
  CHECK(dq_err(w, 32, nullptr, 32).find("null out") != std::string::npos);
  CHECK(dq_err(wl, 32, out, 32).find("w.ldq 16") != std::string::npos);
  CHECK(dq_err(w, 32, out, 16).find("ldo 16") != std::string::npos);
  CHECK(dq_err(wr, 32, out, 32).find("w.row_shift 1") != std::string::npos);
  CHECK(dq_err(wsl, 32, out, 32).find("w.scale_ld 0") != std::string::npos);
  CHECK(dq_err(w, 0, out, 32).find("k must be > 0") != std::string::npos);
  CHECK(dq_err(w, 32, out, 32).empty());
}

// The activations' quantization for the FP8 tensor cores (fp8_quantize_rows_ref): each
// 128-column block's scale is its amax / 448, its largest value lands on 448 exactly, every
// code is the nearest e4m3 (ties to even) of value / scale, a block of zeros scales by 1,
// and the scales go rows-contiguous (kb * scale_ld + row) with nothing else written.
TEST_CASE("fp8 quantize rows twin: amax / 448 a block, nearest codes, rows-contiguous scales") {
  std::mt19937 rng(11);
  const size_t m = 5, k = 200, lda = 208, ldq = 212, scale_ld = 7;  // a partial last block
  auto a = random_bf16(rng, m * lda, -3.f, 3.f);
  for (size_t c = 128; c < 200; ++c) a[2 * lda + c] = float_to_bf16(0.f);  // row 2, block 1
  a[4 * lda + 5] = float_to_bf16(-1e-30f);  // a value far below the block's subnormals
  std::vector<uint8_t> q(m * ldq, 0xee);
  std::vector<float> sc(2 * scale_ld, -7.f);
  Fp8Rows out{q.data(), ldq, sc.data(), scale_ld};
  REQUIRE(fp8_quantize_rows_check(a.data(), lda, m, k, out).ok());
  fp8_quantize_rows_ref(a.data(), lda, m, k, out);
  size_t bad = 0;
  for (size_t r = 0; r < m; ++r) {
    for (size_t kb = 0; kb < 2; ++kb) {
      const size_t c0 = kb * 128, c1 = std::min(k, c0 + 128);
      float amax = 0;
      for (size_t c = c0; c < c1; ++c)
        amax = std::max(amax, std::fabs(bf16_to_float(a[r * lda + c])));
      const float s = sc[kb * scale_ld + r];
      CAPTURE(r);
      CAPTURE(kb);
      if (amax == 0) {
        CHECK(s == 1.f);
      } else {
        CHECK(s == amax / 448.f);
      }
      bool top = amax == 0;
      for (size_t c = c0; c < c1; ++c) {
        const float x = bf16_to_float(a[r * lda + c]);
        const uint8_t code = q[r * ldq + c];
        const double v = fp8_e4m3_value(code), t = static_cast<double>(x / s);
        // The nearest: no other code is closer (the neighbours of the code's magnitude).
        for (int d : {-1, 1}) {
          const int nb = (code & 0x7f) + d;
          if (nb < 0 || nb > 0x7e) continue;
          const double other = fp8_e4m3_value(static_cast<uint8_t>((code & 0x80) | nb));
          bad += std::fabs(other - t) < std::fabs(v - t);
        }
        top = top || (std::fabs(x) == amax && fp8_e4m3_value(code) == std::copysign(448.0, x));
      }
      CHECK(top);
    }
    for (size_t c = k; c < ldq; ++c) bad += q[r * ldq + c] != 0xee;
  }
  CHECK(bad == 0);
  for (size_t i = 0; i < sc.size(); ++i)
    if (i % scale_ld >= m) CHECK(sc[i] == -7.f);
  // A value far below the block's smallest subnormal rounds to zero, keeping its sign.
  CHECK((q[4 * ldq + 5] & 0x7f) == 0);
  // A tie between two codes goes to the even one: amax 448 makes the scale 1, and 8.5 lies
  // halfway between 8 (0x50) and 9 (0x51).
  std::vector<uint16_t> tie(8, float_to_bf16(0.f));
  tie[0] = float_to_bf16(448.f), tie[1] = float_to_bf16(8.5f), tie[2] = float_to_bf16(9.5f);
  std::vector<uint8_t> tq(8);
  float ts = 0;
  fp8_quantize_rows_ref(tie.data(), 8, 1, 8, Fp8Rows{tq.data(), 8, &ts, 1});
  CHECK(ts == 1.f);
  CHECK(tq[1] == 0x50);  // 8.5 -> 8
  CHECK(tq[2] == 0x52);  // 9.5 -> 10

  // The checks name what is wrong, and the device entry refuses the same way.
  struct Bad {
    const char* name;
    size_t lda, m, k, ldq, scale_ld;
    int a_off;
  } bads[] = {{"k 12", 208, 2, 12, 212, 7, 0},
              {"(lda 200)", 200, 2, 208, 212, 7, 0},
              {"(ldq 210)", 208, 2, 200, 210, 7, 0},
              {"scale_ld 7 is under m 8", 208, 8, 200, 212, 7, 0},
              {"(lda 208)", 208, 2, 200, 212, 7, 1}};
  for (const Bad& b : bads) {
    CAPTURE(b.name);
    Fp8Rows o{q.data(), b.ldq, sc.data(), b.scale_ld};
    Status s = fp8_quantize_rows_check(a.data() + b.a_off, b.lda, b.m, b.k, o);
    REQUIRE(!s.ok());
    CHECK(s.error().code == Errc::usage);
    CHECK(s.message().find(b.name) != std::string::npos);
    CHECK(
        fp8_quantize_rows_cuda_device(a.data() + b.a_off, b.lda, b.m, b.k, o, nullptr).message() ==
        s.message());
  }
}

// The weight layout the tensor-core product reads: 128 x 128 blocks with each scale row
// padded to a multiple of 4 blocks, rows of exactly k bytes.
TEST_CASE("fp8 tensor-core layout: scale rows padded to 4 blocks, 128-row blocks, packed rows") {
  CHECK(fp8_tc_scale_ld(128) == 4);
  CHECK(fp8_tc_scale_ld(384) == 4);
  CHECK(fp8_tc_scale_ld(640) == 8);
  CHECK(fp8_tc_scale_ld(4096) == 32);
  CHECK(fp8_tc_scale_ld(4097) == 36);
  alignas(16) static uint8_t q[640 * 2] = {};
  alignas(16) static float scales[16] = {};
  Fp8Weight w;
  w.q = q, w.ldq = 640, w.scales = scales, w.scale_ld = 8, w.row_shift = 7;
  CHECK(fp8_tc_weight_ok(w, 640));
  Fp8Weight v = w;
  v.scale_ld = 5;  // ceil(640 / 128): the checkpoint's stride, not the padded one
  CHECK_FALSE(fp8_tc_weight_ok(v, 640));
  v = w, v.row_shift = 0;
  CHECK_FALSE(fp8_tc_weight_ok(v, 640));
  v = w, v.ldq = 656;
  CHECK_FALSE(fp8_tc_weight_ok(v, 640));
  v = w, v.q = q + 8;
  CHECK_FALSE(fp8_tc_weight_ok(v, 640));
}
