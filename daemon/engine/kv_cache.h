#pragma once
// Paged KV cache storage: per layer a pool of blocks of `block_size` token slots for K and
// V (this rank's KV heads only), allocated on the model's device (fp32 on the CPU; bf16, fp32
// or fp8 e4m3 on a GPU; KV_DTYPE=fp8 on the CPU keeps fp32 pools of e4m3 values). Latent attention
// (DeepSeek-V3) keeps one pool instead: per token the normalised latent and the rotated RoPE key,
// kv_lora_rank + qk_rope_head_dim values (576 at DeepSeek-V3's widths), the same on every
// tensor-parallel rank. Which block belongs to whom is the BlockManager's job (block_manager.h);
// the model only reads and writes through block tables.
//
// A model whose layers mix sliding-window and full attention (gpt-oss) may keep its windowed
// layers apart: those layers then hold `window_blocks` blocks of their own (a small ring per
// sequence, a circular buffer of positions big enough for the window and one step's tokens)
// instead of `num_blocks`, and their
// views say so (KVLayerView::windowed), so a device reads them through the step's window
// tables and slots (StepLayout).
#include <cstddef>
#include <memory>
#include <vector>

#include "daemon/engine/device.h"
#include "daemon/engine/model_config.h"
#include "kernels/paged_attention.h"

namespace spark::engine {

/// What one layer of a cache keeps per token: `pools` pools (2: K and V; 1: latent
/// attention's one row) of n_kv_heads x head_dim values.
struct KVShape {
  int n_kv_heads = 0, head_dim = 0, pools = 2;
};
/// The cache shape of `c` at a rank holding `local_kv_heads` KV heads: K and V per head of
/// head_dim, or for latent attention one row of kv_lora_rank + qk_rope_head_dim (whatever the
/// rank holds of the heads).
KVShape kv_shape(const ModelConfig& c, int local_kv_heads);

class KVCache {
 public:
  /// fp32 pools on the CPU.
  KVCache(int num_layers, int num_blocks, int block_size, int n_kv_heads, int head_dim);
  /// Pools of `type` on `device` (Errc::resource when they do not fit).
  static Result<std::unique_ptr<KVCache>> create(Device& device, ElemType type, int num_layers,
                                                 int num_blocks, int block_size, int n_kv_heads,
                                                 int head_dim);
  /// The same for a cache of `shape` (one pool: the view's v is null). Layers with
  /// `windowed[l]` (when `window_blocks` > 0) get `window_blocks` blocks of their own.
  static Result<std::unique_ptr<KVCache>> create(Device& device, ElemType type, int num_layers,
                                                 int num_blocks, int block_size,
                                                 const KVShape& shape,
                                                 const std::vector<bool>& windowed = {},
                                                 int window_blocks = 0);
  /// Blocks of each windowed layer's own pool (0: every layer reads the shared blocks).
  int window_blocks() const { return window_blocks_; }
  /// Whether layer `l` keeps its blocks apart.
  bool windowed(int l) const {
    return window_blocks_ > 0 && l >= 0 && static_cast<size_t>(l) < windowed_.size() &&
           windowed_[static_cast<size_t>(l)];
  }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  ElemType type() const { return type_; }
  /// fp32 pools that keep only e4m3 values (KV_DTYPE=fp8 on the CPU, KVLayerView::fp8_values).
  void set_fp8_values(bool on) { fp8_values_ = on; }
  bool fp8_values() const { return fp8_values_; }
  /// The device that holds the pools ("cpu", "cuda").
  const std::string& device_kind() const { return device_kind_; }
  /// Layer `l`'s pools.
  KVLayerView view(int l) const;
  /// Layer `l`'s pools in the layout paged_attention_ref expects (fp32 CPU caches only).
  kernels::PagedKVLayer layer(int l);
  /// Bytes of K+V storage.
  size_t bytes() const { return k_.bytes() + v_.bytes(); }
  /// Bytes one block takes over all layers, K and V, for `type`.
  static uint64_t block_bytes(ElemType type, int num_layers, int block_size, int n_kv_heads,
                              int head_dim);
  static uint64_t block_bytes(ElemType type, int num_layers, int block_size, const KVShape& shape);

 private:
  KVCache() = default;
  int num_blocks_ = 0, block_size_ = 0, n_kv_heads_ = 0, head_dim_ = 0, pools_ = 2;
  int window_blocks_ = 0;
  std::vector<bool> windowed_;
  std::vector<size_t> offset_;  // per layer: its first element in each pool
  ElemType type_ = ElemType::f32;
  bool fp8_values_ = false;
  std::string device_kind_;
  Buffer k_, v_;
};

}  // namespace spark::engine
