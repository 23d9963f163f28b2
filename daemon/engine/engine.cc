#include "daemon/engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string_view>

#include "core/log.h"
#include "core/model_plan.h"

namespace spark::engine {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none:
      return "none";
    case FinishReason::stop:
      return "stop";
    case FinishReason::length:
      return "length";
    case FinishReason::cancelled:
      return "cancelled";
    case FinishReason::error:
      return "error";
  }
  return "?";
}

namespace {
// What rank 0 tells the workers at start: KV blocks, block size, KV type, the arguments of
// Model::prepare (tokens, sequences, context, graphs), the control plane's deadline and
// socket buffers.
constexpr int kWorkerSizes = 10;
}  // namespace

namespace step_detail {

// A running sequence as every rank keeps it: what the scheduler, the forward pass and the
// sampler need. Rank 0's Engine::Seq adds its request bookkeeping.
struct SeqState {
  uint64_t id = 0;              // ring-wide (the step plan's sequence id)
  std::vector<int32_t> tokens;  // prompt + generated
  int prompt_len = 0;
  int max_total = 0;  // prompt + max_tokens, capped by the context
  int computed = 0;   // tokens whose K/V are in the cache
  std::vector<int32_t> blocks;
  /// Its ring in the windowed layers' own pool (empty when the cache keeps none apart).
  std::vector<int32_t> ring;
  /// A prefix-cache hit recomputes from `computed` on for the windowed layers; the shared
  /// blocks below this position already hold the full layers' K/V and are not written.
  int write_from = 0;
  SamplingParams params;  // seed fixed at admission
  std::unique_ptr<Sampler> sampler;
  int generated = 0;
  /// params.prompt_logprobs >= 0: the scores of prompt positions 1.. computed so far (rank 0;
  /// handed to the request when the prompt is done).
  std::vector<Sample> prompt_scores;
  /// Its tokens are drawn by rank 0 alone and broadcast to the ring each step: it has an
  /// output constraint, whose grammar only rank 0 holds (set on every rank from the plan).
  bool rank0_draws = false;
};

// What one step did, for the caller's bookkeeping.
struct StepRun {
  std::vector<SeqChunk> chunks;
  std::vector<size_t> chunk_seq;  // index into the running list, per chunk
  std::vector<Sample> samples;    // per chunk; token -1 where the chunk drew nothing
  std::vector<std::pair<size_t, FinishReason>> done;  // running index, why (in chunk order)
  uint64_t digest = 0;                                // of the step's draws
  int draws = 0;
  bool decode_only = true;
};

using FaultFn = std::function<void(uint64_t seq, int32_t* token)>;

// The chunks of one step over `running` (the schedule run_step describes), into
// out->chunks / chunk_seq.
void plan_step(const std::vector<SeqState*>& running, int budget, StepRun* out) {
  auto pending_of = [&](size_t i) {
    return static_cast<int>(running[i]->tokens.size()) - running[i]->computed;
  };
  std::vector<int> take(running.size(), 0);
  std::vector<size_t> prefilling;
  for (size_t i = 0; i < running.size(); ++i) {
    const int pending = pending_of(i);
    if (pending == 1) {
      take[i] = 1;
      --budget;
    } else if (pending > 1) {
      prefilling.push_back(i);
    }
  }
  std::stable_sort(prefilling.begin(), prefilling.end(),
                   [&](size_t a, size_t b) { return pending_of(a) < pending_of(b); });
  for (size_t k = 0; k < prefilling.size() && budget > 0; ++k) {
    const int left = static_cast<int>(prefilling.size() - k);
    const size_t i = prefilling[k];
    take[i] = std::min(pending_of(i), (budget + left - 1) / left);
    budget -= take[i];
  }
  for (size_t i = 0; i < running.size(); ++i) {
    SeqState& s = *running[i];
    const int n = take[i];
    if (n <= 0) continue;
    // Prompt logprobs: the logits of every prompt token of the chunk, for this sequence alone.
    const bool all = s.params.prompt_logprobs >= 0 && s.computed < s.prompt_len;
    out->chunks.push_back(
        {s.tokens.data() + s.computed, n, s.computed, s.blocks.data(), n == pending_of(i), all});
    out->chunks.back().ring = s.ring.data();
    out->chunks.back().ring_n = static_cast<int>(s.ring.size());
    out->chunks.back().write_from = s.write_from;
    out->chunk_seq.push_back(i);
    if (n != 1 || s.computed < s.prompt_len) out->decode_only = false;
  }
}

bool has_penalty(const kernels::SampleParams& kp) {
  return kp.repetition_penalty != 1.0f || kp.presence_penalty != 0.0f ||
         kp.frequency_penalty != 0.0f;
}

// The device sampler's parameters of the chunks with want_logits, in chunk order; rows with
// penalties send their token lists, from which the device builds the state the host sampler
// keeps (prompt tokens seen, output tokens counted), and rows with an output constraint their
// masks. `history` is left empty when no row has a penalty or a mask.
void draw_params(const std::vector<SeqState*>& running, const StepRun& run,
                 std::vector<kernels::SampleParams>* params,
                 std::vector<Device::PenaltyHistory>* history) {
  bool needed = false;
  for (size_t k = 0; k < run.chunks.size(); ++k) {
    if (!run.chunks[k].want_logits) continue;
    const SeqState& s = *running[run.chunk_seq[k]];
    const auto kp = s.sampler->next_params();
    Device::PenaltyHistory h;
    if (has_penalty(kp)) {
      needed = true;
      h.tokens = s.tokens.data();
      h.n = static_cast<int>(s.tokens.size());
      h.out_start = s.prompt_len;
    }
    // Structured outputs: the grammar's mask of this draw, computed on the host before the
    // step's draws are queued (the device applies it before it samples).
    h.mask = s.sampler->mask();
    needed = needed || h.mask;
    params->push_back(kp);
    history->push_back(h);
  }
  if (!needed) history->clear();
}

// What the step drew, applied to its sequences: tokens, stop decisions (EOS, stop ids,
// max_tokens) into out->done. Draws come from the device (`drawn`, with `params`) or from
// the host samplers over `logits`. A chunk whose chunk_seq is kGone (its sequence left while
// a queued step ran) only skips its row. A chunk with all_logits has a row per token: with
// `score_prompt`, each prompt token after the first gets its logprob from the row before it.
// A sequence already at its length (max_tokens 0) ends its prefill drawing nothing.
constexpr size_t kGone = static_cast<size_t>(-1);
void apply_draws(const ModelConfig& cfg, const std::vector<SeqState*>& running, StepRun* out,
                 const std::vector<kernels::SampleResult>* drawn,
                 const std::vector<kernels::SampleParams>* params, std::vector<float>* logits,
                 const FaultFn& fault, bool score_prompt = false,
                 const std::vector<int32_t>* rank0_tokens = nullptr) {
  const auto& chunks = out->chunks;
  const bool on_device = drawn != nullptr;
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  size_t row = 0;
  out->samples.resize(chunks.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    Sample& smp = out->samples[k];
    smp.token = -1;
    const auto& ch = chunks[k];
    const size_t rows = ch.all_logits ? static_cast<size_t>(ch.n) : ch.want_logits ? 1 : 0;
    if (out->chunk_seq[k] == kGone) {
      row += rows;
      continue;
    }
    SeqState& s = *running[out->chunk_seq[k]];
    s.computed += ch.n;
    const size_t first = row;
    row += rows;
    if (ch.all_logits && score_prompt && !on_device)
      for (int j = 0; j < ch.n; ++j) {
        const int next = ch.start_pos + j + 1;  // the prompt token row j predicts
        if (next >= s.prompt_len) break;
        s.prompt_scores.push_back(score_token(logits->data() + (first + static_cast<size_t>(j)) * V,
                                              cfg.vocab_size, s.tokens[static_cast<size_t>(next)],
                                              s.params.prompt_logprobs));
      }
    if (!ch.want_logits) continue;
    const size_t last = row - 1;  // the chunk's last token's row: the one a draw reads
    if (static_cast<int>(s.tokens.size()) >= s.max_total) {
      out->done.emplace_back(out->chunk_seq[k], FinishReason::length);
      continue;
    }
    if (rank0_tokens && s.rank0_draws) {
      // A worker takes rank 0's token (drawn under the grammar it alone holds); only rank 0
      // reports tokens, so no logprobs are needed here.
      smp.token = (*rank0_tokens)[k];
      if (fault) fault(s.id, &smp.token);
      s.sampler->record(smp.token);
    } else if (on_device) {
      const kernels::SampleResult& d = (*drawn)[last];
      smp.token = d.token;
      if ((*params)[last].logprobs) smp.logprob = d.logprob;
      for (int i = 0; i < d.n_top; ++i) smp.top.push_back({d.top_ids[i], d.top_logprobs[i]});
      if (fault) fault(s.id, &smp.token);
      s.sampler->record(smp.token);
    } else {
      smp = s.sampler->sample(logits->data() + last * V);
      if (fault) fault(s.id, &smp.token);
    }
    s.tokens.push_back(smp.token);
    ++s.generated;
    ++out->draws;
    out->digest = fold_token_digest(out->digest, s.id, smp.token);
    const auto& p = s.params;
    FinishReason why = FinishReason::none;
    const bool eos = !p.ignore_eos && std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(),
                                                smp.token) != cfg.eos_token_ids.end();
    if (eos || std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), smp.token) !=
                   p.stop_token_ids.end())
      why = FinishReason::stop;
    else if (static_cast<int>(s.tokens.size()) >= s.max_total)
      why = FinishReason::length;
    if (why != FinishReason::none) out->done.emplace_back(out->chunk_seq[k], why);
  }
}

// One engine step over `running`, identical on every rank: the schedule, the forward pass,
// the draws and the stop decisions (EOS, stop ids, max_tokens) follow from the running
// list alone, so ranks that apply the same plans stay in step without sending tokens.
//
// Every decoding sequence (one pending token) runs each step; the rest of the budget is
// shared max-min fairly among the prompts being prefilled (shortest remainder first, each
// taking at most an even share of what is left), so a long prompt cannot hold a short
// one's first token for its whole prefill, and is never starved by short ones either.
// The budget is at least the slot count, so prefill gets a token even with every other
// slot decoding.
Status run_step(Model& model, KVCache& cache, Collective& comm,
                const std::vector<SeqState*>& running, int budget, std::vector<float>* logits,
                StepRun* out, const FaultFn& fault = {}, bool score_prompt = false) {
  plan_step(running, budget, out);
  if (out->chunks.empty()) return Status::Ok();
  // On a device that samples, draw there (one small copy back per step instead of the
  // logits).
  std::vector<kernels::SampleResult> drawn;
  // A step with a chunk that wants the logits of every row (prompt logprobs) brings its
  // logits to the host and draws there, with the samplers the device sampler twins: every
  // rank sees that chunk (the plan carries prompt_logprobs), so every rank decides alike.
  bool every_row = false;
  for (const auto& ch : out->chunks) every_row = every_row || ch.all_logits;
  const bool on_device = model.device().samples_on_device() && !every_row;
  std::vector<kernels::SampleParams> params;
  std::vector<Device::PenaltyHistory> history;
  if (on_device) {
    draw_params(running, *out, &params, &history);
    SPARK_TRY(model.forward_sample(out->chunks, cache, comm, params, &drawn, history));
  } else {
    SPARK_TRY(model.forward(out->chunks, cache, comm, logits));
    size_t rows = 0;
    for (const auto& ch : out->chunks)
      rows += ch.all_logits ? static_cast<size_t>(ch.n) : ch.want_logits ? 1 : 0;
    if (logits->size() != rows * static_cast<size_t>(model.config().vocab_size))
      return make_error(Errc::internal,
                        fmt::format("engine step: the model gave {} logits for {} rows of {}",
                                    logits->size(), rows, model.config().vocab_size));
  }
  // On a ring, a sequence with an output constraint is drawn by rank 0 (the one rank holding
  // its grammar), which broadcasts the step's tokens, one per chunk (-1: no draw); every other
  // rank records those instead of drawing its own.
  bool share = false;
  if (comm.world_size() > 1)
    for (size_t k = 0; k < out->chunks.size(); ++k)
      share = share || (out->chunks[k].want_logits && running[out->chunk_seq[k]]->rank0_draws);
  std::vector<int32_t> tokens;
  if (share && comm.rank() != 0) {
    tokens.assign(out->chunks.size(), -1);
    SPARK_TRY(comm.broadcast(tokens.data(), tokens.size() * sizeof(int32_t), 0));
    for (size_t k = 0; k < tokens.size(); ++k) {
      const int32_t t = tokens[k];
      if (out->chunks[k].want_logits && running[out->chunk_seq[k]]->rank0_draws &&
          (t < -1 || t >= model.config().vocab_size))
        return make_error(Errc::integrity,
                          fmt::format("rank {}: rank 0 sent token {} for chunk {}, outside the "
                                      "vocabulary [0, {})",
                                      comm.rank(), t, k, model.config().vocab_size));
    }
  }
  apply_draws(model.config(), running, out, on_device ? &drawn : nullptr, &params, logits, fault,
              score_prompt, share && comm.rank() != 0 ? &tokens : nullptr);
  if (share && comm.rank() == 0) {
    tokens.resize(out->chunks.size());
    for (size_t k = 0; k < tokens.size(); ++k) tokens[k] = out->samples[k].token;
    SPARK_TRY(comm.broadcast(tokens.data(), tokens.size() * sizeof(int32_t), 0));
  }
  return Status::Ok();
}

}  // namespace step_detail

using step_detail::SeqState;

struct Engine::Seq : SeqState {
  RequestId req = 0;  // 0 once the request was cancelled (the plan that drops it is pending)
  int choice = 0;
  int cached = 0;                // prompt tokens that came from the prefix cache
  std::vector<uint64_t> hashes;  // chain hashes of the leading full, computed blocks
  std::chrono::steady_clock::time_point scheduled{};  // got its slot
};

struct Engine::Queued {  // a step queued on the device, its draws not read yet
  step_detail::StepRun run;
  std::vector<uint64_t> seq_ids;  // per chunk
  std::vector<kernels::SampleParams> params;
};

struct Engine::Req {
  RequestId id = 0;
  GenerateRequest r;
  int admitted = 0;  // choices given a slot so far
  int finished = 0;  // choices done
  std::chrono::steady_clock::time_point submitted{};
};

Result<std::unique_ptr<Engine>> Engine::start(std::unique_ptr<Model> model,
                                              std::shared_ptr<Collective> comm,
                                              EngineOptions opts) {
  std::unique_ptr<Engine> e(new Engine());
  const auto& c = model->config();
  if (opts.slots < 1 || opts.block_size < 1 || opts.max_batch_tokens < 1)
    return make_error(Errc::config,
                      "engine: slots, block_size and max_batch_tokens must be positive");
  if (const char* ov = std::getenv("SPARK_OVERLAP_DECODE")) {
    if (std::string_view(ov) != "0" && std::string_view(ov) != "1")
      return make_error(Errc::config,
                        fmt::format("SPARK_OVERLAP_DECODE={}: must be 0 (off) or 1 (on, the "
                                    "default)",
                                    ov));
    if (std::string_view(ov) == "0") opts.overlap_decode = false;
  }
  e->max_context_ =
      opts.max_context > 0 ? std::min(opts.max_context, c.max_position) : c.max_position;
  const int per_seq = (e->max_context_ + opts.block_size - 1) / opts.block_size;
  Device& dev = model->device();
  ElemType kv_type = dev.compute_type();
  bool fp8_values = false;
  if (opts.kv_dtype == "fp32") {
    kv_type = ElemType::f32;
  } else if (opts.kv_dtype == "bf16") {
    if (dev.info().kind != "cuda")
      return make_error(Errc::unsupported,
                        fmt::format("KV_DTYPE=bf16 needs the CUDA device; this rank runs on {}, "
                                    "which keeps the KV cache in fp32 — set KV_DTYPE=auto",
                                    dev.info().name));
    kv_type = ElemType::bf16;
  } else if (opts.kv_dtype == "fp8") {
    // e4m3, no scale (values saturate at +-448): one byte a value on a GPU; the CPU keeps
    // fp32 pools of the same e4m3 values, so its results are the GPU's to compare with.
    if (c.is_mla())
      return make_error(Errc::unsupported,
                        "KV_DTYPE=fp8: this model keeps a latent KV cache (multi-head latent "
                        "attention), which the engine holds in bf16 or fp32 only — set "
                        "KV_DTYPE=auto");
    fp8_values = dev.info().kind != "cuda";
    kv_type = fp8_values ? ElemType::f32 : ElemType::fp8_e4m3;
  } else if (opts.kv_dtype != "auto") {
    return make_error(Errc::unsupported,
                      fmt::format("KV_DTYPE={} is not supported by the native engine (auto, bf16, "
                                  "fp8 or fp32)",
                                  opts.kv_dtype));
  }
  // Windowed layers kept apart: a ring of ring_n blocks per slot, enough for the window and
  // the most tokens one step gives a sequence; only where that is less than a context.
  const int prep_tokens = std::max(opts.max_batch_tokens, opts.slots);
  int ring_n = opts.window_kv ? model->window_ring_blocks(opts.block_size, prep_tokens) : 0;
  if (ring_n >= per_seq) ring_n = 0;
  const uint64_t per_block = model->kv_block_bytes(kv_type, opts.block_size, ring_n > 0);
  const uint64_t window_bytes =
      ring_n > 0 ? model->kv_window_block_bytes(kv_type, opts.block_size) *
                       static_cast<uint64_t>(ring_n) * static_cast<uint64_t>(opts.slots)
                 : 0;
  // The CPU keeps SLOTS full contexts (its memory is the guard's to watch); a GPU sizes
  // from what is free, because there an over-large cache fails at allocation.
  if (opts.kv_from_free_memory && opts.num_blocks <= 0 && dev.info().kind == "cuda") {
    auto avail = opts.kv_memory_available ? Result<uint64_t>(opts.kv_memory_available)
                                          : dev.available_bytes();
    if (!avail) return avail.error();
    const uint64_t share = static_cast<uint64_t>(std::max(opts.kv_memory_share, 1));
    const uint64_t budget = (*avail > opts.mem_reserve ? *avail - opts.mem_reserve : 0) / share;
    const uint64_t need = static_cast<uint64_t>(per_seq) * per_block + window_bytes;
    if (budget < need) {
      const uint64_t fits = (budget > window_bytes ? budget - window_bytes : 0) / per_block *
                            static_cast<uint64_t>(opts.block_size);
      const std::string where =
          share > 1 ? fmt::format(" ({}'s memory, shared by {} ranks: each gets a {}th)",
                                  opts.kv_memory_where, share, share)
                    : std::string();
      return make_error(
          Errc::resource,
          fmt::format("KV cache: one request of the full context ({} tokens) needs {} MiB of {} "
                      "KV on {}, but {} MiB is available after the weights{} and MEM_RESERVE {} "
                      "MiB leaves {} MiB; the largest context that fits is {} tokens — lower "
                      "CONTEXT_LEN or MEM_RESERVE, or split the model over more ranks",
                      e->max_context_, need >> 20, elem_name(kv_type), dev.info().name,
                      *avail >> 20, where, opts.mem_reserve >> 20, budget >> 20, fits));
    }
    opts.kv_cache_bytes = budget;
  }
  if (opts.num_blocks <= 0) {
    const uint64_t fit =
        (opts.kv_cache_bytes > window_bytes ? opts.kv_cache_bytes - window_bytes : 0) / per_block;
    opts.num_blocks = static_cast<int>(std::min<uint64_t>(
        fit, static_cast<uint64_t>(per_seq) * static_cast<uint64_t>(opts.slots)));
    if (opts.num_blocks < 1)
      return make_error(
          Errc::resource,
          fmt::format("engine: kv_cache_bytes {} holds no {}-token block ({} bytes) — raise it",
                      opts.kv_cache_bytes, opts.block_size, per_block));
  }
  e->opts_ = opts;
  e->model_ = std::move(model);
  e->comm_ = std::move(comm);
  const int window_blocks = ring_n * opts.slots;
  auto cache = e->model_->make_kv_cache(opts.num_blocks, opts.block_size, kv_type, window_blocks);
  if (!cache) return cache.error();
  e->cache_ = std::move(*cache);
  e->cache_->set_fp8_values(fp8_values);
  if (ring_n > 0) {
    e->ring_n_ = ring_n;
    e->recompute_ = e->model_->window_recompute_tokens();
    for (int r = opts.slots; r-- > 0;) e->free_rings_.push_back(r);
  }
  SPARK_TRY(e->model_->prepare(prep_tokens, opts.slots, e->max_context_, opts.block_size,
                               opts.cuda_graphs));
  e->blocks_ =
      std::make_unique<BlockManager>(opts.num_blocks, opts.block_size, opts.prefix_caching);
  if (e->comm_->world_size() > 1) {
    // The workers size their cache and step buffers as rank 0 does, and capture graphs
    // exactly when it does (the collectives inside must match step for step).
    int64_t sizes[kWorkerSizes] = {opts.num_blocks,
                                   opts.block_size,
                                   static_cast<int64_t>(kv_type),
                                   prep_tokens,
                                   opts.slots,
                                   e->max_context_,
                                   opts.cuda_graphs ? 1 : 0,
                                   std::max(1, opts.control_timeout_ms),
                                   opts.control_socket_buffer,
                                   window_blocks};
    SPARK_TRY(e->comm_->broadcast(sizes, sizeof(sizes), 0));
    auto ctl = ControlChannel::connect(
        *e->comm_, std::chrono::milliseconds(std::max(1, opts.control_timeout_ms)),
        opts.control_socket_buffer);
    if (!ctl) return ctl.error();
    e->ctl_ = std::move(*ctl);
  }
  e->stats_.slots = opts.slots;
  e->stats_.device = e->model_->device().info().name;
  e->stats_.kv_dtype = fp8_values ? "fp8" : elem_name(kv_type);
  e->stats_.blocks_total = opts.num_blocks;
  e->stats_.blocks_available = opts.num_blocks;
  e->stats_.block_size = opts.block_size;
  e->stats_.prefix_caching = opts.prefix_caching;
  e->stats_.kv_bytes = e->cache_->bytes();
  e->stats_.window_ring_blocks = ring_n;
  log::info(
      "engine", "{} on {}: {} slots, {} KV blocks of {} tokens ({} MiB {}), context {}, TP {}{}",
      c.architecture, e->model_->device().info().name, opts.slots, opts.num_blocks, opts.block_size,
      e->cache_->bytes() >> 20, elem_name(kv_type), e->max_context_, e->comm_->world_size(),
      ring_n > 0 ? fmt::format("; sliding-window layers keep {} blocks a sequence ({} tokens)",
                               ring_n, ring_n * opts.block_size)
                 : std::string());
  e->overlap_ = opts.overlap_decode && e->comm_->world_size() == 1 &&
                e->model_->device().samples_on_device() && e->model_->device().queues_steps();
  e->thread_ = std::thread([p = e.get()] { p->loop(); });
  return e;
}

Engine::~Engine() {
  stop();
}

void Engine::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Result<RequestId> Engine::submit(GenerateRequest req) {
  const auto& c = model_->config();
  SPARK_TRY(validate(req.params, c.vocab_size));
  if (req.prompt.empty()) return make_error(Errc::usage, "the prompt is empty");
  for (auto t : req.prompt)
    if (t < 0 || t >= c.vocab_size)
      return make_error(
          Errc::usage,
          fmt::format("prompt token id {} is outside the vocabulary [0, {})", t, c.vocab_size));
  if (static_cast<int>(req.prompt.size()) >= max_context_)
    return make_error(Errc::usage,
                      fmt::format("context_length_exceeded: the prompt has {} tokens; this model's "
                                  "context is {} tokens, leaving no room to generate",
                                  req.prompt.size(), max_context_));
  const int total = static_cast<int>(std::min<int64_t>(
      static_cast<int64_t>(req.prompt.size()) + req.params.max_tokens, max_context_));
  const int need = (total + opts_.block_size - 1) / opts_.block_size;
  if (need > opts_.num_blocks)
    return make_error(
        Errc::resource,
        fmt::format("the request needs {} KV blocks ({} tokens) but the cache has {} — "
                    "lower max_tokens or raise the KV cache size",
                    need, total, opts_.num_blocks));
  if (!req.on_event) return make_error(Errc::usage, "the request has no event callback");
  std::lock_guard<std::mutex> lk(mu_);
  if (stats_.failed) return make_error(Errc::internal, "the engine failed: " + stats_.error);
  if (stopping_) return make_error(Errc::precondition, "the engine is stopping");
  const RequestId id = next_id_++;
  inbox_.submits.push_back({id, std::move(req), std::chrono::steady_clock::now()});
  cv_.notify_all();
  return id;
}

void Engine::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    inbox_.cancels.push_back(id);
  }
  cv_.notify_all();
}

EngineStats Engine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lk(mu_);
    s = stats_;
  }
  const int64_t started = step_started_ns_.load();
  if (started != 0) {
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    s.step_running_ms = (now - started) / 1000000;
  }
  return s;
}

void Engine::publish_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_.running = static_cast<int>(running_.size());
  stats_.waiting = static_cast<int>(waiting_.size());
  stats_.blocks_available = blocks_->available();
  stats_.cached_tokens = blocks_->hit_blocks() * static_cast<uint64_t>(opts_.block_size);
}

void Engine::emit(Req& r, TokenEvent ev) {
  ev.request = r.id;
  ev.prompt_tokens = static_cast<int>(r.r.prompt.size());
  ev.submitted = r.submitted;
  r.r.on_event(ev);
}

void Engine::finish_seq(size_t index, FinishReason why, const std::string& error) {
  auto seq = std::move(running_[index]);
  running_.erase(running_.begin() + static_cast<ptrdiff_t>(index));
  release_seq(*seq);
  auto it = reqs_.find(seq->req);
  if (it == reqs_.end()) return;
  Req& r = *it->second;
  ++r.finished;
  TokenEvent ev;
  ev.choice = seq->choice;
  ev.finish = why;
  ev.error = error;
  ev.completion_tokens = seq->generated;
  ev.cached_prompt_tokens = seq->cached;
  ev.scheduled = seq->scheduled;
  ev.request_done = r.finished == r.r.params.n;
  publish_stats();  // callers woken by the last event see the freed blocks
  emit(r, std::move(ev));
  if (r.finished == r.r.params.n) reqs_.erase(it);
}

void Engine::release_seq(Seq& s) {
  blocks_->release(s.blocks);
  s.blocks.clear();
  if (!s.ring.empty()) free_rings_.push_back(s.ring.front() / ring_n_);
  s.ring.clear();
}

void Engine::cancel_req(RequestId id, FinishReason why, const std::string& error) {
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return;
  Req& r = *it->second;
  // A running sequence leaves every rank at the same step: alone, at once; in a ring, with
  // the next plan (until then it runs on, its events no longer emitted).
  const bool tp = comm_->world_size() > 1;
  for (size_t i = running_.size(); i-- > 0;)
    if (running_[i]->req == id) {
      if (tp) {
        cancelled_.push_back(running_[i]->id);
        running_[i]->req = 0;
      } else {
        release_seq(*running_[i]);
        running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
      }
    }
  for (size_t i = admitted_.size(); i-- > 0;)  // admitted, not yet in a plan: never ran
    if (admitted_[i]->req == id) {
      release_seq(*admitted_[i]);
      admitted_.erase(admitted_.begin() + static_cast<ptrdiff_t>(i));
    }
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  TokenEvent ev;
  ev.finish = why;
  ev.error = error;
  ev.request_done = true;
  publish_stats();
  emit(r, std::move(ev));
  reqs_.erase(it);
}

void Engine::admit() {
  const int bs = opts_.block_size;
  while (static_cast<int>(running_.size() + admitted_.size()) < opts_.slots && !waiting_.empty()) {
    Req& r = *reqs_.at(waiting_.front());
    auto s = std::make_unique<Seq>();
    s->id = next_seq_++;
    s->req = r.id;
    s->choice = r.admitted;
    s->tokens = r.r.prompt;
    s->prompt_len = static_cast<int>(s->tokens.size());
    s->max_total = static_cast<int>(std::min<int64_t>(
        static_cast<int64_t>(s->prompt_len) + r.r.params.max_tokens, max_context_));
    // Reuse cached full blocks, but always compute at least the last prompt token; a request
    // for prompt logprobs computes its whole prompt (a cached block has no logits).
    const int reusable = r.r.params.prompt_logprobs >= 0 ? 0 : (s->prompt_len - 1) / bs;
    int matched = blocks_->match_prefix(s->tokens, reusable, &s->blocks, &s->hashes);
    // With windowed layers kept apart, a hit recomputes the tokens whose K/V those layers'
    // rings need (their stacked windows' reach) without writing the shared blocks; a hit
    // no longer than that reach saves nothing and is given back.
    int recompute = 0;
    if (ring_n_ > 0 && matched > 0) {
      if (matched * bs <= recompute_) {
        blocks_->release(s->blocks);
        s->blocks.clear();
        s->hashes.clear();
        matched = 0;
      } else {
        recompute = recompute_;
      }
    }
    const int need = (s->max_total + bs - 1) / bs - matched;
    // There are as many rings as slots, so one is free whenever a slot is; the check keeps
    // a miscount from ever handing out a ring twice.
    if ((ring_n_ > 0 && free_rings_.empty()) || !blocks_->allocate(need, &s->blocks)) {
      blocks_->release(s->blocks);
      break;  // wait for running sequences to free blocks (submit() made sure it can ever fit)
    }
    if (ring_n_ > 0) {
      const int32_t ring = free_rings_.back();
      free_rings_.pop_back();
      s->ring.resize(static_cast<size_t>(ring_n_));
      for (int i = 0; i < ring_n_; ++i) s->ring[static_cast<size_t>(i)] = ring * ring_n_ + i;
    }
    blocks_->note_hits(matched);
    if (opts_.prefix_caching) {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.prefix_queries += static_cast<uint64_t>(s->prompt_len);
    }
    s->write_from = matched * bs;
    s->computed = s->cached = matched * bs - recompute;  // cached: tokens not computed
    s->scheduled = std::chrono::steady_clock::now();
    // Without a seed, a fresh one per sequence, fixed here so that every rank draws alike.
    s->params = r.r.params;
    if (!s->params.seed)
      s->params.seed = static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}();
    s->sampler = std::make_unique<Sampler>(s->params, model_->config().vocab_size, r.r.prompt,
                                           static_cast<uint64_t>(s->choice));
    s->rank0_draws = s->params.constraint != nullptr;
    admitted_.push_back(std::move(s));
    if (++r.admitted == r.r.params.n) waiting_.pop_front();
  }
}

StepPlan Engine::take_plan() {
  StepPlan p;
  p.kind = PlanKind::step;
  p.cancels = std::move(cancelled_);
  cancelled_.clear();
  if (comm_->world_size() == 1) return p;  // nobody to tell: the admissions stay local
  for (const auto& s : admitted_) {
    PlanAdmit a;
    a.seq = s->id;
    a.stream = static_cast<uint64_t>(s->choice);
    a.prompt = s->tokens;
    a.max_total = s->max_total;
    a.computed = s->computed;
    a.blocks = s->blocks;
    a.ring = s->ring;
    a.write_from = s->write_from;
    a.params = s->params;
    a.rank0_draws = s->rank0_draws;
    p.admits.push_back(std::move(a));
  }
  return p;
}

void Engine::apply_plan(const StepPlan& plan, std::vector<std::unique_ptr<Seq>> seqs) {
  for (uint64_t id : plan.cancels)
    for (size_t i = 0; i < running_.size(); ++i)
      if (running_[i]->id == id) {  // absent: it finished in the step before, on every rank
        release_seq(*running_[i]);
        running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
        break;
      }
  for (auto& s : seqs) running_.push_back(std::move(s));
  step_serial_ = plan.serial;
}

Status Engine::post_plan(StepPlan& plan) {
  plan.serial = ++plan_serial_;
  plan.ahead = opts_.overlap_plan;
  plan.digest_step = digest_step_;
  plan.digest = digest_;
  const std::string bytes = encode_plan(plan);
  // Overlapped, the plan goes out without waiting for the followers to read it: they are
  // in the step rank 0 is about to compute, and read it when they finish.
  SPARK_TRY(ctl_->post(bytes, !opts_.overlap_plan));
  last_post_ = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.plans_posted;
  if (plan.ahead) ++stats_.plans_ahead;
  stats_.plan_bytes += bytes.size();
  stats_.plans_deferred = ctl_->deferred_posts();
  return Status::Ok();
}

Status Engine::keepalive() {
  if (!ctl_) return Status::Ok();
  if (ctl_->pending()) SPARK_TRY(ctl_->flush());
  if (std::chrono::steady_clock::now() - last_post_ < std::chrono::milliseconds(opts_.heartbeat_ms))
    return Status::Ok();
  StepPlan hb;
  hb.kind = PlanKind::heartbeat;
  SPARK_TRY(ctl_->post(encode_plan(hb), true));
  last_post_ = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.heartbeats;
  return Status::Ok();
}

Status Engine::step() {
  // A prompt still wanting the logits of every row (prompt logprobs) runs in a step of its
  // own kind (logits to the host): queued steps draw on the device and are not used until
  // it is done. A step already queued runs first (it holds no such prompt).
  bool every_row = false;
  for (const auto& s : running_)
    every_row = every_row || (s->params.prompt_logprobs >= 0 && s->computed < s->prompt_len);
  if (overlap_ && (ahead_ || !every_row)) return step_queued();
  std::vector<SeqState*> view;
  view.reserve(running_.size());
  for (auto& s : running_) view.push_back(s.get());
  step_detail::StepRun run;
  SPARK_TRY(step_detail::run_step(*model_, *cache_, *comm_, view,
                                  std::max(opts_.max_batch_tokens, opts_.slots), &logits_, &run, {},
                                  true));
  if (run.chunks.empty()) return Status::Ok();
  finish_run(run);
  return Status::Ok();
}

// Overlapped decode (a device that queues steps, one rank): while a decode step runs on the
// device, the next one is queued behind it with the tokens it draws fed to it there, so the
// device never waits for the host to read the draws, decide and launch. That next step is
// queued only when it is sure to run as queued: every running sequence decodes in this
// step, none can reach its length limit in it, and none has penalties or an output constraint
// (whose state and mask need the draw). A sequence that ends in this step anyway (EOS, a stop id, a
// cancel) has its row of the queued step dropped; its K/V write there lands past its end, in its
// own blocks, and is ordered before any later use of them.
Status Engine::step_queued() {
  std::unique_ptr<Queued> cur = std::move(ahead_);
  if (!cur) {
    cur = std::make_unique<Queued>();
    std::vector<SeqState*> view;
    for (auto& s : running_) view.push_back(s.get());
    step_detail::plan_step(view, std::max(opts_.max_batch_tokens, opts_.slots), &cur->run);
    if (cur->run.chunks.empty()) return Status::Ok();
    std::vector<Device::PenaltyHistory> history;
    step_detail::draw_params(view, cur->run, &cur->params, &history);
    for (size_t i : cur->run.chunk_seq) cur->seq_ids.push_back(running_[i]->id);
    SPARK_TRY(model_->queue_sample(cur->run.chunks, *cache_, *comm_, cur->params, false, history));
  }
  // The step after it, queued now when it will run as it is.
  bool ahead = cur->run.decode_only && running_.size() == cur->run.chunks.size();
  for (size_t k = 0; ahead && k < cur->run.chunks.size(); ++k) {
    const auto& ch = cur->run.chunks[k];
    const Seq* s = running_[k]->id == cur->seq_ids[k] ? running_[k].get() : nullptr;
    ahead = s && ch.n == 1 && ch.want_logits && !step_detail::has_penalty(cur->params[k]) &&
            !s->sampler->constrained() && static_cast<int>(s->tokens.size()) + 1 < s->max_total;
  }
  if (ahead) {
    auto next = std::make_unique<Queued>();
    next->seq_ids = cur->seq_ids;
    for (size_t k = 0; k < cur->run.chunks.size(); ++k) {
      const Seq& s = *running_[k];
      const auto& ch = cur->run.chunks[k];
      static const int32_t kFed = 0;  // not read: the device feeds the drawn token
      next->run.chunks.push_back({&kFed, 1, ch.start_pos + 1, s.blocks.data(), true});
      next->run.chunks.back().ring = s.ring.data();
      next->run.chunks.back().ring_n = static_cast<int>(s.ring.size());
      next->run.chunk_seq.push_back(k);
      next->params.push_back(s.sampler->next_params(1));
    }
    SPARK_TRY(model_->queue_sample(next->run.chunks, *cache_, *comm_, next->params, true, {}));
    ahead_ = std::move(next);
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.steps_queued_ahead;
  }
  std::vector<kernels::SampleResult> drawn;
  SPARK_TRY(model_->wait_sample(&drawn));
  // The sequences as they are now (a cancel may have removed some since it was queued).
  std::vector<SeqState*> view;
  for (auto& s : running_) view.push_back(s.get());
  for (size_t k = 0; k < cur->run.chunks.size(); ++k) {
    cur->run.chunk_seq[k] = step_detail::kGone;
    for (size_t i = 0; i < running_.size(); ++i)
      if (running_[i]->id == cur->seq_ids[k]) cur->run.chunk_seq[k] = i;
  }
  step_detail::apply_draws(model_->config(), view, &cur->run, &drawn, &cur->params, nullptr, {});
  finish_run(cur->run);
  // A queued step none of whose sequences runs any more is only waited for.
  if (ahead_) {
    bool any = false;
    for (uint64_t id : ahead_->seq_ids)
      for (const auto& s : running_) any = any || s->id == id;
    if (!any) return drain_queued();
  }
  return Status::Ok();
}

Status Engine::drain_queued() {
  if (!ahead_) return Status::Ok();
  ahead_.reset();
  std::vector<kernels::SampleResult> unused;
  return model_->wait_sample(&unused);
}

void Engine::finish_run(StepRun& run) {
  const int bs = opts_.block_size;
  uint64_t prompt_done = 0;
  for (size_t k = 0; k < run.chunks.size(); ++k) {
    if (run.chunk_seq[k] == step_detail::kGone) continue;
    Seq& s = *running_[run.chunk_seq[k]];
    const int before = s.computed - run.chunks[k].n;
    if (before < s.prompt_len)
      prompt_done += static_cast<uint64_t>(std::min(s.computed, s.prompt_len) - before);
    // Register blocks that just became full and computed, for prefix reuse.
    while (static_cast<int>(s.hashes.size()) < s.computed / bs) {
      const int idx = static_cast<int>(s.hashes.size());
      const uint64_t h = blocks_->block_hash(s.tokens, idx, idx == 0 ? 0 : s.hashes.back());
      blocks_->register_block(s.blocks[static_cast<size_t>(idx)], h, s.tokens, idx);
      s.hashes.push_back(h);
    }
    auto it = reqs_.find(s.req);
    if (run.chunks[k].all_logits && s.computed >= s.prompt_len && it != reqs_.end()) {
      TokenEvent pe;  // the prompt's logprobs, before the choice's first token
      pe.choice = s.choice;
      pe.has_prompt_logprobs = true;
      pe.prompt_logprobs = std::move(s.prompt_scores);
      pe.cached_prompt_tokens = s.cached;
      pe.scheduled = s.scheduled;
      emit(*it->second, std::move(pe));
    }
    Sample& smp = run.samples[k];
    if (smp.token < 0) continue;
    if (it == reqs_.end()) continue;  // cancelled: it leaves with the next plan
    TokenEvent ev;
    ev.choice = s.choice;
    ev.token = smp.token;
    ev.logprob = smp.logprob;
    ev.top_logprobs = std::move(smp.top);
    ev.completion_tokens = s.generated;
    ev.cached_prompt_tokens = s.cached;
    ev.scheduled = s.scheduled;
    emit(*it->second, std::move(ev));
  }
  if (run.draws > 0) {
    digest_step_ = step_serial_;
    digest_ = run.digest;
  }
  StepTrace trace;
  {
    std::lock_guard<std::mutex> lk(mu_);
    trace.step = ++stats_.steps;
    stats_.prompt_tokens += prompt_done;
    stats_.generated_tokens += static_cast<uint64_t>(run.draws);
  }
  if (opts_.on_step)
    for (size_t k = 0; k < run.chunks.size(); ++k) {
      if (run.chunk_seq[k] == step_detail::kGone) continue;
      const Seq& s = *running_[run.chunk_seq[k]];
      trace.chunks.push_back(
          {s.req, s.choice, run.chunks[k].n, std::max(0, s.prompt_len - s.computed)});
    }
  // Finish from the back so indices stay valid.
  std::sort(run.done.begin(), run.done.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [i, why] : run.done) finish_seq(i, why);
  if (opts_.on_step) opts_.on_step(trace);
}

void Engine::loop() {
  const bool tp = comm_->world_size() > 1;
  for (;;) {
    Inbox in;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      const bool idle = running_.empty() && waiting_.empty() && !pending_;
      if (idle && inbox_.submits.empty() && inbox_.cancels.empty() && !stopping_) {
        lk.unlock();
        if (Status st = tp ? ctl_->flush() : Status::Ok(); !st.ok()) {
          lk.lock();
          stats_.failed = true;
          stats_.error = st.message();
          lk.unlock();
          log::error("engine", "control plane failed: {}", st.message());
          ctl_->close();
          break;
        }
        lk.lock();
        cv_.wait_for(lk, std::chrono::milliseconds(opts_.heartbeat_ms), [&] {
          return !inbox_.submits.empty() || !inbox_.cancels.empty() || stopping_;
        });
      }
      std::swap(in, inbox_);
      stop = stopping_;
    }
    // The plan posted ahead in the last iteration takes effect before this step, on every
    // rank alike; the followers apply it when they finish the last step.
    bool applied = false;
    if (pending_) {
      auto p = std::move(pending_);
      apply_plan(p->plan, std::move(p->seqs));
      applied = true;
    }
    for (auto& sub : in.submits) {
      auto r = std::make_unique<Req>();
      r->id = sub.id;
      r->r = std::move(sub.r);
      r->submitted = sub.at;
      reqs_[sub.id] = std::move(r);
      waiting_.push_back(sub.id);
    }
    for (RequestId id : in.cancels) cancel_req(id, FinishReason::cancelled, {});
    if (stop) {
      // The followers run the step of the plan posted ahead: so does rank 0, or they would
      // wait for it in that step's collectives until their deadline.
      if (applied && !running_.empty()) {
        Status st = ctl_->flush();  // the rest of a long plan, which the followers need first
        if (st.ok()) st = step();
        if (!st.ok()) log::warn("engine", "last step: {}", st.message());
      }
      break;
    }
    admit();
    StepPlan plan = take_plan();
    Status st = Status::Ok();
    if (!tp) {
      apply_plan(plan, std::move(admitted_));
    } else if (opts_.overlap_plan) {
      // Posted now, applied before the next step: this step's draws cannot change it (every
      // rank makes the stop decisions), so it travels while the step computes.
      if (plan.has_content() || !running_.empty()) {
        st = post_plan(plan);
        pending_ = std::make_unique<Pending>(Pending{std::move(plan), std::move(admitted_)});
      } else {
        st = keepalive();
      }
    } else {
      apply_plan(plan, std::move(admitted_));
      st = plan.has_content() || !running_.empty() ? post_plan(plan) : keepalive();
      step_serial_ = plan.serial;
    }
    admitted_.clear();
    if (st.ok() && !running_.empty()) {
      step_started_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
      st = step();
      step_started_ns_ = 0;
    } else if (st.ok()) {
      st = drain_queued();  // its sequences were cancelled
    }
    if (!st.ok() && ctl_) {
      // A follower that left the ring (a divergence) said why before it closed its
      // connections: that is the cause of the failed collective.
      if (std::string why = ctl_->reports(std::chrono::milliseconds(200)); !why.empty())
        st = make_error(Errc::internal, why + " (rank 0 then: " + st.message() + ")");
    }
    publish_stats();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!st.ok()) {
        stats_.failed = true;
        stats_.error = st.message();
      }
    }
    if (!st.ok()) {
      log::error("engine", "step failed: {}", st.message());
      std::vector<RequestId> ids;
      for (const auto& [id, r] : reqs_) ids.push_back(id);
      for (RequestId id : ids) cancel_req(id, FinishReason::error, st.message());
      if (ctl_) ctl_->close();  // the followers stop at once, not at their deadline
      break;
    }
  }
  // Stopping: end everything still pending, release TP workers.
  if (Status st = drain_queued(); !st.ok()) log::warn("engine", "queued step: {}", st.message());
  std::vector<RequestId> ids;
  for (const auto& [id, r] : reqs_) ids.push_back(id);
  for (RequestId id : ids) cancel_req(id, FinishReason::cancelled, "the engine stopped");
  Inbox left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::swap(left, inbox_);
    stopping_ = true;  // submit() refuses from here on
  }
  for (auto& sub : left.submits) {  // callbacks run without the lock held
    TokenEvent ev;
    ev.request = sub.id;
    ev.finish = FinishReason::cancelled;
    ev.request_done = true;
    ev.error = "the engine stopped";
    sub.r.on_event(ev);
  }
  if (tp && !stats().failed) {
    StepPlan s;
    s.kind = PlanKind::stop;
    (void)ctl_->post(encode_plan(s), true);
  }
}

Status run_tp_worker(Model& model, Collective& comm, const TpWorkerOptions& wo) {
  int64_t sizes[kWorkerSizes] = {};
  SPARK_TRY(comm.broadcast(sizes, sizeof(sizes), 0));
  auto made = model.make_kv_cache(static_cast<int>(sizes[0]), static_cast<int>(sizes[1]),
                                  static_cast<ElemType>(sizes[2]), static_cast<int>(sizes[9]));
  if (!made) return made.error();
  KVCache& cache = **made;
  SPARK_TRY(model.prepare(static_cast<int>(sizes[3]), static_cast<int>(sizes[4]),
                          static_cast<int>(sizes[5]), static_cast<int>(sizes[1]), sizes[6] != 0));
  auto ctl = ControlChannel::connect(comm, std::chrono::milliseconds(sizes[7]),
                                     static_cast<int>(sizes[8]));
  if (!ctl) return ctl.error();
  log::info("engine", "TP worker rank {}: {} KV blocks of {} tokens", comm.rank(), sizes[0],
            sizes[1]);
  TpWorkerStats local;
  TpWorkerStats& stats = wo.stats ? *wo.stats : local;
  const int budget = static_cast<int>(sizes[3]);
  const int vocab = model.config().vocab_size;
  std::vector<std::unique_ptr<SeqState>> running;
  std::vector<float> logits;
  // The digests of this rank's last steps, to compare with rank 0's as its plans bring them.
  std::array<std::pair<uint64_t, uint64_t>, 8> recent{};
  // Leaves the ring for good: rank 0 learns why, and its collectives fail at once.
  auto leave = [&](const Error& e) {
    (*ctl)->report(e.message);
    comm.shutdown();
    return e;
  };
  for (;;) {
    bool arrived = false;
    auto msg = (*ctl)->next(&arrived);
    if (!msg) return msg.error();
    auto plan = decode_plan(*msg);
    if (!plan)
      return leave(make_error(plan.error().code,
                              fmt::format("rank {}: {}", comm.rank(), plan.error().message)));
    if (plan->kind == PlanKind::stop) {
      log::info("engine",
                "TP worker rank {}: rank 0 stopped; {} step plans ({} posted ahead, {} already "
                "here when asked for), {} tokens drawn, {} digests checked",
                comm.rank(), stats.plans, stats.plans_ahead, stats.plans_ready, stats.tokens,
                stats.digests_checked);
      return Status::Ok();
    }
    if (plan->kind == PlanKind::heartbeat) continue;
    ++stats.plans;
    stats.plan_bytes += msg->size();
    if (plan->ahead) ++stats.plans_ahead;
    if (!plan->has_content()) ++stats.bare_plans;
    ++(arrived ? stats.plans_ready : stats.plans_waited);
    if (plan->digest_step != 0)
      for (const auto& [step, digest] : recent)
        if (step == plan->digest_step) {
          ++stats.digests_checked;
          if (digest != plan->digest)
            return leave(make_error(
                Errc::integrity,
                fmt::format("rank {} diverged from rank 0 at step {}: its tokens' digest is "
                            "{:016x}, rank 0's {:016x} — the ranks drew different tokens from "
                            "what must be the same logits (a nondeterministic kernel or a "
                            "damaged rank); the ring stops rather than serve wrong text; "
                            "restart it, and report this if it recurs",
                            comm.rank(), step, digest, plan->digest)));
        }
    for (uint64_t id : plan->cancels)
      for (size_t i = 0; i < running.size(); ++i)
        if (running[i]->id == id) {
          running.erase(running.begin() + static_cast<ptrdiff_t>(i));
          break;
        }
    for (auto& a : plan->admits) {
      auto s = std::make_unique<SeqState>();
      s->id = a.seq;
      s->tokens = a.prompt;
      s->prompt_len = static_cast<int>(a.prompt.size());
      s->max_total = a.max_total;
      s->computed = a.computed;
      s->blocks = std::move(a.blocks);
      s->ring = std::move(a.ring);
      s->write_from = a.write_from;
      if ((cache.window_blocks() > 0) != !s->ring.empty() ||
          std::any_of(s->ring.begin(), s->ring.end(),
                      [&](int32_t b) { return b < 0 || b >= cache.window_blocks(); }))
        return leave(make_error(
            Errc::integrity,
            fmt::format("rank {}: the plan of step {} gives sequence {} a ring of {} blocks "
                        "outside this rank's {} window blocks",
                        comm.rank(), plan->serial, s->id, s->ring.size(), cache.window_blocks())));
      const int need = (s->max_total + static_cast<int>(sizes[1]) - 1) / static_cast<int>(sizes[1]);
      if (static_cast<int>(s->blocks.size()) < need)
        return leave(make_error(
            Errc::integrity,
            fmt::format("rank {}: the plan of step {} gives sequence {} {} "
                        "KV blocks for {} tokens",
                        comm.rank(), plan->serial, s->id, s->blocks.size(), s->max_total)));
      s->params = std::move(a.params);
      s->sampler = std::make_unique<Sampler>(s->params, vocab, s->tokens, a.stream);
      s->rank0_draws = a.rank0_draws;
      running.push_back(std::move(s));
    }
    if (running.empty()) continue;
    std::vector<SeqState*> view;
    for (auto& s : running) view.push_back(s.get());
    step_detail::StepRun run;
    step_detail::FaultFn fault;
    if (wo.fault_inject_token)
      fault = [&, serial = plan->serial](uint64_t seq, int32_t* t) {
        wo.fault_inject_token(seq, serial, t);
      };
    SPARK_TRY(step_detail::run_step(model, cache, comm, view, budget, &logits, &run, fault));
    if (run.chunks.empty()) continue;
    ++stats.steps;
    stats.tokens += static_cast<uint64_t>(run.draws);
    if (run.decode_only) {
      ++stats.decode_steps;
      if (arrived) ++stats.decode_plans_ready;
    }
    if (run.draws > 0) recent[plan->serial % recent.size()] = {plan->serial, run.digest};
    std::sort(run.done.begin(), run.done.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& d : run.done) running.erase(running.begin() + static_cast<ptrdiff_t>(d.first));
  }
}

Result<BlockingResult> generate_blocking(Engine& engine, std::vector<int32_t> prompt,
                                         SamplingParams params, int timeout_ms) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    BlockingResult res;
    std::string error;
  };
  auto sh = std::make_shared<Shared>();
  const int n = params.n;
  sh->res.tokens.resize(static_cast<size_t>(n));
  sh->res.finish.resize(static_cast<size_t>(n), FinishReason::none);
  sh->res.logprobs.resize(static_cast<size_t>(n));
  sh->res.prompt_logprobs.resize(static_cast<size_t>(n));
  GenerateRequest req{std::move(prompt), params, [sh](const TokenEvent& e) {
                        std::lock_guard<std::mutex> lk(sh->mu);
                        const size_t c = static_cast<size_t>(e.choice);
                        if (e.token >= 0) {
                          sh->res.tokens[c].push_back(e.token);
                          sh->res.logprobs[c].push_back(e.logprob);
                        }
                        if (e.choice == 0) sh->res.cached_prompt_tokens = e.cached_prompt_tokens;
                        if (e.has_prompt_logprobs) sh->res.prompt_logprobs[c] = e.prompt_logprobs;
                        if (e.finish != FinishReason::none) {
                          sh->res.finish[c] = e.finish;
                          if (!e.error.empty()) sh->error = e.error;
                        }
                        if (e.request_done) {
                          sh->done = true;
                          sh->cv.notify_all();
                        }
                      }};
  auto id = engine.submit(std::move(req));
  if (!id) return id.error();
  std::unique_lock<std::mutex> lk(sh->mu);
  if (!sh->cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return sh->done; })) {
    lk.unlock();
    engine.cancel(*id);
    return make_error(Errc::timeout,
                      fmt::format("request {} did not finish within {} ms", *id, timeout_ms));
  }
  if (!sh->error.empty()) return make_error(Errc::internal, sh->error);
  return sh->res;
}

}  // namespace spark::engine
