#pragma once
// Rotary position embedding in the "rotate half" layout Hugging Face uses for Llama, Qwen
// and Mistral: element i of a head pairs with element i + head_dim/2.
// rope_apply_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spark::kernels {

/// RoPE frequency scaling. type: "default", "linear" (divide by factor) or "llama3"
/// (Llama 3.1 wavelength-banded scaling).
struct RopeScalingParams {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192;
};

/// head_dim/2 inverse frequencies theta^(-2i/head_dim), scaled as asked.
std::vector<float> rope_inv_freq(int head_dim, double theta, const RopeScalingParams& scaling);

/// Rotates x in place: x is [n_tokens][n_heads][head_dim]; token t sits at positions[t].
void rope_apply_ref(float* x, size_t n_tokens, int n_heads, int head_dim, const int32_t* positions,
                    const float* inv_freq);

}  // namespace spark::kernels
