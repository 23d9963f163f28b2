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

#include "core/error.h"
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

/// The same on the device, over a step's tokens in the layout of AttentionBatch (chunks of
/// query tokens, the last of each chunk's seq_lens positions): q, kv_a, kv_norm, kv_b and out
/// bf16 (q's q_pe and kv_a rotated and normalised in place), the cache bf16 or f32 (kv.k,
/// n_kv_heads 1, head_dim latent + rope, no V), inv_freq float. Token t's row goes to slot
/// slots[t] (< 0 or outside the pool: not written), then every token attends over its
/// chunk's cache positions 0 .. positions[t]. Four launches (five over 32 ranges): q_nope into
/// the latent space (fp32, in the workspace), the rows written, the attention over `splits`
/// ranges of the context (each a group of heads reading each cache row once), and the ranges
/// combined and taken out through W_UV (over 32 ranges the combine is a launch of its own,
/// spread over slices of the latent, so that no block reads every range's partial of a head).
/// fp32 accumulation throughout. The attention
/// runs on the tensor cores (mma.sync, bf16 products, fp32 sums; the latent query and the
/// softmax weights rounded to bf16 for them) for a bf16 cache of latent 512 and a rope of a
/// multiple of 16, groups of up to 64 heads; otherwise (an f32 cache, other widths, or
/// scalar_attention) the scalar fp32 kernel, groups of 4 heads.
struct MlaCudaArgs {
  MlaShape s;
  float eps = 0.f;
  void* q = nullptr;
  void* kv_a = nullptr;
  const void* kv_norm = nullptr;
  const void* kv_b = nullptr;
  const float* inv_freq = nullptr;
  void* out = nullptr;
  PagedKVDevice kv;
  const int32_t* block_tables = nullptr;  // [n_seqs][max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* positions = nullptr;    // [n_tokens]
  const int32_t* slots = nullptr;        // [n_tokens]
  const int32_t* query_start = nullptr;  // [n_seqs + 1]
  int n_seqs = 0;
  size_t n_tokens = 0;
  int max_seq_len = 0;  // a bound on every chunk's context (positions[t] < max_seq_len)
  int splits = 1;       // ranges of the context per token (mla_splits)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;     // at least mla_workspace_bytes(n_tokens, s, splits)
  bool scalar_attention = false;  // the scalar attention kernel where the tensor-core one fits
};

/// Context ranges a token's attention may take (MlaCudaArgs::splits) and what they are made of.
/// A range's partial is kMlaPartHead floats (the running maximum, the sum, two of padding, so
/// that the latent context after them is 16-byte aligned) and then the latent's. At run time a
/// token's context is shared out over the ranges, each at least kMlaMinRange positions (one
/// tile of the tensor-core attention), so a short context in a graph captured for long ones
/// leaves the last ranges empty (their maximum and sum alone written, the combine passing
/// over them).
constexpr int kMlaMaxSplits = 256;
constexpr int kMlaMinRange = 32;
constexpr int kMlaPartHead = 4;

/// Context ranges per token: one for prefill (many tokens keep the GPU busy); for a decode
/// step of n_tokens, enough that the attention's blocks (a token's heads in groups of up to 64,
/// each group a block per range) fill the device's sm_count multiprocessors (twice over at 16
/// heads or fewer, where a block is two warps and two fit a multiprocessor), at most one per
/// kMlaMinRange positions of max_seq_len and kMlaMaxSplits. A batch-1 decode of 128 heads thus
/// takes 66 ranges on a 132-SM H100 (132 blocks), 16 heads 256 (two blocks a multiprocessor);
/// a batch of 8 tokens of 128 heads 9.
int mla_splits(int max_seq_len, bool decode, size_t n_tokens, int heads, int sm_count);
/// The workspace every step of up to n_tokens tokens (decode: of any count up to it) needs.
size_t mla_workspace_reserve(size_t n_tokens, const MlaShape& s, int max_seq_len, bool decode,
                             int sm_count);
/// Workspace of mla_cuda_device: each token's heads' latent queries (rounded up to a multiple
/// of 4 floats; over 32 ranges the combined latent contexts go over them) and each range's
/// partial (kMlaPartHead + latent floats), fp32, then the latent queries again in bf16 (what
/// the tensor-core attention reads).
size_t mla_workspace_bytes(size_t n_tokens, const MlaShape& s, int splits);
/// Checks the arguments (shapes, pointers, workspace, shared memory) and launches.
Status mla_cuda_device(const MlaCudaArgs& a, void* stream);

}  // namespace spark::kernels
