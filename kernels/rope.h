#pragma once
// Rotary position embedding in the "rotate half" layout Hugging Face uses for Llama, Qwen
// and Mistral: element i of a head pairs with element i + head_dim/2.
// rope_apply_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/hf/config.h"

namespace spark::kernels {

/// head_dim/2 inverse frequencies theta^(-2i/head_dim), scaled as config.json asks: type
/// "default", "linear" (divide by factor) or "llama3" (Llama 3.1 wavelength-banded scaling).
std::vector<float> rope_inv_freq(int head_dim, double theta, const hf::RopeScaling& scaling);

/// Rotates x in place: x is [n_tokens][n_heads][head_dim]; token t sits at positions[t].
void rope_apply_ref(float* x, size_t n_tokens, int n_heads, int head_dim, const int32_t* positions,
                    const float* inv_freq);

}  // namespace spark::kernels
