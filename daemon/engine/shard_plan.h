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
//
// Routed experts are split one of two ways (EXPERT_PARALLEL, plan::MoeSplit): tensor-parallel, each
// rank a 1/world share of every expert's intermediate dimension (one all-reduce per MoE layer, as
// the dense MLP), or expert-parallel, each rank ceil(E/world) whole experts (tokens routed to
// another rank's experts add nothing here; the same all-reduce sums the ranks' shares).
// Each family's file (family_*.cc) writes its plan with the builders below.
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model_plan.h"
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
  router,             // [experts][hidden], replicated
  router_bias,        // [experts] fp32: e_score_correction_bias (choice only)
  experts_gate_up,    // [local experts][2 * local expert inter][hidden]: per expert [gate | up]
  experts_down,       // [local experts][hidden][local expert inter]
  shared_gate_up,     // the shared experts as one MLP: [2 * local shared inter][hidden]
  shared_down,        // [hidden][local shared inter]
  sinks,              // [local heads] fp32: gpt-oss's learned attention sink logits
  router_b,           // [experts]: the router's logit bias (gpt-oss)
  experts_gate_up_b,  // [local experts][2 * local expert inter] (gpt-oss, interleaved)
  experts_down_b,     // [local experts][hidden] (rank 0 only when experts are split by width)
  // Latent attention (DeepSeek-V3; wq holds q_b_proj, or q_proj without q LoRA, and wo o_proj,
  // each this rank's heads).
  wq_a,       // q_a_proj [q_lora_rank][hidden], replicated
  q_a_norm,   // q_a_layernorm [q_lora_rank]
  wkv_a,      // kv_a_proj_with_mqa [kv_lora_rank + qk_rope_head_dim][hidden], replicated
  kv_a_norm,  // kv_a_layernorm [kv_lora_rank]
  wkv_b,      // kv_b_proj: per local head [qk_nope_head_dim + v_head_dim][kv_lora_rank]
};
inline constexpr int kWeightRoles = static_cast<int>(WeightRole::wkv_b) + 1;

/// One read: `slice` of checkpoint tensor `tensor` (full shape `shape`) into elements
/// [dst_offset, dst_offset + rows * cols) of the destination (layer, role).
struct ShardRead {
  std::string tensor;
  /// MXFP4 (`X_blocks` U8 [.., rows, cols / 32, 16] with `X_scales` U8 [.., rows, cols / 32]):
  /// the read widens expert `mx_expert`'s rows [mx_row0, mx_row0 + rows) and value columns
  /// [mx_col0, mx_col0 + cols) of the [rows][cols] matrix `mx_cols` wide (rows/cols below).
  bool mxfp4 = false;
  int64_t mx_expert = 0, mx_row0 = 0, mx_col0 = 0, mx_cols = 0;
  std::vector<int64_t> shape;
  Slice slice;
  int64_t rows = 0, cols = 0;  // of the slice
  int layer = -1;
  WeightRole role = WeightRole::embed;
  size_t dst_offset = 0;
};

/// How a destination is kept on a device.
enum class DestKind : uint8_t {
  matrix,  // a weight matrix: the device's compute type
  vector,  // norms and biases: the device's vector type
  f32,     // fp32 on every device (router correction bias: added before a choice)
};

/// One destination buffer and its size in elements.
struct ShardDest {
  int layer = -1;
  WeightRole role = WeightRole::embed;
  size_t numel = 0;
  bool matrix = false;  // a weight matrix (kept in the device's compute type)
  DestKind kind = DestKind::vector;
  /// An FP8 checkpoint's projection that the devices keep as stored (mark_fp8_dests): one
  /// byte a weight, rows of `cols`, and fp32 block scales of `scale_rows` x `scale_ld`, each
  /// scale row covering `1 << scale_row_shift` rows (7: the checkpoint's 128-row blocks; 0:
  /// one per row, where the matrix's row segments do not start on block boundaries) and
  /// ceil(cols / 128) blocks, padded with zeros to a multiple of 4 (kernels::fp8_tc_scale_ld).
  bool fp8 = false;
  /// MXFP4 experts (gpt-oss) that a device keeping MXFP4 holds packed as stored: half a byte
  /// a weight, rows of `cols`, and one e8m0 byte per 32 columns of each row (scale_rows =
  /// rows, scale_ld = cols / 32, scale_row_shift 0).
  bool mxfp4 = false;
  int64_t cols = 0;
  int scale_row_shift = 7;
  size_t scale_rows = 0, scale_ld = 0;
  uint64_t scale_bytes() const {
    return fp8 ? uint64_t{scale_rows} * scale_ld * 4 : mxfp4 ? uint64_t{scale_rows} * scale_ld : 0;
  }
  /// Bytes held where FP8 / MXFP4 stay as stored (else `matrix_bytes` a weight).
  uint64_t packed_bytes() const {
    return fp8 ? numel + scale_bytes() : mxfp4 ? numel / 2 + scale_bytes() : 0;
  }
};

struct ShardPlan {
  int rank = 0, world = 1;
  int heads = 0, kv_heads = 0, inter = 0;  // this rank's share
  bool vocab_parallel = false;             // lm_head split by vocabulary rows
  int vocab0 = 0, vocab = 0;               // this rank's lm_head rows [vocab0, vocab0 + vocab)
  // Mixture of experts (experts == 0 on a dense model).
  plan::MoeSplit placement = plan::MoeSplit::tensor;  // never automatic once planned
  std::string placement_reason;                       // why, for plan, /health and status
  int expert0 = 0, experts = 0;  // routed experts held: [expert0, expert0 + experts)
  int expert_inter = 0;          // of each held expert's intermediate dimension
  int shared_inter = 0;          // of the shared experts' intermediate (0: none here)
  std::vector<ShardDest> dests;
  std::vector<ShardRead> reads;  // in file-friendly order (layer by layer)
  /// Tensors in the files the plan leaves unread on purpose (multi-token-prediction
  /// layers), for the load report.
  std::vector<std::string> skipped_prefixes;
  /// Bytes of the weights this rank holds at `matrix_bytes` per matrix element and
  /// `vector_bytes` per vector element (fp32 vectors count 4).
  /// With `fp8_kept`, the FP8 destinations at a byte a weight plus their scales (a device
  /// that keeps FP8 as stored), else at `matrix_bytes` (one that widens them); with
  /// `mxfp4_kept`, the MXFP4 experts at half a byte a weight plus a byte per 32.
  uint64_t held_bytes(int matrix_bytes, int vector_bytes, bool fp8_kept = true,
                      bool mxfp4_kept = true) const;
};

/// What a plan is made for.
struct PlanOptions {
  int rank = 0, world = 1;
  plan::MoeSplit placement = plan::MoeSplit::automatic;  // EXPERT_PARALLEL
};

/// The plan for rank `rank` of `world`; Errc::config when `world` does not divide the
/// heads, KV heads and intermediate size (naming them and the fix).
Result<ShardPlan> make_shard_plan(const ModelConfig& cfg, int rank, int world,
                                  const std::string& where);
Result<ShardPlan> make_shard_plan(const ModelConfig& cfg, const PlanOptions& opts,
                                  const std::string& where);

/// A weight matrix of a linear projection (q/k/v/o, the MLPs, the experts): what an FP8
/// checkpoint stores in e4m3 with block scales.
bool is_projection(WeightRole r);
/// With FP8 weights, every projection slice of the plan must be whole scale blocks (the
/// device keeps a block's scale with its values); Errc::config naming the tensor, the
/// rank's rows and columns and the fix otherwise.
Status check_fp8_blocks(const ModelConfig& c, const ShardPlan& p, const std::string& where);
/// With FP8 weights, marks the destinations kept as stored (ShardDest::fp8): every weight
/// matrix all of whose reads are projections not listed in modules_to_not_convert, from
/// whole 128-column blocks; except latent attention's kv_b, which its attention reads in the
/// compute type (widened at load).
void mark_fp8_dests(const ModelConfig& c, ShardPlan* p);

/// The builders a family's plan is written with.
class PlanBuilder {
 public:
  PlanBuilder(ShardPlan* p) : p_(p) {}
  void dest(int layer, WeightRole role, size_t numel, DestKind kind);
  void read(std::string name, std::vector<int64_t> shape, Slice s, int layer, WeightRole role,
            size_t off = 0);
  /// Embedding, final norm and (unless tied) the vocab-parallel lm_head.
  void embedding_and_head(const ModelConfig& c);
  /// Input and post-attention norms, q/k/v/o (with their biases and q/k norms as the config
  /// says), this rank's heads.
  void attention(const ModelConfig& c, int layer);
  /// The same for latent attention: q (LoRA pair or direct), kv_a and the norms whole on
  /// every rank; q_b/q_proj, kv_b rows and o_proj columns of this rank's heads.
  void mla_attention(const ModelConfig& c, int layer);
  /// A gated MLP (gate and up fused as [gate | up]) under `prefix` ("model.layers.L.mlp."),
  /// `inter` wide in the files, this rank's `[inter0, inter0 + n)` rows, with the names of
  /// its three projections (gate, up, down).
  void gated_mlp(const std::string& prefix, const char* gate, const char* up, const char* down,
                 int64_t hidden, int64_t inter, int64_t inter0, int64_t n, int layer,
                 WeightRole gate_up_role, WeightRole down_role, bool bias);

 private:
  ShardPlan* p_;
};

}  // namespace spark::engine
