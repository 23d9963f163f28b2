#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/rmsnorm.h"
#include "kernels/rope.h"

namespace spark::kernels {

namespace {
// YaRN as transformers computes it: frequencies below the correction range are
// interpolated (divided by factor), those above it kept, a linear ramp between.
std::vector<float> yarn_inv_freq(int dim, double base, const hf::RopeScaling& s) {
  auto correction_dim = [&](double rotations) {
    return dim * std::log(s.original_max_position / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  for (int i = 0; i < dim / 2; ++i) {
    // float32 as the reference's torch arithmetic.
    const float pos_freq = static_cast<float>(
        std::pow(base, static_cast<double>(static_cast<float>(2 * i) / static_cast<float>(dim))));
    const float extra = 1.0f / pos_freq;
    const float inter = 1.0f / (static_cast<float>(s.factor) * pos_freq);
    const float ramp = std::clamp(static_cast<float>((i - low) / (high - low)), 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // the extrapolation factor
    inv[static_cast<size_t>(i)] = inter * (1.0f - keep) + extra * keep;
  }
  return inv;
}
}  // namespace

std::vector<float> rope_inv_freq(int head_dim, double theta, const hf::RopeScaling& s) {
  if (s.type == "yarn") return yarn_inv_freq(head_dim, theta, s);
  std::vector<float> inv(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i) {
    // Same float32 rounding as the reference implementation's inv_freq buffer.
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
    if (s.type == "linear") {
      f /= s.factor;
    } else if (s.type == "llama3") {
      const double low_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_wavelen = s.original_max_position / s.high_freq_factor;
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_wavelen) {
        f /= s.factor;
      } else if (wavelen >= high_wavelen) {
        double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[static_cast<size_t>(i)] = static_cast<float>(f);
  }
  return inv;
}

void rope_apply_ref(float* x, size_t n_tokens, int n_heads, int head_dim, const int32_t* positions,
                    const float* inv_freq, int rotary_dim) {
  const int half = (rotary_dim > 0 ? rotary_dim : head_dim) / 2;
  std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (size_t t = 0; t < n_tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      // The angle is rounded to float like the reference (float32 position * inv_freq).
      float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sn[static_cast<size_t>(i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + (t * static_cast<size_t>(n_heads) + static_cast<size_t>(h)) *
                         static_cast<size_t>(head_dim);
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cs[static_cast<size_t>(i)] - b * sn[static_cast<size_t>(i)];
        v[i + half] = b * cs[static_cast<size_t>(i)] + a * sn[static_cast<size_t>(i)];
      }
    }
  }
}

namespace {

void rope_heads_ref(float* base, size_t stride, int n_heads, const RopeArgs& a, const float* norm) {
  const size_t hd = static_cast<size_t>(a.head_dim);
  const size_t half = static_cast<size_t>(a.rotary_dim > 0 ? a.rotary_dim : a.head_dim) / 2;
  for (size_t t = 0; t < a.n_tokens; ++t)
    for (size_t h = 0; h < static_cast<size_t>(n_heads); ++h) {
      float* v = base + t * stride + h * hd;
      if (norm) rmsnorm_ref(v, norm, v, 1, hd, a.norm_eps);
      for (size_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(a.positions[t]) * a.inv_freq[i];
        const double c = std::cos(static_cast<double>(angle));
        const double s = std::sin(static_cast<double>(angle));
        const double x0 = v[i], x1 = v[i + half];
        v[i] = round_to(a.dtype, static_cast<float>(x0 * c - x1 * s));
        v[i + half] = round_to(a.dtype, static_cast<float>(x1 * c + x0 * s));
      }
      for (size_t i = 2 * half; i < hd; ++i) v[i] = round_to(a.dtype, v[i]);
    }
}

}  // namespace

void rope_ref(const RopeArgs& a) {
  rope_heads_ref(static_cast<float*>(a.q), a.q_stride, a.n_heads, a,
                 static_cast<const float*>(a.q_norm));
  if (a.k)
    rope_heads_ref(static_cast<float*>(a.k), a.k_stride, a.n_kv_heads, a,
                   static_cast<const float*>(a.k_norm));
}

Status rope_check_args(const RopeArgs& a) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "rope: " + std::move(m)); };
  if (a.head_dim <= 0 || a.head_dim % 2 != 0 || a.head_dim > 512)
    return bad(fmt::format("head_dim {} must be even and in [2, 512]", a.head_dim));
  if (a.n_heads <= 0) return bad(fmt::format("n_heads {} must be > 0", a.n_heads));
  if (a.dtype == DType::e4m3) return bad("q, k and v must be f32 or bf16 (fp8 is a cache type)");
  if (a.n_tokens == 0) return Status::Ok();
  if (!a.q || !a.positions || !a.inv_freq)
    return bad(fmt::format("null {} pointer", !a.q           ? "q"
                                              : !a.positions ? "positions"
                                                             : "inv_freq"));
  const size_t hd = static_cast<size_t>(a.head_dim);
  if (a.q_stride < static_cast<size_t>(a.n_heads) * hd)
    return bad(fmt::format("q_stride {} is less than n_heads * head_dim = {}", a.q_stride,
                           static_cast<size_t>(a.n_heads) * hd));
  if (a.k) {
    if (a.n_kv_heads <= 0) return bad(fmt::format("n_kv_heads {} must be > 0", a.n_kv_heads));
    if (a.k_stride < static_cast<size_t>(a.n_kv_heads) * hd)
      return bad(fmt::format("k_stride {} is less than n_kv_heads * head_dim = {}", a.k_stride,
                             static_cast<size_t>(a.n_kv_heads) * hd));
  }
  if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim)
    return bad(fmt::format("rotary_dim {} must be even and at most head_dim {}", a.rotary_dim,
                           a.head_dim));
  if (!std::isfinite(a.norm_eps) || a.norm_eps < 0)
    return bad(fmt::format("norm_eps {} must be finite and >= 0", a.norm_eps));
  return Status::Ok();
}

}  // namespace spark::kernels
