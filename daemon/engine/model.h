#pragma once
// A decoder-only transformer of one of the engine's families (family.h: dense Llama / Qwen2 /
// Qwen3 / Mistral; mixture-of-experts Qwen3-MoE / Mixtral / GLM-4.5 / MiniMax-M2): the layer
// recipe, composed of the shared blocks (attention, dense MLP, MoE) once over a Device
// (device.h): fp32 on the CPU (OpenBLAS and the reference twins in kernels/), BF16 on a
// CUDA GPU. With tensor parallelism (Megatron, shard_plan.h) this rank
// holds its share of attention heads and MLP columns; o_proj and down_proj are row-split and
// their partial sums are combined through the device's all_reduce (on CUDA the collective's
// device call in the compute stream, recorded in the decode graphs when the collective can
// be captured). Embedding and norms are replicated; lm_head is vocab-parallel (each rank its
// slice of the vocabulary, then an all-gather), so every rank ends with the same logits and
// the same sequence of collectives, step for step.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "daemon/engine/collective.h"
#include "daemon/engine/device.h"
#include "daemon/engine/kv_cache.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/shard_plan.h"

namespace spark::engine {

class Checkpoint;
struct Slice;

/// What a load read and how long it took.
struct LoadReport {
  uint64_t bytes_read = 0;    // tensor bytes read from the files by this rank
  uint64_t weight_bytes = 0;  // bytes of weights held by this rank (on its device)
  /// Of bytes_read, those read from the files straight into the weights' place
  /// (host-mapped weights: no staging buffer, no copy).
  uint64_t bytes_in_place = 0;
  double seconds = 0;
  std::vector<std::string> files;
  /// In: when set and true, the load stops at the next tensor (SIGTERM during a load).
  const std::atomic<bool>* cancel = nullptr;
  /// In: called after each tensor with the bytes read so far and this rank's total, so
  /// /health (and `sparkctl start`) can say how far a load of many GiB has come.
  std::function<void(uint64_t done, uint64_t total)> progress;
  std::string device;  // what holds them (DeviceInfo::name)
  /// In: EXPERT_PARALLEL, how an MoE model's routed experts are split over the ranks.
  plan::MoeSplit expert_placement = plan::MoeSplit::automatic;
  /// Out: tensors in the files that the model leaves unread on purpose (the layers of
  /// multi-token prediction), by name.
  std::vector<std::string> skipped_prefixes;
  std::vector<std::string> skipped_tensors;
};

/// One sequence's share of a forward step: `n` new tokens at positions start_pos ...
struct SeqChunk {
  const int32_t* tokens = nullptr;
  int n = 0;
  int start_pos = 0;
  const int32_t* block_table = nullptr;  // covers positions [0, start_pos + n)
  bool want_logits = false;              // logits of the chunk's last token
  bool all_logits = false;  // logits of every token of the chunk (prompt logprobs), in order
  /// The sequence's ring in the windowed layers' own pool (KVCache::window_blocks() > 0):
  /// logical block i is ring[i % ring_n].
  const int32_t* ring = nullptr;
  int ring_n = 0;
  /// Positions below this are not written to the shared blocks (a prefix-cache hit whose
  /// windowed layers are recomputed; see Model::window_recompute_tokens).
  int write_from = 0;
};

class Model {
 public:
  /// Loads DIR (config.json + safetensors) as rank `rank` of `world` on the CPU (heads and
  /// MLP split evenly; each rank reads only its slices) and drops the files' page cache
  /// afterwards.
  static Result<std::unique_ptr<Model>> load(const std::string& dir, int rank, int world,
                                             LoadReport* report = nullptr);
  /// The same onto `device` (weights in its compute type: fp32 on the CPU, BF16 on CUDA).
  static Result<std::unique_ptr<Model>> load(const std::string& dir, int rank, int world,
                                             std::shared_ptr<Device> device,
                                             LoadReport* report = nullptr);

  /// A model of `cfg` whose weights are random (Device::fill_random, from `seed`), with no
  /// checkpoint: matrices uniform with the variance of 1 / their input width, norms near 1,
  /// biases near 0. For benchmarks of real shapes too large to write to disk (the bytes a
  /// token reads and the kernels' work are what a checkpoint of the shape would give).
  static Result<std::unique_ptr<Model>> synthetic(const ModelConfig& cfg, int rank, int world,
                                                  std::shared_ptr<Device> device, uint64_t seed,
                                                  LoadReport* report = nullptr);

  const ModelConfig& config() const { return cfg_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  /// Heads of KV held by this rank (for sizing the KVCache).
  int local_kv_heads() const { return plan_.kv_heads; }
  Device& device() const { return *device_; }
  /// A KV cache of `num_blocks` blocks on this model's device (kv_shape(): K and V per
  /// local KV head, or latent attention's one row per token).
  /// With `window_blocks` > 0 the windowed layers (sliding-window attention in a model that
  /// also has full-attention layers: gpt-oss) keep that many blocks of their own instead.
  Result<std::unique_ptr<KVCache>> make_kv_cache(int num_blocks, int block_size, ElemType type,
                                                 int window_blocks = 0) const;
  /// Bytes one block of that cache takes over all layers (with `windowed_apart`, over the
  /// layers that share the blocks: the full-attention ones).
  uint64_t kv_block_bytes(ElemType type, int block_size, bool windowed_apart = false) const;
  /// Bytes one block of the windowed layers' own pool takes over those layers.
  uint64_t kv_window_block_bytes(ElemType type, int block_size) const;
  /// The blocks a sequence's ring needs in the windowed layers' own pool when a step writes
  /// up to `step_tokens` of its tokens: the largest window plus those tokens, less one. 0 when the
  /// model cannot keep windowed layers apart (no window, or every layer windowed, or latent
  /// attention).
  int window_ring_blocks(int block_size, int step_tokens) const;
  /// The tokens a prefix-cache hit recomputes before its matched end, so that the windowed
  /// layers' rings hold exact K/V there again: (window - 1) per windowed layer, the reach of
  /// the windows stacked through the layers.
  int window_recompute_tokens() const;

  /// Runs one step over `chunks`. Writes their K/V into `cache`, and for each chunk with
  /// want_logits the vocab_size logits of its last token into `logits` (in chunk order); a
  /// chunk with all_logits gives the logits of each of its tokens there instead (its last
  /// token's among them). With `all_logits`, every chunk is taken as having all_logits. With
  /// logits == nullptr (tensor-parallel workers) the final norm and lm_head are skipped.
  Status forward(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                 std::vector<float>* logits, bool all_logits = false);
  /// forward() that draws the next token of each chunk with want_logits on the device
  /// (params in chunk order; Device::samples_on_device() must be true): only the draws come
  /// back to the host, not the logits. `history` (empty, or one per row) feeds penalties.
  Status forward_sample(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                        const std::vector<kernels::SampleParams>& params,
                        std::vector<kernels::SampleResult>* results,
                        const std::vector<Device::PenaltyHistory>& history = {});
  /// forward_sample() in two halves, for a device that queues steps
  /// (Device::queues_steps()): queue_sample() returns once the step and its draws are
  /// queued; wait_sample() waits for the oldest queued draws. With `feed`, the chunks are
  /// the previous queued step's, one token further on, in the same order: their tokens are
  /// those draws, taken on the device (the chunks' own token values are not read).
  Status queue_sample(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                      const std::vector<kernels::SampleParams>& params, bool feed,
                      const std::vector<Device::PenaltyHistory>& history = {});
  Status wait_sample(std::vector<kernels::SampleResult>* results);

  /// Sizes every buffer a step uses for steps of up to `tokens` tokens over `seqs`
  /// sequences of up to `max_context` tokens in `block_size`-token blocks, so that such
  /// steps allocate nothing; with `graphs` (and a device that has them), decode-only steps
  /// then run as graphs captured per batch-size bucket (1, 2, 4, ... up to `seqs`).
  Status prepare(int tokens, int seqs, int max_context, int block_size, bool graphs);
  /// Decode steps replayed from a graph / captured so far (for tests and the benchmark).
  uint64_t graph_replays() const { return graph_replays_; }
  uint64_t graph_captures() const { return graph_captures_; }

  /// Whether the layer norms' weights were folded into the products after them at load
  /// (Device::folds_norm_weights).
  bool norms_folded() const { return norms_folded_; }

  /// RoPE inverse frequencies in use (tests compare them with the reference's).
  const std::vector<float>& rope_inv_freq() const { return inv_freq_; }
  /// This rank's shard plan (heads, experts and where they are, for /health and tests).
  const ShardPlan& shard_plan() const { return plan_; }
  /// What this rank serves, for /health and `sparkctl status`: the architecture, its sizes,
  /// parameters in all and active per token, the weights' format, and for an MoE model the
  /// experts (per token, shared, MoE layers) with how they split over the ranks and why.
  nlohmann::json describe() const;

  /// Router choices of the last step's MoE layers, for tests that look for near-ties: per
  /// MoE layer and token row, the scores (as chosen on) of the last chosen and the first
  /// unchosen expert. Filled only while record_router_margins(true).
  struct RouterMargin {
    int layer = 0, row = 0;
    float last_chosen = 0, first_unchosen = 0;
  };
  void record_router_margins(bool on) { record_margins_ = on; }
  const std::vector<RouterMargin>& router_margins() const { return margins_; }
  /// Called after each MoE layer's routing with its chosen expert ids ([rows][top_k], on the
  /// host): how benchmarks count the distinct experts a step reads. While set, steps run
  /// eagerly (a graph's replay would skip the call). Set only while no step runs.
  using RouteRecorder = std::function<void(int layer, const int32_t* ids, int rows, int top_k)>;
  void set_route_recorder(RouteRecorder r) { route_recorder_ = std::move(r); }

 private:
  struct Layer {
    Buffer in_norm, post_norm, q_norm, k_norm;
    Buffer wq, wk, wv, wo, bq, bk, bv, bo;
    Buffer w_gate_up, w_down, b_gate_up, b_down;  // gate|up fused: [2*inter][hidden]
    // Mixture of experts (shard_plan.h's roles).
    Buffer router, router_bias, experts_gate_up, experts_down, shared_gate_up, shared_down;
    Buffer sinks, router_b, experts_gate_up_b, experts_down_b;  // gpt-oss
    Buffer wq_a, q_a_norm, wkv_a, kv_a_norm, wkv_b;             // latent attention
    bool post_folded = false;  // post_norm's weight folded into w_gate_up (ones left)
  };
  Model() = default;
  Buffer* weight(int layer, WeightRole role);
  Status load_weights(const std::string& dir, LoadReport* report);
  Status fill_synthetic(uint64_t seed);
  Status fold_norms(const std::string& dir);
  std::string weights_held() const;
  Status reserve(int tokens, int logit_rows);
  /// The layer recipe over the device for the step already handed to begin_step().
  Status run_layers(const StepLayout& step, KVCache& cache, Collective& comm, bool logits);
  // The recipe's blocks (layer_blocks.cc). `pre` is the residual stream's pending norm:
  // the next product's input.
  Status attention_block(int l, KVCache& cache, Collective& comm, int T, Device::PreNorm* pre);
  Status mla_attention_block(int l, KVCache& cache, Collective& comm, int T, Device::PreNorm* pre);
  Device::MlaArgs mla_args() const;  // latent attention's shape, RoPE and softmax settings
  Status mlp_block(int l, Collective& comm, int T, const Buffer& next_norm, bool next_folded,
                   Device::PreNorm* pre);
  Status moe_block(int l, Collective& comm, int T, const Buffer& next_norm, bool next_folded,
                   Device::PreNorm* pre);
  /// The residual add of a product's output: at one rank in the product's epilogue
  /// (linear_add), across ranks after its all-reduce (the next norm's pass adds it).
  Status residual_product(Collective& comm, int T, const Buffer& in, const Buffer& w,
                          const Buffer& b, int in_w, const Buffer& norm_w, bool folded,
                          Device::PreNorm* pre);

  ModelConfig cfg_;
  int rank_ = 0, world_ = 1;
  double attn_factor_sq_ = 1.0;  // YaRN's attention factor, squared (1 otherwise)
  double attn_factor_ = 1.0;     // the same unsquared (latent attention's rotated part)
  ShardPlan plan_;
  std::shared_ptr<Device> device_;
  Buffer embed_, lm_head_, final_norm_, inv_freq_dev_;
  bool norms_folded_ = false;  // in_norm / post_norm folded into q/k/v / gate_up (ones left)
  Buffer head_;                // this rank's lm_head rows (a view of embed_ when tied)
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  // Scratch on the device, reused across steps (grown, never shrunk).
  int cap_tokens_ = 0, cap_rows_ = 0;
  Buffer x_, h_, q_, k_, v_, att_, o_, gate_up_, act_, sel_, logits_;
  Buffer router_logits_, moe_ids_, moe_weights_;  // [T][experts] f32, [T][top_k] i32 / f32
  Buffer mla_qa_, mla_kv_;  // latent attention: [T][q_lora_rank], [T][kv_lora_rank + rope]
  // The current step's views of the scratch (its T rows), which the blocks and the pending
  // norm (PreNorm) point at while the step runs.
  struct StepViews {
    Buffer x, h, o, q, k, v, att, gu, act, none;
  } sv_;
  bool record_margins_ = false;
  RouteRecorder route_recorder_;
  std::vector<RouterMargin> margins_;
  Buffer logits_local_, gathered_;  // vocab-parallel: this rank's slice, the all-gather's output
  StepLayout step_;
  const std::vector<kernels::SampleParams>* sample_params_ = nullptr;  // forward_sample
  const std::vector<Device::PenaltyHistory>* sample_history_ = nullptr;
  std::vector<kernels::SampleResult>* sample_out_ = nullptr;
  bool sample_queue_only_ = false;  // queue_sample: the draws are queued, not read
  int feed_rows_ = 0;               // queue_sample with feed: tokens taken from the last draws
  // Graphs: on after prepare(graphs = true) on a device that has them.
  bool graphs_ = false;
  int graph_max_batch_ = 0, graph_max_context_ = 0, graph_width_ = 0;
  uint64_t graph_replays_ = 0, graph_captures_ = 0;
  /// Runs a decode-only step as the graph of its bucket (capturing it the first time);
  /// `want`: compute the logits (rank 0, or every rank when lm_head is vocab-parallel).
  Status run_graph(KVCache& cache, Collective& comm, bool want);
};

/// Threads OpenBLAS may use for one matrix product (process-wide; 1 suits small models and
/// busy machines, where OpenBLAS's thread hand-offs cost more than they save).
void set_blas_threads(int n);

/// y[T][out] = x[T][in] * W^T (+ b), W is [out][in] row-major as Hugging Face stores it.
void linear(const float* x, const float* w, const float* b, float* y, int rows, int in, int out);

}  // namespace spark::engine
