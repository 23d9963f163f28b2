#pragma once
// Rotary position embedding in the "rotate half" layout Hugging Face uses for Llama, Qwen
// and Mistral: element i of a head pairs with element i + head_dim/2.
// rope_apply_ref is the CPU reference twin of the CUDA kernel.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hf/config.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// head_dim/2 inverse frequencies theta^(-2i/head_dim), scaled as config.json asks: type
/// "default", "linear" (divide by factor) or "llama3" (Llama 3.1 wavelength-banded scaling).
std::vector<float> rope_inv_freq(int head_dim, double theta, const hf::RopeScaling& scaling);

/// Rotates x in place: x is [n_tokens][n_heads][head_dim]; token t sits at positions[t].
/// With rotary_dim (> 0, even, <= head_dim) only the first rotary_dim elements of each head
/// rotate (pairs i, i + rotary_dim/2; inv_freq has rotary_dim/2 entries) and the rest pass
/// unchanged (partial rotary: GLM-4.5, MiniMax-M2).
void rope_apply_ref(float* x, size_t n_tokens, int n_heads, int head_dim, const int32_t* positions,
                    const float* inv_freq, int rotary_dim = 0);

/// One RoPE launch over the q and k heads of a batch of tokens, typically inside a fused
/// QKV row (token t's q head h at q + t*q_stride + h*head_dim, likewise k). With q_norm /
/// k_norm set (head_dim weights each, type `dtype`), each head is RMS-normalised first
/// (Qwen3), fused into the same pass. All pointers are device pointers.
struct RopeArgs {
  DType dtype = DType::bf16;  // of q, k and the norm weights
  void* q = nullptr;
  size_t q_stride = 0;  // elements between tokens
  int n_heads = 0;
  void* k = nullptr;  // may be null (rotate q only)
  size_t k_stride = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // even, <= 512
  size_t n_tokens = 0;
  const int32_t* positions = nullptr;  // [n_tokens]
  const float* inv_freq = nullptr;     // [rotary_dim/2], from rope_inv_freq
  int rotary_dim = 0;  // > 0: only the first rotary_dim elements of a head rotate (partial)
  const void* q_norm = nullptr;  // optional per-head RMSNorm weights
  const void* k_norm = nullptr;
  float norm_eps = 1e-6f;
  // Optional, device only: also write the rotated k rows and the v rows of each token to
  // the paged cache at slots[t] (the KV write, in the same launch). The cache holds
  // rows of n_kv_heads * head_dim elements of cache_dtype; a slot outside
  // [0, cache_slots) is skipped, as paged_kv_write_cuda_device skips it.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  DType cache_dtype = DType::bf16;
  long long cache_slots = 0;
  const int32_t* slots = nullptr;  // [n_tokens]
  const void* v = nullptr;         // [n_tokens] rows of n_kv_heads * head_dim, stride v_stride
  size_t v_stride = 0;
};

/// Reference of rope_cuda_device on host float arrays (same fields, host pointers): optional
/// per-head RMSNorm, then rotation, each head's result rounded once to args.dtype.
void rope_ref(const RopeArgs& args_on_host);

/// Checks RopeArgs (non-null, even head_dim <= 512, strides that hold the heads).
Status rope_check_args(const RopeArgs& a);

/// Normalises (optionally) and rotates q and k in place on `stream`. fp32 math: the angle
/// is float(position) * inv_freq as the reference computes it, sin/cos at full precision.
Status rope_cuda_device(const RopeArgs& args, void* stream);

}  // namespace spark::kernels
