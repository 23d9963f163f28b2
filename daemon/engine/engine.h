#pragma once
// sparkd's generation engine: continuous batching over a fixed number of serving slots,
// chunked prefill, block-aligned prefix caching, per-token streaming, cancellation.
//
// Threads: one engine thread owns every piece of state (sequences, KV blocks, the model).
// submit() and cancel() only push onto a mutex-protected inbox and return; results come
// back through the request's callback, called on the engine thread (it must not block:
// hand the event to your own queue or socket). With tensor parallelism, rank 0 runs the
// Engine and posts each step's plan (step_plan.h) on the control channel
// (control_channel.h); the other ranks run run_tp_worker(), which mirrors the running
// sequences, runs the same steps and draws the same tokens itself. Rank 0 posts the plan of
// step N+1 before it computes step N (EngineOptions::overlap_plan), so the control plane
// costs a step nothing: admissions and cancels then take effect one step later.
//
//   auto eng = Engine::start(std::move(model), comm, opts);
//   auto id = (*eng)->submit({prompt_ids, params, [](const TokenEvent& e) { ... }});
//   (*eng)->cancel(*id);   // frees the request's slot and blocks at the next step
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "daemon/engine/block_manager.h"
#include "daemon/engine/collective.h"
#include "daemon/engine/control_channel.h"
#include "daemon/engine/kv_cache.h"
#include "daemon/engine/model.h"
#include "daemon/engine/sampler.h"
#include "daemon/engine/step_plan.h"

namespace spark::engine {

using RequestId = uint64_t;

/// What one engine step computed, for EngineOptions::on_step.
struct StepTrace {
  struct Chunk {
    RequestId request = 0;
    int choice = 0;
    int tokens = 0;       // tokens computed for this sequence in the step
    int prompt_left = 0;  // prompt tokens still to prefill after the step
  };
  uint64_t step = 0;  // 1 for the engine's first step
  std::vector<Chunk> chunks;
};

struct EngineOptions {
  int slots = 4;        // sequences running at once (serving slots)
  int block_size = 16;  // tokens per KV block (prefix-cache granularity)
  int num_blocks = 0;   // 0: enough for `slots` full contexts within kv_cache_bytes
  uint64_t kv_cache_bytes = 1ull << 30;  // budget for this rank's KV cache when num_blocks is 0
  /// Tokens one step computes (at least `slots`): every decoding sequence's next token, the
  /// rest shared max-min fairly among the prompts being prefilled, so a long prompt
  /// prefills in chunks between the decodes and prefills of the others (PREFILL_CHUNK).
  int max_batch_tokens = 256;
  int max_context = 0;  // 0: the model's max_position_embeddings
  bool prefix_caching = true;
  /// A model whose layers mix sliding-window and full attention (gpt-oss) keeps its
  /// windowed layers' K/V apart, only the window and one step's tokens per sequence, where
  /// that is less than a full context (KVCache); false: every layer keeps whole contexts.
  bool window_kv = true;
  int heartbeat_ms = 1000;  // TP: an idle rank 0 tells workers it is alive this often
  /// TP: post the plan of step N+1 while step N computes (the workers find it waiting when
  /// they finish step N); false: after step N ends, the workers waiting for it (lock-step,
  /// for comparison). Either way every rank draws the tokens itself.
  bool overlap_plan = true;
  /// TP: how long a worker waits for the next plan or heartbeat, and rank 0 for a worker
  /// to take one, before it fails naming the other rank.
  int control_timeout_ms = 30000;
  /// Test seam: the control channel's socket buffers (0: the kernel's), small to make a
  /// long plan's write partial.
  int control_socket_buffer = 0;
  /// KV element type: "auto" (the device's compute type: fp32 on the CPU, bf16 on CUDA),
  /// "bf16" (CUDA only), "fp32" or "fp8" (e4m3 without a scale: one byte a value on CUDA;
  /// the CPU keeps fp32 pools of the same e4m3 values; not for latent attention).
  std::string kv_dtype = "auto";
  /// Size the KV cache from the memory the device has free after the weights, less
  /// mem_reserve (a GPU: its free memory; unified memory and the CPU: MemAvailable), capped
  /// at `slots` full contexts. Start fails, with the numbers, when one full context does
  /// not fit.
  bool kv_from_free_memory = false;
  uint64_t mem_reserve = 0;
  /// Ranks whose KV caches come out of the memory sized from, this one included (ranks
  /// sharing one GPU or one unified-memory node): what is free after mem_reserve is split
  /// between them. The runtime sets it from the ring's exchange (plan_kv_memory).
  int kv_memory_share = 1;
  /// Nonzero: the free memory to size from instead of the device's available_bytes() (the
  /// ring's tightest rank's, so every rank's cache fits where it is); kv_memory_where names
  /// that rank for the message.
  uint64_t kv_memory_available = 0;
  std::string kv_memory_where;
  /// CUDA: capture decode steps as CUDA graphs per batch-size bucket (eager when false).
  bool cuda_graphs = true;
  /// One rank on a device that queues steps (CUDA): queue each decode step behind the one
  /// running, fed its draws on the device, so the GPU does not wait for the host between
  /// steps (see Engine::step_queued). SPARK_OVERLAP_DECODE=0 in the environment turns it
  /// off as well.
  bool overlap_decode = true;
  /// Called on the engine thread after every step with what it computed (sparkd counts
  /// tokens per step for /metrics by it); it may block, which holds the engine between two
  /// steps (tests order events by it).
  std::function<void(const StepTrace&)> on_step;
};

enum class FinishReason { none, stop, length, cancelled, error };
/// "stop", "length", "cancelled", "error" (OpenAI's finish_reason for the first two).
const char* finish_reason_name(FinishReason r);

/// One streamed result. A choice's last event has `finish` set; the request's last event
/// (after all n choices finished, or cancel/error) has request_done.
struct TokenEvent {
  RequestId request = 0;
  int choice = 0;
  int32_t token = -1;  // -1: this event carries no token (cancel, error)
  float logprob = 0;
  std::vector<TokenLogprob> top_logprobs;
  /// With SamplingParams::prompt_logprobs, one event per choice (token -1) before its first
  /// token carries the prompt's scores: prompt tokens 1.. (the first has none), each with
  /// its logprob after the ones before it and its prompt_logprobs alternatives.
  bool has_prompt_logprobs = false;
  std::vector<Sample> prompt_logprobs;
  FinishReason finish = FinishReason::none;
  bool request_done = false;
  std::string error;  // with FinishReason::error
  int prompt_tokens = 0;
  int completion_tokens = 0;     // of this choice so far
  int cached_prompt_tokens = 0;  // prompt tokens of this choice served by the prefix cache
  /// When submit() took the request and when this choice got a serving slot (its queue
  /// time is the difference); set on every event of an admitted choice, for /metrics.
  std::chrono::steady_clock::time_point submitted{}, scheduled{};
};

using EventCallback = std::function<void(const TokenEvent&)>;

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
  EventCallback on_event;  // called on the engine thread; must not block
};

struct EngineStats {
  int slots = 0;
  int running = 0;  // sequences in slots
  int waiting = 0;  // requests not (fully) admitted
  int blocks_total = 0;
  int blocks_available = 0;
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0;   // computed prompt tokens (excluding prefix-cache hits)
  uint64_t cached_tokens = 0;   // prompt tokens served from the prefix cache
  uint64_t prefix_queries = 0;  // prompt tokens looked up in the prefix cache (when it is on)
  int block_size = 0;
  bool prefix_caching = false;
  uint64_t kv_bytes = 0;       // this rank's KV cache, every pool
  int window_ring_blocks = 0;  // blocks a sequence's ring holds in the windowed layers' pool
  uint64_t generated_tokens = 0;
  /// Overlapped decode: steps queued behind the one running, fed its draws on the device.
  uint64_t steps_queued_ahead = 0;
  int64_t step_running_ms =
      0;                 // age of the forward step in progress (0: none), for stall detection
  std::string device;    // what computes (DeviceInfo::name)
  std::string kv_dtype;  // "fp32" / "bf16" / "fp8"
  bool failed = false;   // a step failed (e.g. a TP rank vanished); see error
  std::string error;
  // TP control plane (rank 0).
  uint64_t plans_posted = 0;    // step plans sent to the workers
  uint64_t plans_ahead = 0;     // of them, posted before the previous step computed
  uint64_t plan_bytes = 0;      // their size, summed
  uint64_t heartbeats = 0;      // heartbeats sent while idle
  uint64_t plans_deferred = 0;  // plans the sockets took in part (the rest: with the next write)
};

namespace step_detail {
struct StepRun;
}

class Engine {
 public:
  /// Sizes the KV cache, tells TP workers its size, and starts the engine thread.
  static Result<std::unique_ptr<Engine>> start(std::unique_ptr<Model> model,
                                               std::shared_ptr<Collective> comm,
                                               EngineOptions opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Queues a request. Errors (bad parameters, prompt too long for the context or the KV
  /// cache, engine stopped or failed) come back here, not through the callback.
  Result<RequestId> submit(GenerateRequest req);
  /// Cancels a request: its sequences leave their slots and free their blocks at the next
  /// step; the callback gets one last event with FinishReason::cancelled. Unknown ids are ignored.
  void cancel(RequestId id);
  /// Stops the engine thread (pending requests end with FinishReason::cancelled) and tells
  /// TP workers to return.
  void stop();

  EngineStats stats() const;
  const ModelConfig& config() const { return model_->config(); }
  /// The model, for tools that set its measurement hooks (Model::set_route_recorder) while
  /// no request runs.
  Model& model() { return *model_; }
  /// Longest prompt + completion, in tokens.
  int max_context() const { return max_context_; }

 private:
  struct Seq;
  struct Req;
  struct Queued;
  using StepRun = step_detail::StepRun;
  struct Submit {
    RequestId id;
    GenerateRequest r;
    std::chrono::steady_clock::time_point at;
  };
  struct Inbox {
    std::vector<Submit> submits;
    std::vector<RequestId> cancels;
  };
  Engine() = default;
  void loop();
  void admit();
  Status step();
  Status step_queued();
  /// Waits for the step queued ahead, if any, and drops its draws.
  Status drain_queued();
  /// A step's bookkeeping after its draws: prefix blocks, events, stats, finished sequences.
  void finish_run(StepRun& run);
  void finish_seq(size_t index, FinishReason why, const std::string& error = {});
  /// Gives back a sequence's blocks and its ring.
  void release_seq(Seq& s);
  void cancel_req(RequestId id, FinishReason why, const std::string& error);
  void emit(Req& r, TokenEvent ev);
  void publish_stats();
  /// The plan of the admissions and cancels decided this iteration (serial not yet set).
  StepPlan take_plan();
  /// Applies a plan's cancels and admissions (`seqs`: the admitted sequences, in order).
  void apply_plan(const StepPlan& plan, std::vector<std::unique_ptr<Seq>> seqs);
  Status post_plan(StepPlan& plan);
  Status keepalive();

  std::unique_ptr<Model> model_;
  std::shared_ptr<Collective> comm_;
  EngineOptions opts_;
  int max_context_ = 0;
  std::unique_ptr<KVCache> cache_;
  std::unique_ptr<BlockManager> blocks_;
  // The windowed layers' own pool (KVCache::window_blocks()): `ring_n_` blocks a sequence,
  // ring r being blocks [r * ring_n_, (r + 1) * ring_n_); the free ones; and the tokens a
  // prefix-cache hit recomputes for them (Model::window_recompute_tokens).
  int ring_n_ = 0;
  std::vector<int32_t> free_rings_;
  int recompute_ = 0;

  // Engine-thread state.
  std::vector<std::unique_ptr<Seq>> running_;
  std::deque<RequestId> waiting_;
  std::unordered_map<RequestId, std::unique_ptr<Req>> reqs_;
  std::vector<float> logits_;
  // TP control plane (engine thread).
  std::unique_ptr<ControlChannel> ctl_;
  std::vector<std::unique_ptr<Seq>> admitted_;  // admitted this iteration, not yet in a plan
  std::vector<uint64_t> cancelled_;             // sequences to drop in the next plan
  struct Pending {
    StepPlan plan;
    std::vector<std::unique_ptr<Seq>> seqs;
  };
  std::unique_ptr<Pending> pending_;  // posted ahead, applied before the next step
  // Overlapped decode: a step queued on the device whose draws are not read yet.
  std::unique_ptr<Queued> ahead_;
  bool overlap_ = false;
  uint64_t next_seq_ = 1, plan_serial_ = 0, step_serial_ = 0;
  uint64_t digest_step_ = 0, digest_ = 0;  // rank 0's last step with draws, and their digest
  std::chrono::steady_clock::time_point last_post_{};

  // Shared with callers.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Inbox inbox_;
  bool stopping_ = false;
  RequestId next_id_ = 1;
  EngineStats stats_;
  std::atomic<int64_t> step_started_ns_{
      0};  // steady_clock ns at the start of the running step, 0 idle
  std::thread thread_;
};

/// What a TP worker's control plane did (run_tp_worker fills it as it goes).
struct TpWorkerStats {
  uint64_t plans = 0;               // step plans applied
  uint64_t plans_ahead = 0;         // of them, posted by rank 0 before the previous step computed
  uint64_t plans_ready = 0;         // of them, already arrived when this rank asked for them
  uint64_t plans_waited = 0;        // of them, this rank had to wait for
  uint64_t decode_steps = 0;        // steps of one token per sequence
  uint64_t decode_plans_ready = 0;  // of them, whose plan had already arrived
  uint64_t plan_bytes = 0;          // size of the step plans, summed
  uint64_t bare_plans = 0;          // plans with nothing new: the header alone
  uint64_t steps = 0;               // steps computed
  uint64_t tokens = 0;              // tokens this rank drew
  uint64_t digests_checked = 0;     // rank 0 digests compared with this rank's own
};

struct TpWorkerOptions {
  TpWorkerStats* stats = nullptr;  // optional, updated after every plan
  /// Test seam: may change a token this rank drew (sequence id, step serial, token), to
  /// make it diverge from rank 0.
  std::function<void(uint64_t seq, uint64_t step, int32_t* token)> fault_inject_token;
};

/// Tensor-parallel ranks > 0: receives the KV cache size, connects the control channel and
/// then, for every step plan of rank 0's Engine, applies it to its mirror of the running
/// sequences, runs the same forward pass (its share of heads and MLP columns) and draws the
/// same tokens, until rank 0 stops, a collective or the channel fails (rank 0 vanished: a
/// deadline), or this rank's tokens diverge from rank 0's (it then tells rank 0 why and
/// leaves the ring, so rank 0 fails at once with the reason).
Status run_tp_worker(Model& model, Collective& comm, const TpWorkerOptions& opts = {});

/// Blocks until `req` finishes (or `timeout_ms` passes, then cancels it) and returns the
/// tokens of each choice. For tests, benchmarks and simple callers.
struct BlockingResult {
  std::vector<std::vector<int32_t>> tokens;          // per choice
  std::vector<FinishReason> finish;                  // per choice
  std::vector<std::vector<float>> logprobs;          // per choice (when asked)
  std::vector<std::vector<Sample>> prompt_logprobs;  // per choice (with prompt_logprobs)
  int cached_prompt_tokens = 0;                      // choice 0
};
Result<BlockingResult> generate_blocking(Engine& engine, std::vector<int32_t> prompt,
                                         SamplingParams params, int timeout_ms = 60000);

}  // namespace spark::engine
