#pragma once
// The tensor-parallel shard plan (Megatron): which slice of which checkpoint tensor each
// rank holds and where it goes. Each rank holds heads/world query heads and
// kv_heads/world KV heads (q/k/v rows), the matching o_proj columns, intermediate/world
// gate/up rows (fused as [gate | up]) and down_proj columns; embedding and norms are
// replicated. lm_head is vocab-parallel: each rank holds vocab/world rows (its slice of the
// vocabulary; with tied embeddings a view of the replicated embedding) and the logits are
// gathered, so no rank reads or multiplies the whole lm_head. A vocabulary that world does
// not divide keeps lm_head replicated. The same plan fills host buffers (CPU) or device
// buffers (CUDA).
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/safetensors.h"

namespace spark::engine {

/// The weights of the model, each one destination buffer (per layer where `layer` >= 0).
enum class WeightRole {
  embed,
  final_norm,
  lm_head,
  in_norm,
  post_norm,
  q_norm,
  k_norm,
  wq,
  wk,
  wv,
  wo,
  bq,
  bk,
  bv,
  bo,
  w_gate_up,
  w_down,
  b_gate_up,
  b_down,
};
inline constexpr int kWeightRoles = static_cast<int>(WeightRole::b_down) + 1;

/// One read: `slice` of checkpoint tensor `tensor` (full shape `shape`) into elements
/// [dst_offset, dst_offset + rows * cols) of the destination (layer, role).
struct ShardRead {
  std::string tensor;
  std::vector<int64_t> shape;
  Slice slice;
  int64_t rows = 0, cols = 0;  // of the slice
  int layer = -1;
  WeightRole role = WeightRole::embed;
  size_t dst_offset = 0;
};

/// One destination buffer and its size in elements.
struct ShardDest {
  int layer = -1;
  WeightRole role = WeightRole::embed;
  size_t numel = 0;
  bool matrix = false;  // a weight matrix (kept in the device's compute type)
};

struct ShardPlan {
  int rank = 0, world = 1;
  int heads = 0, kv_heads = 0, inter = 0;  // this rank's share
  bool vocab_parallel = false;             // lm_head split by vocabulary rows
  int vocab0 = 0, vocab = 0;               // this rank's lm_head rows [vocab0, vocab0 + vocab)
  std::vector<ShardDest> dests;
  std::vector<ShardRead> reads;  // in file-friendly order (layer by layer)
};

/// The plan for rank `rank` of `world`; Errc::config when `world` does not divide the
/// heads, KV heads and intermediate size (naming them and the fix).
Result<ShardPlan> make_shard_plan(const ModelConfig& cfg, int rank, int world,
                                  const std::string& where);

}  // namespace spark::engine
