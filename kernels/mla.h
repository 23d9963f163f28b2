#pragma once
// Multi-head latent attention (DeepSeek-V3) over a paged latent cache, the CPU reference.
// A layer's cache is one pool of blocks of [block_size][latent + rope] floats (PagedKVLayer
// with n_kv_heads 1, head_dim latent + rope, no V): per token the RMS-normalised latent and
// the rotated RoPE key, shared by every head. Attention runs with kv_b_proj absorbed: each
// head's q_nope goes into the latent space through that head's key rows of kv_b_proj (W_UK),
// the scores are q_lat . latent + q_pe . k_pe, the softmax-weighted latents come out through
// the head's value rows (W_UV). Exactly the attention of the per-head keys [k_nope | k_pe] and
// values v that kv_b_proj would expand.
#include <cstddef>
#include <cstdint>

#include "kernels/paged_attention.h"

namespace spark::kernels {

struct MlaShape {
  int heads = 0;  // query heads (this rank's)
  int nope = 0, rope = 0, v_dim = 0, latent = 0;
  /// RoPE over pairs (2i, 2i + 1) (DeepSeek's interleaved layout), else over (i, i + rope / 2).
  bool interleave = true;
  float rope_factor = 1.f;  // YaRN's attention factor on cos and sin (the rotated part only)
  float scale = 0.f;        // softmax scale
};

/// Rotates the `rope` values of x at position `pos` by inv_freq ([rope / 2]), times factor.
void mla_rope_ref(float* x, int rope, int pos, const float* inv_freq, bool interleave,
                  float factor);

/// For each of n tokens: kv_a's row ([latent + rope]) gets its latent RMS-normalised times
/// `norm` ([latent]) and its k_pe rotated at positions[t], in place, and is written to the
/// cache through `block_table`.
void mla_kv_write_ref(const PagedKVLayer& kv, const int32_t* block_table, const int32_t* positions,
                      size_t n, float* kv_a, const float* norm, float eps, const float* inv_freq,
                      const MlaShape& s);

/// q ([n][heads][nope + rope]; q_pe rotated here, in place) attends causally over cache
/// positions 0 .. positions[t]; kv_b ([heads][nope + v_dim][latent]: this rank's heads of
/// kv_b_proj); out [n][heads][v_dim]. Softmax and sums in double.
void mla_attention_ref(const PagedKVLayer& kv, const int32_t* block_table, const int32_t* positions,
                       size_t n, float* q, const float* kv_b, const float* inv_freq, float* out,
                       const MlaShape& s);

}  // namespace spark::kernels
