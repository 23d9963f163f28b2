#pragma once
// The memory plan of a model per rank, layer type by layer type: what each kind of layer
// keeps per token of context (attention K/V, an MLA latent, sparse-attention indexer keys),
// what it keeps per sequence regardless of length (a linear-attention / recurrent state),
// the rank's share of the weights, and the fixed costs an engine charges. One plan for
// `sparkctl plan`, preflight's mem.plan and the engine's own KV sizing, so the three can
// never disagree. Plan context from memory, never the reverse.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hf/config.h"

namespace spark::plan {

/// What a layer keeps for a sequence; read from config.json (`layer_types`, else the
/// attention kind the config implies).
enum class LayerKind {
  full_attention,     // K and V per KV head per token
  sliding_attention,  // the same, at most `sliding_window` tokens per sequence
  mla,                // one latent (kv_lora_rank) + RoPE key (qk_rope_head_dim) per token
  sparse_mla,         // MLA plus a sparse-attention indexer key per token (DSA)
  linear_attention,   // a fixed state per sequence (conv window + recurrent matrix)
};
/// "full_attention", "sliding_attention", "mla", "deepseek_sparse_attention",
/// "linear_attention".
const char* layer_kind_name(LayerKind k);

/// The recurrent layer families whose state we can size.
enum class LinearFamily {
  none,
  kda,              // Kimi delta attention (GLM-5-Next): linear_num_heads x linear_head_dim
  gated_delta_net,  // Qwen3-Next: linear_num_{key,value}_heads x linear_{key,value}_head_dim
};

/// The parts of config.json that size a model's memory.
struct ModelShape {
  std::string arch;              // architectures[0], else model_type
  std::string model_type;        // of the text model
  int layers = 0;                // num_hidden_layers
  int dtype_bytes = 2;           // dtype / torch_dtype of the checkpoint
  int max_position = 0;          // max_position_embeddings (0: absent)
  std::vector<LayerKind> kinds;  // one per layer
  // Standard / grouped-query attention.
  int heads = 0;
  int kv_heads = 0;        // num_key_value_heads, else num_attention_heads
  int head_dim = 0;        // head_dim, else hidden_size / num_attention_heads
  int sliding_window = 0;  // tokens a sliding layer keeps (0: none)
  // Latent attention.
  int kv_lora_rank = 0;
  int qk_rope_head_dim = 0;
  // Sparse-attention indexer (DeepSeek-V3.2 / GLM DSA).
  int index_head_dim = 0;
  int index_kpool = 1;        // tokens pooled into one indexer key (1: one key per token)
  std::vector<bool> indexer;  // per layer: runs its own indexer (indexer_types "full")
  // Linear attention / recurrent layers.
  LinearFamily linear = LinearFamily::none;
  int linear_k_heads = 0, linear_v_heads = 0, linear_k_dim = 0, linear_v_dim = 0;
  int linear_conv_kernel = 0;
  // Mixture of experts (weights split).
  int experts = 0;         // routed experts per MoE layer (0: dense)
  int experts_active = 0;  // num_experts_per_tok
  int expert_inter = 0;    // one routed expert's intermediate size (moe_intermediate_size)
  int expert_block = 1;    // quantization block along it (FP8 128, MXFP4 32; 1: none)
  int mtp_layers = 0;      // num_nextn_predict_layers (multi-token prediction heads)
  /// Layers of kind `k`.
  int count(LayerKind k) const;
};

/// Reads the shape from a parsed config.json (the nested text_config when the top level has
/// no num_hidden_layers). `where` names the file in messages. An unknown layer type, or a
/// layer type whose dimensions the config lacks, is Errc::config naming the type.
Result<ModelShape> model_shape(const nlohmann::json& config, const std::string& where);
/// The same from what core/hf read of config.json (its `raw` file).
Result<ModelShape> model_shape(const hf::Config& config, const std::string& where);

/// Whose KV layout is planned: ours, or an external engine's.
enum class KvLayout {
  native,  // our engine: K and V per local KV head in KV_DTYPE, every token of every layer
  vllm,    // vLLM's records (fp8_ds_mla for sparse MLA, its indexer cache, state caches)
};
/// "native" | "vllm".
const char* kv_layout_name(KvLayout l);

/// The record a layer kind keeps, and for which engine.
struct KvRecord {
  KvLayout layout = KvLayout::native;
  std::string dtype = "auto";  // KV_DTYPE: auto (the model's dtype) | bf16 | fp16 | fp8 | fp32
  /// Native: the most tokens one engine step gives a sequence (PREFILL_CHUNK, at least
  /// SLOTS). In a model with full and sliding layers, our engine keeps a sliding layer's
  /// window plus that many tokens less one, in whole blocks of kNativeBlockTokens.
  int step_tokens = 256;
};
/// Tokens in a block of our engine's KV cache.
inline constexpr int kNativeBlockTokens = 16;
/// Bytes per element of a KV_DTYPE value; "auto" is the model's dtype.
int kv_dtype_bytes(const std::string& kv_dtype, const ModelShape& s);

/// One part of one layer kind's memory on one rank. A part holds `bytes_per_state` bytes
/// for every `tokens_per_state` tokens of a sequence (at most `window` tokens when window >
/// 0), plus `bytes_per_slot` per sequence whatever its length; all for one layer.
struct KvPart {
  LayerKind kind = LayerKind::full_attention;
  int layers = 0;      // layers of this kind
  std::string part;    // "K+V", "latent", "indexer keys", "indexer tail", "state"
  std::string record;  // how the bytes are made up, for people
  uint64_t bytes_per_state = 0;
  int tokens_per_state = 1;
  int64_t window = 0;
  uint64_t bytes_per_slot = 0;
  /// Bytes for one sequence of `context` tokens, all layers of the part.
  uint64_t bytes_for(int64_t context) const;
};

/// How a sequence's KV is spread: tensor-parallel ranks split KV heads (never a head), the
/// latent of MLA is whole on every rank unless `context_split` ranks share each sequence's
/// tokens (decode context parallel).
struct KvSpread {
  int ranks = 1;
  int context_split = 1;
};

/// The parts of every layer kind for one rank.
std::vector<KvPart> kv_parts(const ModelShape& s, const KvRecord& r, const KvSpread& spread);
/// Bytes one rank keeps per token of context over all layers, before any sliding-window cap
/// (each pooled part counted per token, rounded up). This is what the engine calls to size
/// its KV cache blocks.
uint64_t kv_bytes_per_token_per_rank(const ModelShape& s, const KvRecord& r,
                                     const KvSpread& spread);
/// Bytes one rank keeps for one sequence of `context` tokens (every part, states included).
uint64_t kv_bytes_per_sequence(const std::vector<KvPart>& parts, int64_t context);

/// A model of `layers` layers of full attention with `kv_heads` x `head_dim` K and V: the
/// shape of the dense decoder families the engine runs today.
ModelShape dense_attention_shape(int layers, int kv_heads, int head_dim, int dtype_bytes = 2);

/// How routed experts are spread over ranks (EXPERT_PARALLEL).
enum class MoeSplit {
  automatic,  // tensor where the ranks split every expert evenly, else expert
  tensor,     // every rank holds 1/R of every expert
  expert,     // every rank holds ceil(E/R) whole experts
};
/// "auto" | "tp" | "ep" (EXPERT_PARALLEL's values).
const char* moe_split_name(MoeSplit m);
/// EXPERT_PARALLEL's value (auto, tp or ep; "" is auto); Errc::config naming it otherwise.
Result<MoeSplit> parse_moe_split(const std::string& s);
/// Whether `ranks` split each expert's intermediate size `inter` into equal shares of whole
/// quantization blocks of `block` (1: unquantized): what EXPERT_PARALLEL=auto splits
/// tensor-parallel (the engine's shard plan and `plan` both ask this).
bool experts_split_evenly(int inter, int ranks, int block);
/// The split `split` resolves to at `ranks` ranks for the model's experts.
MoeSplit resolve_moe_split(MoeSplit split, const ModelShape& s, int ranks);

/// The weights as the files have them (bytes on disk, whatever the quantization).
struct WeightInventory {
  uint64_t total = 0;       // every tensor
  uint64_t experts = 0;     // the routed experts' tensors (0: none, or unknown)
  bool per_tensor = false;  // sizes came from the shard headers, not only the total
};
/// Tensors of routed experts, by name ("...experts..." but not shared experts).
bool is_routed_expert_tensor(const std::string& name);
/// One rank's share of the weights for `ranks` ranks.
uint64_t weights_per_rank(const WeightInventory& w, const ModelShape& s, MoeSplit split, int ranks);

/// Everything one ring size is planned from.
struct PlanInput {
  ModelShape shape;
  WeightInventory weights;
  KvRecord record;
  MoeSplit moe = MoeSplit::automatic;
  int context_split = 1;
  int64_t context = 0;
  int slots = 1;
  uint64_t reserve = 0;    // MEM_RESERVE
  uint64_t workspace = 0;  // activation and graph workspace per rank (stated)
  uint64_t mtp = 0;        // multi-token-prediction layer per rank (stated)
  uint64_t vision = 0;     // vision tower per rank (stated)
  /// KV memory an engine charges per rank beyond the records and states derived here
  /// (stated: for vLLM on a hybrid model, the constant term of its own KV figures).
  uint64_t kv_overhead = 0;
  int gpus_per_node = 1;
  uint64_t capacity_per_rank = 0;  // 0: unknown
  /// One rank's weights as the engine that serves them holds them, where that engine's own
  /// shard plan is known (the native engine on a family it runs): the largest share over
  /// the `ranks` ranks with the experts split `split` (never automatic). nullopt where that
  /// engine cannot split the model over `ranks` ranks. Unset: weights_per_rank's estimate
  /// from the files.
  std::function<std::optional<uint64_t>(int ranks, MoeSplit split)> engine_weights;
  /// Why engine_weights is unset for a native ring (the engine refuses the model), for people.
  std::string engine_weights_why;
};

/// One row of the plan: one ring size.
struct PlanRow {
  int nodes = 0;
  int ranks = 0;
  MoeSplit moe = MoeSplit::tensor;  // how the experts split at this size (never auto)
  uint64_t weights_per_rank = 0;
  bool weights_from_engine = false;    // the engine's shard plan, not the files' estimate
  uint64_t kv_per_token_per_rank = 0;  // all layers, before window caps
  uint64_t state_per_rank = 0;         // per-slot states x slots
  uint64_t kv_per_rank = 0;            // context x slots, states and kv_overhead included
  uint64_t fixed_per_rank = 0;         // workspace + mtp + vision
  uint64_t reserve = 0;
  uint64_t need_per_rank = 0;
  uint64_t capacity_per_rank = 0;  // 0: unknown
  bool fits = false;
  int64_t max_context = 0;  // largest context per slot that fits (0: none; -1: unknown)
  std::vector<KvPart> parts;
};

/// The arithmetic for one ring size.
PlanRow plan_row(const PlanInput& in, int nodes);
/// Rows for 1..max_nodes nodes.
std::vector<PlanRow> plan_table(const PlanInput& in, int max_nodes = 4);
/// Largest context per slot whose KV for `slots` sequences fits in `budget` bytes (0 when
/// not even one token does).
int64_t max_context_for(const std::vector<KvPart>& parts, int slots, uint64_t budget);

}  // namespace spark::plan
