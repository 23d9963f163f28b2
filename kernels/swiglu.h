#pragma once
// SwiGLU activation of the MLP: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + e^-x).
// swiglu_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>

namespace spark::kernels {

/// n elements; out may alias gate.
void swiglu_ref(const float* gate, const float* up, float* out, size_t n);

}  // namespace spark::kernels
