#include <cmath>

#include "kernels/rope.h"

namespace spark::kernels {

std::vector<float> rope_inv_freq(int head_dim, double theta, const hf::RopeScaling& s) {
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
                    const float* inv_freq) {
  const int half = head_dim / 2;
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

}  // namespace spark::kernels
