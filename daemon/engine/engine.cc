#include "daemon/engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>

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
constexpr int32_t kPlanStop = -1;
constexpr int32_t kPlanHeartbeat = 0;
// What rank 0 tells the workers at start: KV blocks, block size, KV type, and the arguments
// of Model::prepare (tokens, sequences, context, graphs).
constexpr int kWorkerSizes = 7;
// The step plan travels in one broadcast of kPlanInline words: the header (its length, or
// kPlanStop / kPlanHeartbeat) and the plan itself when it fits, which covers every decode
// step of a handful of sequences; a longer plan (prefill chunks) sends the rest in a second.
// One message per step instead of two halves what the control plane adds to a step: the
// workers wait for it before their first layer.
constexpr size_t kPlanInline = 512;

Status send_plan(Collective& comm, int32_t head, const std::vector<int32_t>& plan) {
  std::array<int32_t, kPlanInline> msg{};
  msg[0] = head;
  const size_t first = std::min(plan.size(), kPlanInline - 1);
  std::copy_n(plan.begin(), first, msg.begin() + 1);
  SPARK_TRY(comm.broadcast(msg.data(), sizeof(msg), 0));
  if (plan.size() > first)
    SPARK_TRY(comm.broadcast(const_cast<int32_t*>(plan.data()) + first,
                             (plan.size() - first) * sizeof(int32_t), 0));
  return Status::Ok();
}

// A worker's side of send_plan: the header, and the plan when the header is a length.
Status recv_plan(Collective& comm, int32_t* head, std::vector<int32_t>* plan) {
  std::array<int32_t, kPlanInline> msg{};
  SPARK_TRY(comm.broadcast(msg.data(), sizeof(msg), 0));
  *head = msg[0];
  if (*head <= 0) return Status::Ok();
  if (*head > (1 << 28))
    return make_error(Errc::internal, fmt::format("TP worker: bad plan size {}", *head));
  plan->resize(static_cast<size_t>(*head));
  const size_t first = std::min(plan->size(), kPlanInline - 1);
  std::copy_n(msg.begin() + 1, first, plan->begin());
  if (plan->size() > first)
    SPARK_TRY(comm.broadcast(plan->data() + first, (plan->size() - first) * sizeof(int32_t), 0));
  return Status::Ok();
}
}  // namespace

struct Engine::Seq {
  RequestId req = 0;
  int choice = 0;
  std::vector<int32_t> tokens;  // prompt + generated
  int prompt_len = 0;
  int max_total = 0;  // prompt + max_tokens, capped by the context
  int computed = 0;   // tokens whose K/V are in the cache
  int cached = 0;     // prompt tokens that came from the prefix cache
  std::vector<int32_t> blocks;
  std::vector<uint64_t> hashes;  // chain hashes of the leading full, computed blocks
  std::unique_ptr<Sampler> sampler;
  int generated = 0;
  std::chrono::steady_clock::time_point scheduled{};  // got its slot
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
  e->max_context_ =
      opts.max_context > 0 ? std::min(opts.max_context, c.max_position) : c.max_position;
  const int per_seq = (e->max_context_ + opts.block_size - 1) / opts.block_size;
  Device& dev = model->device();
  ElemType kv_type = dev.compute_type();
  if (opts.kv_dtype == "fp32") {
    kv_type = ElemType::f32;
  } else if (opts.kv_dtype == "bf16") {
    if (dev.info().kind != "cuda")
      return make_error(Errc::unsupported,
                        fmt::format("KV_DTYPE=bf16 needs the CUDA device; this rank runs on {}, "
                                    "which keeps the KV cache in fp32 — set KV_DTYPE=auto",
                                    dev.info().name));
    kv_type = ElemType::bf16;
  } else if (opts.kv_dtype != "auto") {
    return make_error(Errc::unsupported,
                      fmt::format("KV_DTYPE={} is not supported by the native engine (auto, bf16 "
                                  "or fp32)",
                                  opts.kv_dtype));
  }
  const uint64_t per_block = KVCache::block_bytes(kv_type, c.num_layers, opts.block_size,
                                                  model->local_kv_heads(), c.head_dim);
  // The CPU keeps SLOTS full contexts (its memory is the guard's to watch); a GPU sizes
  // from what is free, because there an over-large cache fails at allocation.
  if (opts.kv_from_free_memory && opts.num_blocks <= 0 && dev.info().kind == "cuda") {
    auto avail = opts.kv_memory_available ? Result<uint64_t>(opts.kv_memory_available)
                                          : dev.available_bytes();
    if (!avail) return avail.error();
    const uint64_t share = static_cast<uint64_t>(std::max(opts.kv_memory_share, 1));
    const uint64_t budget = (*avail > opts.mem_reserve ? *avail - opts.mem_reserve : 0) / share;
    const uint64_t need = static_cast<uint64_t>(per_seq) * per_block;
    if (budget < need) {
      const uint64_t fits = budget / per_block * static_cast<uint64_t>(opts.block_size);
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
    const uint64_t fit = opts.kv_cache_bytes / per_block;
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
  auto cache = e->model_->make_kv_cache(opts.num_blocks, opts.block_size, kv_type);
  if (!cache) return cache.error();
  e->cache_ = std::move(*cache);
  const int prep_tokens = std::max(opts.max_batch_tokens, opts.slots);
  SPARK_TRY(e->model_->prepare(prep_tokens, opts.slots, e->max_context_, opts.block_size,
                               opts.cuda_graphs));
  e->blocks_ =
      std::make_unique<BlockManager>(opts.num_blocks, opts.block_size, opts.prefix_caching);
  if (e->comm_->world_size() > 1) {
    // The workers size their cache and step buffers as rank 0 does, and capture graphs
    // exactly when it does (the collectives inside must match step for step).
    int64_t sizes[kWorkerSizes] = {
        opts.num_blocks, opts.block_size, static_cast<int64_t>(kv_type), prep_tokens,
        opts.slots,      e->max_context_, opts.cuda_graphs ? 1 : 0};
    SPARK_TRY(e->comm_->broadcast(sizes, sizeof(sizes), 0));
  }
  e->stats_.slots = opts.slots;
  e->stats_.device = e->model_->device().info().name;
  e->stats_.kv_dtype = elem_name(kv_type);
  e->stats_.blocks_total = opts.num_blocks;
  e->stats_.blocks_available = opts.num_blocks;
  e->stats_.block_size = opts.block_size;
  e->stats_.prefix_caching = opts.prefix_caching;
  log::info(
      "engine", "{} on {}: {} slots, {} KV blocks of {} tokens ({} MiB {}), context {}, TP {}",
      c.architecture, e->model_->device().info().name, opts.slots, opts.num_blocks, opts.block_size,
      e->cache_->bytes() >> 20, elem_name(kv_type), e->max_context_, e->comm_->world_size());
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
  blocks_->release(seq->blocks);
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

void Engine::cancel_req(RequestId id, FinishReason why, const std::string& error) {
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return;
  Req& r = *it->second;
  for (size_t i = running_.size(); i-- > 0;)
    if (running_[i]->req == id) {
      blocks_->release(running_[i]->blocks);
      running_.erase(running_.begin() + static_cast<ptrdiff_t>(i));
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
  while (static_cast<int>(running_.size()) < opts_.slots && !waiting_.empty()) {
    Req& r = *reqs_.at(waiting_.front());
    auto s = std::make_unique<Seq>();
    s->req = r.id;
    s->choice = r.admitted;
    s->tokens = r.r.prompt;
    s->prompt_len = static_cast<int>(s->tokens.size());
    s->max_total = static_cast<int>(std::min<int64_t>(
        static_cast<int64_t>(s->prompt_len) + r.r.params.max_tokens, max_context_));
    // Reuse cached full blocks, but always compute at least the last prompt token.
    const int matched =
        blocks_->match_prefix(s->tokens, (s->prompt_len - 1) / bs, &s->blocks, &s->hashes);
    const int need = (s->max_total + bs - 1) / bs - matched;
    if (!blocks_->allocate(need, &s->blocks)) {
      blocks_->release(s->blocks);
      break;  // wait for running sequences to free blocks (submit() made sure it can ever fit)
    }
    blocks_->note_hits(matched);
    if (opts_.prefix_caching) {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.prefix_queries += static_cast<uint64_t>(s->prompt_len);
    }
    s->computed = s->cached = matched * bs;
    s->scheduled = std::chrono::steady_clock::now();
    s->sampler = std::make_unique<Sampler>(r.r.params, model_->config().vocab_size, r.r.prompt,
                                           static_cast<uint64_t>(s->choice));
    running_.push_back(std::move(s));
    if (++r.admitted == r.r.params.n) waiting_.pop_front();
  }
}

Status Engine::broadcast_plan(const std::vector<int32_t>& plan) {
  if (comm_->world_size() == 1) return Status::Ok();
  return send_plan(*comm_, plan.empty() ? kPlanHeartbeat : static_cast<int32_t>(plan.size()), plan);
}

Status Engine::step() {
  const int bs = opts_.block_size;
  // Every decoding sequence (one pending token) runs each step; the rest of the budget is
  // shared max-min fairly among the prompts being prefilled (shortest remainder first, each
  // taking at most an even share of what is left), so a long prompt cannot hold a short
  // one's first token for its whole prefill, and is never starved by short ones either.
  // The budget is at least the slot count, so prefill gets a token even with every other
  // slot decoding.
  auto pending_of = [&](size_t i) {
    return static_cast<int>(running_[i]->tokens.size()) - running_[i]->computed;
  };
  int budget = std::max(opts_.max_batch_tokens, opts_.slots);
  std::vector<int> take(running_.size(), 0);
  std::vector<size_t> prefilling;
  for (size_t i = 0; i < running_.size(); ++i) {
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
  std::vector<SeqChunk> chunks;
  std::vector<size_t> chunk_seq;
  std::vector<int32_t> plan = {0};
  for (size_t i = 0; i < running_.size(); ++i) {
    Seq& s = *running_[i];
    const int pending = pending_of(i);
    const int n = take[i];
    if (n <= 0) continue;
    SeqChunk ch{s.tokens.data() + s.computed, n, s.computed, s.blocks.data(), n == pending};
    chunks.push_back(ch);
    chunk_seq.push_back(i);
    plan.push_back(n);
    plan.push_back(ch.start_pos);
    plan.push_back(ch.want_logits ? 1 : 0);
    plan.push_back(static_cast<int32_t>(s.blocks.size()));
    plan.insert(plan.end(), ch.tokens, ch.tokens + n);
    plan.insert(plan.end(), s.blocks.begin(), s.blocks.end());
    ++plan[0];
  }
  if (chunks.empty()) return Status::Ok();
  SPARK_TRY(broadcast_plan(plan));
  // On a device that samples, draw there (one small copy back per step instead of the
  // logits). Rows with penalties send their token lists, from which the device builds the
  // state the host sampler keeps (prompt tokens seen, output tokens counted).
  std::vector<kernels::SampleResult> drawn;
  const bool on_device = model_->device().samples_on_device();
  std::vector<kernels::SampleParams> params;
  std::vector<Device::PenaltyHistory> history;
  if (on_device) {
    bool penalties = false;
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (!chunks[k].want_logits) continue;
      const Seq& s = *running_[chunk_seq[k]];
      const auto kp = s.sampler->next_params();
      Device::PenaltyHistory h;
      if (kp.repetition_penalty != 1.0f || kp.presence_penalty != 0.0f ||
          kp.frequency_penalty != 0.0f) {
        penalties = true;
        h.tokens = s.tokens.data();
        h.n = static_cast<int>(s.tokens.size());
        h.out_start = s.prompt_len;
      }
      params.push_back(kp);
      history.push_back(h);
    }
    if (!penalties) history.clear();
  }
  if (on_device)
    SPARK_TRY(model_->forward_sample(chunks, *cache_, *comm_, params, &drawn, history));
  else
    SPARK_TRY(model_->forward(chunks, *cache_, *comm_, &logits_));

  const auto& cfg = model_->config();
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  size_t row = 0;
  uint64_t prompt_done = 0, generated = 0;
  std::vector<std::pair<size_t, FinishReason>> done;
  for (size_t k = 0; k < chunks.size(); ++k) {
    Seq& s = *running_[chunk_seq[k]];
    const int before = s.computed;
    s.computed += chunks[k].n;
    if (before < s.prompt_len)
      prompt_done += static_cast<uint64_t>(std::min(s.computed, s.prompt_len) - before);
    // Register blocks that just became full and computed, for prefix reuse.
    while (static_cast<int>(s.hashes.size()) < s.computed / bs) {
      const int idx = static_cast<int>(s.hashes.size());
      const uint64_t h = blocks_->block_hash(s.tokens, idx, idx == 0 ? 0 : s.hashes.back());
      blocks_->register_block(s.blocks[static_cast<size_t>(idx)], h, s.tokens, idx);
      s.hashes.push_back(h);
    }
    if (!chunks[k].want_logits) continue;
    Sample smp;
    if (on_device) {
      const kernels::SampleResult& d = drawn[row++];
      smp.token = d.token;
      if (params[row - 1].logprobs) smp.logprob = d.logprob;
      for (int i = 0; i < d.n_top; ++i) smp.top.push_back({d.top_ids[i], d.top_logprobs[i]});
      s.sampler->record(d.token);
    } else {
      smp = s.sampler->sample(logits_.data() + row++ * V);
    }
    s.tokens.push_back(smp.token);
    ++s.generated;
    ++generated;
    Req& r = *reqs_.at(s.req);
    const auto& p = r.r.params;
    FinishReason why = FinishReason::none;
    const bool eos = !p.ignore_eos && std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(),
                                                smp.token) != cfg.eos_token_ids.end();
    if (eos || std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), smp.token) !=
                   p.stop_token_ids.end())
      why = FinishReason::stop;
    else if (static_cast<int>(s.tokens.size()) >= s.max_total)
      why = FinishReason::length;
    TokenEvent ev;
    ev.choice = s.choice;
    ev.token = smp.token;
    ev.logprob = smp.logprob;
    ev.top_logprobs = std::move(smp.top);
    ev.completion_tokens = s.generated;
    ev.cached_prompt_tokens = s.cached;
    ev.scheduled = s.scheduled;
    emit(r, std::move(ev));
    if (why != FinishReason::none) done.emplace_back(chunk_seq[k], why);
  }
  StepTrace trace;
  {
    std::lock_guard<std::mutex> lk(mu_);
    trace.step = ++stats_.steps;
    stats_.prompt_tokens += prompt_done;
    stats_.generated_tokens += generated;
  }
  if (opts_.on_step)
    for (size_t k = 0; k < chunks.size(); ++k) {
      const Seq& s = *running_[chunk_seq[k]];
      trace.chunks.push_back(
          {s.req, s.choice, chunks[k].n, std::max(0, s.prompt_len - s.computed)});
    }
  // Finish from the back so indices stay valid.
  std::sort(done.begin(), done.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [i, why] : done) finish_seq(i, why);
  if (opts_.on_step) opts_.on_step(trace);
  return Status::Ok();
}

void Engine::loop() {
  using clock = std::chrono::steady_clock;
  auto last_broadcast = clock::now();
  for (;;) {
    Inbox in;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      const bool idle = running_.empty() && waiting_.empty();
      if (idle && inbox_.submits.empty() && inbox_.cancels.empty() && !stopping_)
        cv_.wait_for(lk, std::chrono::milliseconds(opts_.heartbeat_ms));
      std::swap(in, inbox_);
      stop = stopping_;
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
    if (stop) break;
    admit();
    Status st = Status::Ok();
    if (!running_.empty()) {
      step_started_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
      st = step();
      step_started_ns_ = 0;
      last_broadcast = clock::now();
    } else if (comm_->world_size() > 1 &&
               clock::now() - last_broadcast >= std::chrono::milliseconds(opts_.heartbeat_ms)) {
      st = broadcast_plan(
          {});  // empty plan = heartbeat (kPlanHeartbeat): workers' waits have deadlines
      last_broadcast = clock::now();
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
      break;
    }
  }
  // Stopping: end everything still pending, release TP workers.
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
  if (comm_->world_size() > 1 && !stats().failed) {
    (void)send_plan(*comm_, kPlanStop, {});
  }
}

Status run_tp_worker(Model& model, Collective& comm) {
  int64_t sizes[kWorkerSizes] = {};
  SPARK_TRY(comm.broadcast(sizes, sizeof(sizes), 0));
  auto made = model.make_kv_cache(static_cast<int>(sizes[0]), static_cast<int>(sizes[1]),
                                  static_cast<ElemType>(sizes[2]));
  if (!made) return made.error();
  KVCache& cache = **made;
  SPARK_TRY(model.prepare(static_cast<int>(sizes[3]), static_cast<int>(sizes[4]),
                          static_cast<int>(sizes[5]), static_cast<int>(sizes[1]), sizes[6] != 0));
  log::info("engine", "TP worker rank {}: {} KV blocks of {} tokens", comm.rank(), sizes[0],
            sizes[1]);
  std::vector<int32_t> plan;
  for (;;) {
    int32_t n = 0;
    SPARK_TRY(recv_plan(comm, &n, &plan));
    if (n == kPlanStop) return Status::Ok();
    if (n == kPlanHeartbeat) continue;
    if (n < 0) return make_error(Errc::internal, fmt::format("TP worker: bad plan header {}", n));
    std::vector<SeqChunk> chunks;
    size_t at = 1;
    for (int32_t i = 0; i < plan[0]; ++i) {
      SeqChunk ch;
      ch.n = plan[at];
      ch.start_pos = plan[at + 1];
      ch.want_logits = plan[at + 2] != 0;
      const int nb = plan[at + 3];
      ch.tokens = plan.data() + at + 4;
      ch.block_table = plan.data() + at + 4 + ch.n;
      at += 4 + static_cast<size_t>(ch.n) + static_cast<size_t>(nb);
      if (at > plan.size()) return make_error(Errc::internal, "TP worker: truncated step plan");
      chunks.push_back(ch);
    }
    SPARK_TRY(model.forward(chunks, cache, comm, nullptr));
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
  GenerateRequest req{std::move(prompt), params, [sh](const TokenEvent& e) {
                        std::lock_guard<std::mutex> lk(sh->mu);
                        const size_t c = static_cast<size_t>(e.choice);
                        if (e.token >= 0) {
                          sh->res.tokens[c].push_back(e.token);
                          sh->res.logprobs[c].push_back(e.logprob);
                        }
                        if (e.choice == 0) sh->res.cached_prompt_tokens = e.cached_prompt_tokens;
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
