#pragma once
// A decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral) computed in fp32 on the CPU:
// matrix products through OpenBLAS, RMSNorm / RoPE / SwiGLU / paged attention through the
// reference twins in kernels/. With tensor parallelism (Megatron) this rank holds its
// share of attention heads and MLP columns; o_proj and down_proj are row-split and their
// partial sums are combined with Collective::all_reduce_sum. Embedding, norms and lm_head
// are replicated, so every rank computes the same logits.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "daemon/engine/collective.h"
#include "daemon/engine/kv_cache.h"
#include "daemon/engine/model_config.h"

namespace spark::engine {

class Checkpoint;
struct Slice;

/// What a load read and how long it took.
struct LoadReport {
  uint64_t bytes_read = 0;    // tensor bytes read from the files by this rank
  uint64_t weight_bytes = 0;  // fp32 bytes held by this rank
  double seconds = 0;
  std::vector<std::string> files;
  /// In: when set and true, the load stops at the next tensor (SIGTERM during a load).
  const std::atomic<bool>* cancel = nullptr;
};

/// One sequence's share of a forward step: `n` new tokens at positions start_pos ...
struct SeqChunk {
  const int32_t* tokens = nullptr;
  int n = 0;
  int start_pos = 0;
  const int32_t* block_table = nullptr;  // covers positions [0, start_pos + n)
  bool want_logits = false;              // logits of the chunk's last token
};

class Model {
 public:
  /// Loads DIR (config.json + safetensors) as rank `rank` of `world` (heads and MLP split
  /// evenly; each rank reads only its slices) and drops the files' page cache afterwards.
  static Result<std::unique_ptr<Model>> load(const std::string& dir, int rank, int world,
                                             LoadReport* report = nullptr);

  const ModelConfig& config() const { return cfg_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  /// Heads of KV held by this rank (for sizing the KVCache).
  int local_kv_heads() const { return nkv_; }

  /// Runs one step over `chunks`. Writes their K/V into `cache`, and for each chunk with
  /// want_logits the vocab_size logits of its last token into `logits` (in chunk order).
  /// With `all_logits`, instead writes the logits of every token of every chunk. With
  /// logits == nullptr (tensor-parallel workers) the final norm and lm_head are skipped.
  Status forward(const std::vector<SeqChunk>& chunks, KVCache& cache, Collective& comm,
                 std::vector<float>* logits, bool all_logits = false);

  /// RoPE inverse frequencies in use (tests compare them with the reference's).
  const std::vector<float>& rope_inv_freq() const { return inv_freq_; }

 private:
  struct Layer {
    std::vector<float> in_norm, post_norm, q_norm, k_norm;
    std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo;
    std::vector<float> w_gate_up, w_down, b_gate_up, b_down;  // gate|up fused: [2*inter][hidden]
  };
  Model() = default;
  Status load_weights(const std::string& dir, LoadReport* report);
  struct LoadPass;
  Status load_pass(LoadPass& pass, const Checkpoint& ck, const std::string& dir);
  static Status read_into(LoadPass& pass, const Checkpoint& ck, const std::string& name,
                          const std::vector<int64_t>& shape, const Slice& s,
                          std::vector<float>* out);

  ModelConfig cfg_;
  int rank_ = 0, world_ = 1;
  int nh_ = 0, nkv_ = 0, inter_ = 0;  // this rank's heads, KV heads, MLP width
  std::vector<float> embed_, lm_head_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  // Scratch reused across steps.
  std::vector<float> x_, h_, q_, k_, v_, att_, o_, gate_up_, act_;
  std::vector<int32_t> pos_;
};

/// Threads OpenBLAS may use for one matrix product (process-wide; 1 suits small models and
/// busy machines, where OpenBLAS's thread hand-offs cost more than they save).
void set_blas_threads(int n);

/// y[T][out] = x[T][in] * W^T (+ b), W is [out][in] row-major as Hugging Face stores it.
void linear(const float* x, const float* w, const float* b, float* y, int rows, int in, int out);

}  // namespace spark::engine
