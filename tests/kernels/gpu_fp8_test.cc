// The FP8 kernels on the GPU against their CPU twins (kernels/fp8.h): the decode GEMV at
// every row count it takes over partial scale blocks, both scale layouts, both output
// types, bias, accumulate and SwiGLU (under programmatic launch too), in both of its shapes
// (one output column a warp where the grid would be small or A has one row, two from 6000
// columns and two rows on a device of up to 187 multiprocessors), three products in one
// launch with RMSNorm inside, the q/k/v products with RoPE, the per-head norms and the KV
// write in their epilogue (bit for bit the products then the RoPE kernel), and the
// dequantization bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cuda_runtime.h"
#include "kernels/fp8.h"
#include "kernels/launch.h"
#include "kernels/matmul.h"
#include "kernels/rope.h"
#include "support/gpu.h"
#include "support/gpu_qkv_rope.h"
#include "support/gpu_values.h"

using namespace spark;
using namespace spark::kernels;
using spark::test::gpu::bf16_ulp;
using test::DeviceBuf;

namespace {

struct HostFp8 {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  size_t ldq = 0, scale_ld = 0;
  int row_shift = 7;
};

// `rows` x k random e4m3 codes (no NaN) with padded strides and scales around 1/448.
HostFp8 random_fp8(std::mt19937& rng, size_t rows, size_t k, int row_shift) {
  HostFp8 h;
  h.ldq = k + 16, h.scale_ld = (k + 127) / 128 + 1, h.row_shift = row_shift;
  h.q.resize(rows * h.ldq);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : h.q) {
    int c;
    do c = byte(rng);
    while ((c & 0x7f) == 0x7f);
    b = static_cast<uint8_t>(c);
  }
  std::uniform_real_distribution<float> sd(0.0005f, 0.004f);
  h.scales.resize((((rows - 1) >> row_shift) + 1) * h.scale_ld);
  for (auto& s : h.scales) s = sd(rng);
  return h;
}

Fp8Weight weight_of(const HostFp8& h, const uint8_t* q, const float* scales) {
  Fp8Weight w;
  w.q = q, w.ldq = h.ldq, w.scales = scales, w.scale_ld = h.scale_ld, w.row_shift = h.row_shift;
  return w;
}

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = float_to_bf16(d(rng));
  return v;
}

float widened(const HostFp8& h, size_t row, size_t col) {
  static const std::vector<float> codes = [] {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] = fp8_e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  return codes[h.q[row * h.ldq + col]] *
         h.scales[(row >> h.row_shift) * h.scale_ld + col / kFp8BlockK];
}

}  // namespace

TEST_CASE("gpu fp8 gemv: m = 1..8 against the twin, bias, accumulate, swiglu, both scale layouts") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("fp8 gemv"));
  // The kernel sums exact products (e4m3 x bf16 fits fp32) in fp32, scales each block's
  // partial sum and adds in fp32, in any order: |err| <= (k + 8) 2^-24 sum|a w| (+ |bias|,
  // |old out|), plus one bf16 ulp of the result for a bf16 output; the twin sums in double
  // and rounds once. SwiGLU: g and u each within that bound before both round to the output
  // type, so y differs by at most 1.1 |u| e_g + |silu(g)| e_u plus the result's rounding.
  struct Shape {
    size_t n, k;
  } shapes[] = {{37, 208}, {1024, 4096}, {4096, 4096}, {300, 1040}, {6000, 272}};
  const DType types[] = {DType::f32, DType::bf16};
  size_t cases = 0;
  for (const Shape& sh : shapes)
    for (int rs : {7, 0})
      for (size_t m = 1; m <= kFp8GemvMaxRows; ++m)
        for (DType ot : types)
          for (int mode = 0; mode < 4; ++mode) {
            const bool big = sh.n * sh.k > 2000000;
            // The large shapes: every m once per layout and type, the modes spread over m.
            if (big && mode != static_cast<int>(m % 4)) continue;
            const bool with_bias = mode == 1 || mode == 3, acc = mode == 2, swiglu = mode == 3;
            const bool pdl = (m + static_cast<size_t>(mode)) % 3 == 0;
            CAPTURE(sh.n);
            CAPTURE(sh.k);
            CAPTURE(rs);
            CAPTURE(m);
            CAPTURE(std::string(dtype_name(ot)));
            CAPTURE(mode);
            CAPTURE(pdl);
            const size_t wrows = swiglu ? 2 * sh.n : sh.n, lda = sh.k + 8, ldo = sh.n + 5;
            HostFp8 h = random_fp8(rng, wrows, sh.k, rs);
            auto a = random_bf16(rng, m * lda, -1, 1);
            auto bias = random_bf16(rng, wrows, -0.5f, 0.5f);
            std::vector<float> out0(m * ldo);
            for (auto& f : out0)
              f = round_to(ot, std::uniform_real_distribution<float>(-1, 1)(rng));
            // The twin's output, in the output type's host layout.
            std::vector<float> ref32 = out0;
            std::vector<uint16_t> ref16(m * ldo);
            for (size_t i = 0; i < ref16.size(); ++i) ref16[i] = float_to_bf16(out0[i]);
            Fp8MatmulArgs p;
            p.a = a.data(), p.lda = lda, p.w = weight_of(h, h.q.data(), h.scales.data());
            p.out_dtype = ot, p.ldo = ldo, p.m = m, p.n = sh.n, p.k = sh.k;
            p.bias = with_bias ? bias.data() : nullptr, p.accumulate = acc, p.swiglu = swiglu;
            p.out = ot == DType::bf16 ? static_cast<void*>(ref16.data()) : ref32.data();
            fp8_matmul_ref(p);
            std::vector<float> ref(m * ldo);
            for (size_t i = 0; i < ref.size(); ++i)
              ref[i] = ot == DType::bf16 ? bf16_to_float(ref16[i]) : ref32[i];

            auto da = DeviceBuf<uint16_t>::from(a);
            auto dq = DeviceBuf<uint8_t>::from(h.q);
            auto ds = DeviceBuf<float>::from(h.scales);
            auto db = DeviceBuf<uint16_t>::from(bias);
            // The output starts as the old values everywhere (so columns past n can be
            // checked untouched) and, without accumulate, as NaN in the columns written.
            std::vector<float> start = out0;
            if (!acc)
              for (size_t i = 0; i < m; ++i)
                for (size_t j = 0; j < sh.n; ++j) start[i * ldo + j] = NAN;
            test::gpu::Dev dout = test::gpu::to_dev(start, ot);
            Fp8MatmulArgs d = p;
            d.a = da.get(), d.w = weight_of(h, dq.get(), ds.get()), d.out = dout.get();
            d.bias = with_bias ? db.get() : nullptr;
            set_programmatic_launch(pdl);
            Status s = fp8_gemv_cuda_device(d, nullptr);
            set_programmatic_launch(false);
            REQUIRE_MESSAGE(s.ok(), s.message());
            REQUIRE(cuda_synchronize().ok());
            auto got = test::gpu::from_dev(dout);

            auto mag_of = [&](size_t i, size_t row) {
              double mag = 0;
              for (size_t t = 0; t < sh.k; ++t)
                mag += std::fabs(static_cast<double>(bf16_to_float(a[i * lda + t])) *
                                 widened(h, row, t));
              if (with_bias) mag += std::fabs(bf16_to_float(bias[row]));
              return mag;
            };
            auto sum_of = [&](size_t i, size_t row) {
              double s2 = 0;
              for (size_t t = 0; t < sh.k; ++t)
                s2 += static_cast<double>(bf16_to_float(a[i * lda + t])) * widened(h, row, t);
              if (with_bias) s2 += bf16_to_float(bias[row]);
              return s2;
            };
            const double gamma = static_cast<double>(sh.k + 8) * 0x1p-24;
            size_t bad = 0, unwritten = 0, touched = 0;
            double max_err = 0;
            // Large shapes: a sample of the outputs (the bound's magnitudes cost k each).
            const size_t stride = big ? 7 : 1;
            for (size_t i = 0; i < m; ++i) {
              for (size_t j = 0; j < sh.n; j += stride) {
                const size_t idx = i * ldo + j;
                double bound;
                if (swiglu) {
                  const double g = sum_of(i, j), u = sum_of(i, sh.n + j);
                  const double eg = gamma * mag_of(i, j) + (ot == DType::bf16 ? bf16_ulp(g) : 0.0);
                  const double eu =
                      gamma * mag_of(i, sh.n + j) + (ot == DType::bf16 ? bf16_ulp(u) : 0.0);
                  const double silu = g / (1 + std::exp(-g));
                  bound = 1.1 * std::fabs(u) * eg + std::fabs(silu) * eu +
                          1e-6 * std::fabs(ref[idx]) +
                          (ot == DType::bf16 ? 2 * bf16_ulp(ref[idx]) : 0.0);
                } else {
                  double mag = mag_of(i, j);
                  if (acc) mag += std::fabs(out0[idx]);
                  bound = gamma * mag + (ot == DType::bf16 ? bf16_ulp(ref[idx]) : 0.0);
                }
                const double e = std::fabs(static_cast<double>(got[idx]) - ref[idx]);
                if (std::isnan(got[idx])) ++unwritten;
                if (!(e <= bound)) ++bad;
                if (!std::isnan(e)) max_err = std::max(max_err, e);
              }
              for (size_t j = sh.n; j < ldo; ++j) touched += got[i * ldo + j] != out0[i * ldo + j];
            }
            CHECK(bad == 0);
            CHECK(unwritten == 0);
            CHECK(touched == 0);
            if (bad) MESSAGE("max err " << max_err);
            ++cases;
          }
  MESSAGE(cases << " fp8 gemv cases");
  // More rows than the decode kernel takes: refused, naming the limit.
  Fp8MatmulArgs nine;
  auto da = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(9 * 16));
  auto dq = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(16));
  auto ds = DeviceBuf<float>::from(std::vector<float>(1, 1.f));
  auto dout = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(9));
  nine.a = da.get(), nine.lda = 16, nine.w.q = dq.get(), nine.w.ldq = 16, nine.w.scales = ds.get();
  nine.w.scale_ld = 1, nine.out = dout.get(), nine.ldo = 1, nine.m = 9, nine.n = 1, nine.k = 16;
  Status s = fp8_gemv_cuda_device(nine, nullptr);
  REQUIRE(!s.ok());
  CHECK(s.error().code == Errc::usage);
  CHECK(s.message().find("at most 8 rows") != std::string::npos);
}

// Three products over one input in one launch (the q, k and v projections), over the input
// itself or RMSNorm of it computed inside (norm_w), plain or SwiGLU alone with the norm, each
// part against its twin. Bound: the plain test's (k + 8) 2^-24 sum|a w| on the products
// before the norm's scale, times that scale (whose rsqrt adds 2^-21 relative), plus a bf16
// ulp of a bf16 output.
TEST_CASE("gpu fp8 gemv: three products in one launch, RMSNorm inside, against the twins") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("fp8 gemv group"));
  const size_t k = 1040;
  const size_t widths[3] = {300, 64, 72};
  size_t cases = 0;
  for (size_t m : {1, 2, 5, 8})
    for (int mode = 0; mode < 3; ++mode) {
      const bool norm = mode >= 1, swiglu = mode == 2;
      const int n = swiglu ? 1 : 3;
      CAPTURE(m);
      CAPTURE(mode);
      const size_t lda = k + 8;
      auto a = random_bf16(rng, m * lda, -2, 2);
      auto nw = random_bf16(rng, k, 0.5f, 1.5f);
      auto da = DeviceBuf<uint16_t>::from(a);
      auto dnw = DeviceBuf<uint16_t>::from(nw);
      std::vector<HostFp8> hs;
      std::vector<DeviceBuf<uint8_t>> dqs;
      std::vector<DeviceBuf<float>> dss;
      std::vector<test::gpu::Dev> outs;
      std::vector<std::vector<uint16_t>> refs;
      Fp8MatmulArgs parts[3];
      for (int i = 0; i < n; ++i) {
        const size_t N = widths[i], wrows = swiglu ? 2 * N : N;
        hs.push_back(random_fp8(rng, wrows, k, 7));
      }
      for (int i = 0; i < n; ++i) {
        const size_t N = widths[i];
        Fp8MatmulArgs p;
        p.a = a.data(), p.lda = lda,
        p.w = weight_of(hs[static_cast<size_t>(i)], hs[static_cast<size_t>(i)].q.data(),
                        hs[static_cast<size_t>(i)].scales.data());
        p.out_dtype = DType::bf16, p.ldo = N, p.m = m, p.n = N, p.k = k, p.swiglu = swiglu;
        p.norm_w = norm ? nw.data() : nullptr, p.norm_eps = 1e-5f;
        refs.emplace_back(m * N, 0);
        p.out = refs.back().data();
        fp8_matmul_ref(p);
        dqs.push_back(DeviceBuf<uint8_t>::from(hs[static_cast<size_t>(i)].q));
        dss.push_back(DeviceBuf<float>::from(hs[static_cast<size_t>(i)].scales));
        outs.push_back(test::gpu::poisoned(m * N, DType::bf16));
        parts[i] = p;
        parts[i].a = da.get(), parts[i].norm_w = norm ? dnw.get() : nullptr;
        parts[i].w = weight_of(hs[static_cast<size_t>(i)], dqs.back().get(), dss.back().get());
        parts[i].out = outs.back().get();
      }
      set_programmatic_launch(m % 2 == 0);
      Status s = fp8_gemv_group_cuda_device(parts, n, nullptr);
      set_programmatic_launch(false);
      REQUIRE_MESSAGE(s.ok(), s.message());
      REQUIRE(cuda_synchronize().ok());
      for (int i = 0; i < n; ++i) {
        const size_t N = widths[i];
        auto got = test::gpu::from_dev(outs[static_cast<size_t>(i)]);
        size_t bad = 0;
        for (size_t r = 0; r < m; ++r) {
          double ss = 0;
          for (size_t t = 0; t < k; ++t) {
            const double x = bf16_to_float(a[r * lda + t]);
            ss += x * x;
          }
          const double inv = norm ? 1.0 / std::sqrt(ss / static_cast<double>(k) + 1e-5) : 1.0;
          for (size_t j = 0; j < N; ++j) {
            auto mag = [&](size_t row) {
              double g = 0;
              for (size_t t = 0; t < k; ++t)
                g += std::fabs(bf16_to_float(a[r * lda + t]) * (norm ? bf16_to_float(nw[t]) : 1.f) *
                               widened(hs[static_cast<size_t>(i)], row, t));
              return g * inv * (static_cast<double>(k + 8) * 0x1p-24 + 0x1p-21);
            };
            const double ref = bf16_to_float(refs[static_cast<size_t>(i)][r * N + j]);
            double bound = mag(j) + bf16_ulp(ref);
            if (swiglu)
              bound = 8 * (mag(j) + mag(N + j)) * (1 + std::fabs(ref)) + 2 * bf16_ulp(ref);
            const double e = std::fabs(static_cast<double>(got[r * N + j]) - ref);
            if (!(e <= bound)) ++bad;
          }
        }
        CAPTURE(i);
        CHECK(bad == 0);
        ++cases;
      }
    }
  MESSAGE(cases << " grouped fp8 gemv parts");
  // A group whose parts do not share the input is refused.
  Fp8MatmulArgs two[2];
  auto da = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(32));
  auto dq = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(16));
  auto ds = DeviceBuf<float>::from(std::vector<float>(1, 1.f));
  auto dout = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(2));
  for (auto& t : two) {
    t.a = da.get(), t.lda = 16, t.w.q = dq.get(), t.w.ldq = 16, t.w.scales = ds.get();
    t.w.scale_ld = 1, t.out = dout.get(), t.ldo = 1, t.m = 1, t.n = 1, t.k = 16;
  }
  two[1].a = static_cast<uint16_t*>(da.get()) + 16;
  Status s = fp8_gemv_group_cuda_device(two, 2, nullptr);
  REQUIRE(!s.ok());
  CHECK(s.message().find("share a") != std::string::npos);
}

TEST_CASE("gpu fp8 dequantize: bit for bit the twin, rows from row0, both scale layouts") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("fp8 dequantize"));
  struct Shape {
    size_t rows, k, row0, n;
  } shapes[] = {{300, 200, 130, 150}, {4096, 4096, 0, 4096}, {1100, 4096, 1024, 76}, {3, 16, 1, 2}};
  for (const Shape& sh : shapes)
    for (int rs : {7, 0}) {
      CAPTURE(sh.rows);
      CAPTURE(sh.k);
      CAPTURE(sh.row0);
      CAPTURE(rs);
      HostFp8 h = random_fp8(rng, sh.rows, sh.k, rs);
      // Every code, NaNs included, in the first row.
      for (size_t c = 0; c < std::min<size_t>(256, sh.k); ++c)
        h.q[sh.row0 * h.ldq + c] = static_cast<uint8_t>(c);
      const size_t ldo = sh.k + 24;
      std::vector<uint16_t> ref(sh.n * ldo, 0x5555);
      fp8_dequantize_ref(weight_of(h, h.q.data(), h.scales.data()), sh.row0, sh.n, sh.k, ref.data(),
                         ldo);
      auto dq = DeviceBuf<uint8_t>::from(h.q);
      auto ds = DeviceBuf<float>::from(h.scales);
      auto dout = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(sh.n * ldo, 0x5555));
      Status s = fp8_dequantize_cuda_device(weight_of(h, dq.get(), ds.get()), sh.row0, sh.n, sh.k,
                                            dout.get(), ldo, nullptr);
      REQUIRE_MESSAGE(s.ok(), s.message());
      REQUIRE(cuda_synchronize().ok());
      auto got = dout.host();
      size_t bad = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const bool both_nan =
            std::isnan(bf16_to_float(ref[i])) && std::isnan(bf16_to_float(got[i]));
        if (got[i] != ref[i] && !both_nan) ++bad;
      }
      CHECK(bad == 0);
    }
}

namespace {

// The q/k/v FP8 products with the RoPE epilogue against the products (one launch) followed
// by the RoPE kernel with its KV write: every output and cache row bit for bit.
struct Fp8RopeCase {
  int nh, nkv, hd;
  size_t k, m;
  DType t, ct;  // output, cache
  bool bias = false, pdl = false, in_norm = false, q_norm = false, k_norm = false;
};

void fp8_rope_case(std::mt19937& rng, const Fp8RopeCase& c) {
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
  auto da = DeviceBuf<uint16_t>::from(random_bf16(rng, c.m * c.k, -2, 2));
  auto dnw = DeviceBuf<uint16_t>::from(random_bf16(rng, c.k, 0.5f, 1.5f));
  std::vector<HostFp8> hs;
  std::vector<DeviceBuf<uint8_t>> dq;
  std::vector<DeviceBuf<float>> ds;
  std::vector<DeviceBuf<uint16_t>> db;
  for (int i = 0; i < 3; ++i) {  // q's scales per 128 rows, k's and v's per row
    hs.push_back(random_fp8(rng, width[i], c.k, i == 0 ? 7 : 0));
    dq.push_back(DeviceBuf<uint8_t>::from(hs.back().q));
    ds.push_back(DeviceBuf<float>::from(hs.back().scales));
    db.push_back(DeviceBuf<uint16_t>::from(random_bf16(rng, width[i], -1, 1)));
  }
  using Out = test::gpu::QkvRopeIo::Out;
  auto parts_for = [&](Out& o, Fp8MatmulArgs* a) {
    for (int i = 0; i < 3; ++i) {
      const auto u = static_cast<size_t>(i);
      a[i] = Fp8MatmulArgs{};
      a[i].a = da.get(), a[i].lda = c.k, a[i].w = weight_of(hs[u], dq[u].get(), ds[u].get());
      a[i].out = o.y[i].get(), a[i].out_dtype = c.t, a[i].ldo = width[i];
      a[i].m = c.m, a[i].n = width[i], a[i].k = c.k;
      a[i].bias = c.bias ? db[u].get() : nullptr;
      if (c.in_norm) a[i].norm_w = dnw.get(), a[i].norm_eps = 1e-6f;
    }
  };
  io.compare<Fp8MatmulArgs>(
      c.pdl, c.q_norm, c.k_norm, parts_for,
      [](const Fp8MatmulArgs* a) { return fp8_gemv_group_cuda_device(a, 3, nullptr); },
      [](const Fp8MatmulArgs* a, const RopeArgs& r) {
        return fp8_qkv_rope_cuda_device(a, r, nullptr);
      });
}

}  // namespace

TEST_CASE(
    "gpu fp8 gemv: q/k/v with RoPE, the per-head norms and the KV write in the epilogue, bit "
    "for bit") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("fp8 qkv rope"));
  const DType kOut[] = {DType::bf16, DType::f32};
  // Llama-shaped heads at 1-8 rows (no per-head norms): input norm or not, bias,
  // programmatic launch, the three cache types.
  struct Shape {
    int nh, nkv, hd;
    size_t k;
  };
  for (const Shape& sh : {Shape{32, 8, 128, 1024}, Shape{12, 4, 64, 272}, Shape{4, 2, 32, 64}})
    for (size_t m : {1, 2, 3, 8})
      for (int mode = 0; mode < 3; ++mode) {
        Fp8RopeCase c{sh.nh,
                      sh.nkv,
                      sh.hd,
                      sh.k,
                      m,
                      kOut[mode % 2],
                      mode == 0   ? DType::bf16
                      : mode == 1 ? DType::f32
                                  : DType::e4m3};
        c.in_norm = mode != 1, c.bias = mode >= 1, c.pdl = mode == 2;
        fp8_rope_case(rng, c);
      }
  // Qwen3's per-head norms (a cluster of head_dim / 16 blocks a head) at 1-2 rows.
  if (!matmul_qkv_rope_head_norms(1, 128)) {
    MESSAGE("per-head norms skipped: no thread block clusters on this GPU");
  } else {
    for (const Shape& sh : {Shape{32, 4, 128, 2048}, Shape{14, 2, 64, 896}, Shape{4, 2, 32, 64}})
      for (size_t m : {1, 2})
        for (int mode = 0; mode < 4; ++mode) {
          Fp8RopeCase c{
              sh.nh, sh.nkv, sh.hd, sh.k, m, kOut[mode % 2], mode == 3 ? DType::e4m3 : DType::bf16};
          c.in_norm = true, c.bias = mode == 1, c.pdl = mode >= 2;
          c.q_norm = mode != 3, c.k_norm = true;
          fp8_rope_case(rng, c);
        }
  }
  // What the epilogue does not take is refused by name: more rows than it holds, a part
  // that does not write rope's k, per-head norms past two rows.
  auto dq = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(64 * 64, 0x38));
  auto ds = DeviceBuf<float>::from(std::vector<float>(4, 1.f));
  auto da = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(9 * 64, 0x3f80));
  test::gpu::Dev dy[3] = {test::gpu::poisoned(9 * 64, DType::bf16),
                          test::gpu::poisoned(9 * 64, DType::bf16),
                          test::gpu::poisoned(9 * 64, DType::bf16)};
  auto dkc = test::gpu::poisoned(4 * 64, DType::bf16),
       dvc = test::gpu::poisoned(4 * 64, DType::bf16);
  auto dpos = DeviceBuf<int32_t>::from(std::vector<int32_t>(9, 3));
  auto dsl = DeviceBuf<int32_t>::from(std::vector<int32_t>{0, 1, 2, 3, -1, -1, -1, -1, -1});
  auto dinv = DeviceBuf<float>::from(rope_inv_freq(32, 10000.0, {}));
  Fp8MatmulArgs a[3];
  for (int i = 0; i < 3; ++i) {
    Fp8MatmulArgs& p = a[i];
    p.a = da.get(), p.lda = 64, p.w.q = dq.get(), p.w.ldq = 64, p.w.scales = ds.get();
    p.w.scale_ld = 1, p.w.row_shift = 7, p.out = dy[i].get(), p.out_dtype = DType::bf16;
    p.ldo = 64, p.m = 1, p.n = 64, p.k = 64;
  }
  RopeArgs r;
  r.dtype = DType::bf16, r.q = dy[0].get(), r.q_stride = 64, r.n_heads = 2, r.head_dim = 32;
  r.k = dy[1].get(), r.k_stride = 64, r.n_kv_heads = 2, r.v = dy[2].get(), r.v_stride = 64;
  r.n_tokens = 1, r.positions = dpos.get(), r.inv_freq = dinv.get();
  r.k_cache = dkc.get(), r.v_cache = dvc.get(), r.cache_dtype = DType::bf16, r.cache_slots = 4;
  r.slots = dsl.get();
  auto refused = [&](const char* what) {
    Status s = fp8_qkv_rope_cuda_device(a, r, nullptr);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().code == Errc::usage);
    CHECK(s.message().find(what) != std::string::npos);
  };
  for (auto& p : a) p.m = 9;
  r.n_tokens = 9;
  refused("at most 8 rows");
  for (auto& p : a) p.m = 1;
  r.n_tokens = 1;
  a[1].n = 32;
  refused("must write rope's k");
  a[1].n = 64;
  a[2].accumulate = true;
  refused("plain products only");
  a[2].accumulate = false;
  CHECK(fp8_qkv_rope_cuda_device(a, r, nullptr).ok());
  CHECK(cuda_synchronize().ok());
}

// The FP8 tensor-core prefill product (Hopper: cuBLASLt's block-scaled FP8): the rows'
// quantization bit for bit its twin, then the product of the quantized rows and the FP8
// weight within the stated bound of the exact product of the quantized values (the output's
// rounding and the sums': 2^-8 |yq| + 2^-9 sum |aq w|; with 2^-11 for the sums' term,
// 132 x 768 x 384 with accumulate measured 2.3 times that bound) and, adding each
// activation's rounding (2^-4 |a| + 2^-10 scale, times |w|), of the exact product of the
// bf16 rows: over
// row counts on and off cuBLASLt's tile sizes, widths with a partial scale block padded to
// four, per-row magnitudes 2^-2 .. 2^2, a block of zeros, bias and accumulate.
TEST_CASE("gpu fp8 tensor cores: the rows' codes bit for bit, the product within its bounds") {
  if (test::skip_without_cuda()) return;
  auto lim = cuda_device_limits(0);
  REQUIRE(lim.ok());
  auto mm = Matmul::create();
  REQUIRE_MESSAGE(mm.ok(), (mm.ok() ? std::string() : mm.error().message));
  std::mt19937 rng(test::fresh_seed("fp8 tensor cores"));
  struct Shape {
    size_t m, n, k;
    bool bias, accumulate;
  } shapes[] = {{8, 384, 640, false, false},    {20, 256, 256, true, false},
                {132, 768, 384, false, true},   {48, 1024, 4096, true, true},
                {256, 512, 1536, false, false}, {12, 128, 128, false, false}};
  size_t ran = 0;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.m);
    CAPTURE(sh.n);
    CAPTURE(sh.k);
    CAPTURE(sh.bias);
    CAPTURE(sh.accumulate);
    const size_t m = sh.m, n = sh.n, k = sh.k, blocks = (k + 127) / 128;
    // The weight as the loader keeps it for these products: rows of k bytes, 128 x 128
    // blocks, each scale row padded to fp8_tc_scale_ld(k) (the padding poisoned: never read).
    HostFp8 h = random_fp8(rng, n, k, 7);
    {
      HostFp8 p;
      p.ldq = k, p.scale_ld = fp8_tc_scale_ld(k), p.row_shift = 7;
      p.q.resize(n * k);
      for (size_t r = 0; r < n; ++r) std::memcpy(&p.q[r * k], &h.q[r * h.ldq], k);
      p.scales.assign(((n - 1) / 128 + 1) * p.scale_ld, std::nanf(""));
      for (size_t r = 0; r < (n - 1) / 128 + 1; ++r)
        for (size_t b = 0; b < blocks; ++b)
          p.scales[r * p.scale_ld + b] = h.scales[r * h.scale_ld + b];
      h = std::move(p);
    }
    auto a = random_bf16(rng, m * k, -2.f, 2.f);
    for (size_t r = 0; r < m; ++r)
      for (size_t c = 0; c < k; ++c)
        a[r * k + c] =
            float_to_bf16(std::ldexp(bf16_to_float(a[r * k + c]), static_cast<int>(r % 5) - 2));
    for (size_t c = 0; c < std::min<size_t>(k, 128); ++c) a[(m / 2) * k + c] = float_to_bf16(0.f);
    auto bias = random_bf16(rng, n, -1.f, 1.f);
    auto out0 = random_bf16(rng, m * n, -4.f, 4.f);
    // The quantization, bit for bit.
    std::vector<uint8_t> rq(m * k);
    std::vector<float> rs(blocks * m);
    fp8_quantize_rows_ref(a.data(), k, m, k, Fp8Rows{rq.data(), k, rs.data(), m});
    auto da = DeviceBuf<uint16_t>::from(a);
    auto dq = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(m * k, 0xee));
    auto dsc = DeviceBuf<float>::from(std::vector<float>(blocks * m, -1.f));
    REQUIRE(fp8_quantize_rows_cuda_device(da.get(), k, m, k, Fp8Rows{dq.get(), k, dsc.get(), m},
                                          nullptr)
                .ok());
    REQUIRE(cuda_synchronize().ok());
    CHECK(dq.host() == rq);
    CHECK(dsc.host() == rs);
    // The product.
    auto wq = DeviceBuf<uint8_t>::from(h.q);
    auto ws = DeviceBuf<float>::from(h.scales);
    auto db = DeviceBuf<uint16_t>::from(bias);
    auto dout = DeviceBuf<uint16_t>::from(out0);
    Fp8TcArgs p;
    p.a = dq.get(), p.lda = k, p.a_scales = dsc.get(), p.w = weight_of(h, wq.get(), ws.get());
    p.out = dout.get(), p.ldo = n, p.m = m, p.n = n, p.k = k;
    p.bias = sh.bias ? db.get() : nullptr, p.accumulate = sh.accumulate;
    Status s = mm.value()->run_fp8(p, nullptr);
    if (lim->cc_major != 9) {  // cuBLASLt's block-scaled FP8 is Hopper's
      CHECK(s.error().code == Errc::unsupported);
      continue;
    }
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
    ++ran;
    auto got = dout.host();
    size_t bad_q = 0, bad_x = 0;
    double worst_q = 0;  // the largest |out - yq| over its bound
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < n; ++j) {
        double yq = 0, y = 0, abs_q = 0, act = 0;
        for (size_t b = 0; b < blocks; ++b) {
          const double sa = rs[b * m + i], sw = h.scales[(j / 128) * h.scale_ld + b];
          double pq = 0, aq = 0, px = 0, pa = 0;
          for (size_t c = b * 128; c < std::min(k, b * 128 + 128); ++c) {
            const double wc = fp8_e4m3_value(h.q[j * k + c]);
            const double xq = fp8_e4m3_value(rq[i * k + c]), x = bf16_to_float(a[i * k + c]);
            pq += xq * wc, aq += std::fabs(xq * wc);
            px += x * wc, pa += (0x1p-4 * std::fabs(x) + 0x1p-10 * sa) * std::fabs(wc);
          }
          yq += pq * sa * sw, abs_q += aq * sa * sw, y += px * sw, act += pa * sw;
        }
        const double add = (sh.bias ? bf16_to_float(bias[j]) : 0.0) +
                           (sh.accumulate ? bf16_to_float(out0[i * n + j]) : 0.0);
        yq += add, y += add;
        const double g = bf16_to_float(got[i * n + j]);
        const double bound_q = 0x1p-8 * std::fabs(yq) + 0x1p-9 * abs_q;
        worst_q = std::max(worst_q, std::fabs(g - yq) / bound_q);
        bad_q += !(std::fabs(g - yq) <= bound_q);
        bad_x += !(std::fabs(g - y) <= 0x1p-8 * std::fabs(y) + 0x1p-9 * abs_q + act);
      }
    MESSAGE("m " << m << " n " << n << " k " << k << ": |out - yq| at most " << worst_q
                 << " of its bound");
    CHECK(bad_q == 0);
    CHECK(bad_x == 0);
  }
  if (lim->cc_major == 9) CHECK(ran == std::size(shapes));
  // Rows not a multiple of kFp8TcRowAlign, and a weight with the checkpoint's unpadded scale
  // stride, are refused before anything runs, naming why.
  HostFp8 h = random_fp8(rng, 128, 640, 7);
  Fp8TcArgs p;
  auto dq = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(6 * 640));
  auto dsc = DeviceBuf<float>::from(std::vector<float>(5 * 8));
  auto dout = DeviceBuf<uint16_t>::from(std::vector<uint16_t>(8 * 128));
  p.a = dq.get(), p.lda = 640, p.a_scales = dsc.get(), p.out = dout.get(), p.ldo = 128;
  p.m = 6, p.n = 128, p.k = 640;
  p.w = weight_of(h, dq.get(), dsc.get());
  p.w.ldq = 640, p.w.scale_ld = 8;
  Status six = mm.value()->run_fp8(p, nullptr);
  REQUIRE_FALSE(six.ok());
  CHECK(six.error().code == Errc::usage);
  CHECK(six.message().find("m 6 must be a multiple of 4") != std::string::npos);
  p.m = 8, p.w.scale_ld = 5;
  Status ld = mm.value()->run_fp8(p, nullptr);
  REQUIRE_FALSE(ld.ok());
  CHECK(ld.message().find("scale_ld 5 where k 640 needs 7, 640, 8") != std::string::npos);
}
