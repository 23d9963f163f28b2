// The FP8 products' CPU twins, the e4m3 decoder and the argument check both devices share.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/bf16.h"
#include "kernels/fp8.h"
#include "kernels/matmul.h"

namespace spark::kernels {

namespace {

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

size_t blocks_of(size_t k) {
  return (k + kFp8BlockK - 1) / kFp8BlockK;
}

// The 256 codes' values, decoded once (the twins widen every weight of a product).
const float* e4m3_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] = fp8_e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

// The weight w[row][col] exactly: e4m3's 4 significant bits times fp32's 24 fit a double.
double weight_at(const Fp8Weight& w, size_t row, size_t col) {
  const float s = w.scales[(row >> w.row_shift) * w.scale_ld + col / kFp8BlockK];
  return static_cast<double>(e4m3_table()[w.q[row * w.ldq + col]]) * s;
}

double product(const Fp8MatmulArgs& p, size_t i, size_t row) {
  const uint16_t* a = static_cast<const uint16_t*>(p.a) + i * p.lda;
  const uint16_t* nw = static_cast<const uint16_t*>(p.norm_w);
  double acc = 0, ss = 0;
  for (size_t t = 0; t < p.k; ++t) {
    const double x = bf16_to_float(a[t]);
    ss += x * x;
    acc += x * (nw ? bf16_to_float(nw[t]) : 1.0) * weight_at(p.w, row, t);
  }
  if (nw) acc /= std::sqrt(ss / static_cast<double>(p.k) + static_cast<double>(p.norm_eps));
  return acc;
}

// The bf16 nearest (ties to even) to the exact value hi + lo, where hi is that value rounded
// to float and lo_sign the sign of the rest: float_to_bf16(hi), but where hi lies exactly
// halfway between two bf16 values the rest decides the side (a second rounding to even
// could take the wrong one). fp8_matmul.cu rounds the same way.
uint16_t nearest_bf16(float hi, int lo_sign) {
  uint32_t u;
  std::memcpy(&u, &hi, sizeof u);
  const bool finite = (u & 0x7f800000u) != 0x7f800000u;
  if (finite && (u & 0xffffu) == 0x8000u && lo_sign != 0) {
    const bool away = (lo_sign > 0) == (hi > 0.f);  // bf16 bits grow with the magnitude
    return static_cast<uint16_t>((u >> 16) + (away ? 1u : 0u));
  }
  return float_to_bf16(hi);
}

}  // namespace

Status fp8_matmul_check(const Fp8MatmulArgs& a) {
  auto bad = [](const std::string& m) { return make_error(Errc::usage, "fp8 matmul: " + m); };
  if (a.n == 0 || a.k == 0) return bad(fmt::format("n {} and k {} must be > 0", a.n, a.k));
  if (a.k % 16 != 0) return bad(fmt::format("k {} must be a multiple of 16", a.k));
  if (a.w.row_shift != 0 && a.w.row_shift != 7)
    return bad(fmt::format("w.row_shift {} must be 0 or 7", a.w.row_shift));
  if (a.w.scale_ld < blocks_of(a.k))
    return bad(fmt::format("w.scale_ld {} is under ceil(k / {}) = {} scales a row", a.w.scale_ld,
                           kFp8BlockK, blocks_of(a.k)));
  if (a.swiglu && a.accumulate) return bad("swiglu with accumulate is not supported");
  if (a.m == 0) return Status::Ok();
  if (!a.a) return bad("null a pointer");
  if (!a.w.q) return bad("null w.q pointer");
  if (!a.w.scales) return bad("null w.scales pointer");
  if (!a.out) return bad("null out pointer");
  if (a.lda < a.k) return bad(fmt::format("lda {} is under k {}", a.lda, a.k));
  if (a.w.ldq < a.k) return bad(fmt::format("w.ldq {} is under k {}", a.w.ldq, a.k));
  if (a.ldo < a.n) return bad(fmt::format("ldo {} is under n {}", a.ldo, a.n));
  if (!aligned16(a.a) || a.lda % 8 != 0)
    return bad(
        fmt::format("a's rows must start on 16 bytes (a aligned, lda {} a multiple of 8)", a.lda));
  if (a.norm_w && !aligned16(a.norm_w)) return bad("norm_w must start on 16 bytes");
  if (!aligned16(a.w.q) || a.w.ldq % 16 != 0)
    return bad(fmt::format(
        "w.q's rows must start on 16 bytes (w.q aligned, w.ldq {} a multiple of 16)", a.w.ldq));
  return Status::Ok();
}

Status fp8_dequantize_check(const Fp8Weight& w, size_t row0, size_t rows, size_t k, const void* out,
                            size_t ldo) {
  auto bad = [](const std::string& m) { return make_error(Errc::usage, "fp8 dequantize: " + m); };
  if (k == 0) return bad("k must be > 0");
  if (w.row_shift != 0 && w.row_shift != 7)
    return bad(fmt::format("w.row_shift {} must be 0 or 7", w.row_shift));
  if (w.scale_ld < blocks_of(k))
    return bad(fmt::format("w.scale_ld {} is under ceil(k / {}) = {} scales a row", w.scale_ld,
                           kFp8BlockK, blocks_of(k)));
  if (rows == 0) return Status::Ok();
  if (!w.q) return bad("null w.q pointer");
  if (!w.scales) return bad("null w.scales pointer");
  if (!out) return bad("null out pointer");
  if (w.ldq < k) return bad(fmt::format("w.ldq {} is under k {}", w.ldq, k));
  if (ldo < k) return bad(fmt::format("ldo {} is under k {}", ldo, k));
  if (row0 > std::numeric_limits<size_t>::max() - rows)
    return bad(fmt::format("rows {} from row0 {} overflow", rows, row0));
  return Status::Ok();
}

void fp8_matmul_ref(const Fp8MatmulArgs& p) {
  for (size_t i = 0; i < p.m; ++i)
    for (size_t j = 0; j < p.n; ++j) {
      const uint16_t* bias = static_cast<const uint16_t*>(p.bias);
      const size_t off = i * p.ldo + j;
      float result;
      if (p.swiglu) {
        double g = product(p, i, j), u = product(p, i, p.n + j);
        if (bias) g += bf16_to_float(bias[j]), u += bf16_to_float(bias[p.n + j]);
        // g and u as a [gate | up] buffer of out_dtype would hold them, then swiglu_ref's
        // expression.
        const double gr = round_to(p.out_dtype, static_cast<float>(g));
        const double ur = round_to(p.out_dtype, static_cast<float>(u));
        result = static_cast<float>(gr / (1.0 + std::exp(-gr)) * ur);
      } else {
        double s = product(p, i, j);
        if (bias) s += bf16_to_float(bias[j]);
        if (p.accumulate)
          s += p.out_dtype == DType::bf16 ? bf16_to_float(static_cast<const uint16_t*>(p.out)[off])
                                          : static_cast<const float*>(p.out)[off];
        result = static_cast<float>(s);
      }
      if (p.out_dtype == DType::bf16)
        static_cast<uint16_t*>(p.out)[off] = float_to_bf16(result);
      else
        static_cast<float*>(p.out)[off] = result;
    }
}

void fp8_dequantize_ref(const Fp8Weight& w, size_t row0, size_t rows, size_t k, uint16_t* out,
                        size_t ldo) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < k; ++c) {
      const double x = weight_at(w, row0 + r, c);
      const float hi = static_cast<float>(x);
      const double lo = std::isfinite(hi) ? x - static_cast<double>(hi) : 0.0;
      out[r * ldo + c] = nearest_bf16(hi, (lo > 0) - (lo < 0));
    }
}

Status fp8_quantize_rows_check(const void* a, size_t lda, size_t m, size_t k, const Fp8Rows& out) {
  auto bad = [](const std::string& msg) {
    return make_error(Errc::usage, "fp8 quantize rows: " + msg);
  };
  if (k == 0 || k % 8 != 0) return bad(fmt::format("k {} must be a positive multiple of 8", k));
  if (m == 0) return Status::Ok();
  if (!a) return bad("null a pointer");
  if (!out.q) return bad("null q pointer");
  if (!out.scales) return bad("null scales pointer");
  if (lda < k || lda % 8 != 0 || !aligned16(a))
    return bad(fmt::format("a's rows must start on 16 bytes and hold k {} (lda {})", k, lda));
  if (out.ldq < k || out.ldq % 4 != 0 || reinterpret_cast<uintptr_t>(out.q) % 4 != 0)
    return bad(fmt::format("q's rows must start on 4 bytes and hold k {} (ldq {})", k, out.ldq));
  if (out.scale_ld < m) return bad(fmt::format("scale_ld {} is under m {}", out.scale_ld, m));
  return Status::Ok();
}

void fp8_quantize_rows_ref(const uint16_t* a, size_t lda, size_t m, size_t k, const Fp8Rows& out) {
  for (size_t r = 0; r < m; ++r)
    for (size_t kb = 0; kb < blocks_of(k); ++kb) {
      const size_t c0 = kb * kFp8BlockK, c1 = std::min(k, c0 + kFp8BlockK);
      float amax = 0.f;  // fmax skips a NaN, as the device's fmaxf does
      for (size_t c = c0; c < c1; ++c)
        amax = std::fmax(amax, std::fabs(bf16_to_float(a[r * lda + c])));
      const float scale = amax > 0.f ? amax / 448.f : 1.f;
      out.scales[kb * out.scale_ld + r] = scale;
      for (size_t c = c0; c < c1; ++c)
        out.q[r * out.ldq + c] = fp8_e4m3_code(bf16_to_float(a[r * lda + c]) / scale);
    }
}

bool fp8_tc_weight_ok(const Fp8Weight& w, size_t k) {
  return w.row_shift == 7 && k % 16 == 0 && w.ldq == k && w.scale_ld == fp8_tc_scale_ld(k) &&
         aligned16(w.q) && aligned16(w.scales);
}

Status fp8_tc_check(const Fp8TcArgs& a) {
  auto bad = [](const std::string& m) { return make_error(Errc::usage, "fp8 tc: " + m); };
  if (a.n == 0 || a.k == 0) return bad(fmt::format("n {} and k {} must be > 0", a.n, a.k));
  if (a.m % kFp8TcRowAlign != 0)
    return bad(fmt::format("m {} must be a multiple of {}", a.m, kFp8TcRowAlign));
  if (!fp8_tc_weight_ok(a.w, a.k))
    return bad(
        fmt::format("the weight is not laid out for the tensor cores (row_shift {}, ldq {}, "
                    "scale_ld {} where k {} needs 7, {}, {}, 16-byte aligned)",
                    a.w.row_shift, a.w.ldq, a.w.scale_ld, a.k, a.k, fp8_tc_scale_ld(a.k)));
  if (a.m == 0) return Status::Ok();
  if (!a.a || !a.a_scales || !a.out) return bad("null a, a_scales or out pointer");
  if (a.lda < a.k || a.lda % 16 != 0 || !aligned16(a.a))
    return bad(fmt::format("a's rows must start on 16 bytes and hold k {} (lda {})", a.k, a.lda));
  if (!aligned16(a.a_scales)) return bad("a_scales must start on 16 bytes");
  if (a.ldo < a.n || a.ldo % 8 != 0 || !aligned16(a.out))
    return bad(fmt::format("out's rows must start on 16 bytes and hold n {} (ldo {})", a.n, a.ldo));
  if (a.bias && !aligned16(a.bias)) return bad("bias must start on 16 bytes");
  return Status::Ok();
}

}  // namespace spark::kernels
