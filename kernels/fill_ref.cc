#include "kernels/bf16.h"
#include "kernels/fill.h"

namespace spark::kernels {

void fill_random_ref(void* dst, DType t, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = 0; i < n; ++i) {
    const float v = fill_value(seed, i, scale, offset);
    if (t == DType::bf16)
      static_cast<bf16_bits*>(dst)[i] = float_to_bf16(v);
    else
      static_cast<float*>(dst)[i] = v;
  }
}

}  // namespace spark::kernels
