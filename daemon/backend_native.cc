// sparkd's `native` backend: our own engine (daemon/engine/) behind the daemon's Backend
// interface. start() loads this rank's slices of MODEL_PATH (NODE<i>_MODEL_PATH), joins the
// tensor-parallel mesh through the daemon's rendezvous (Runtime: Gloo over TCP, rank 0's
// store address handed out with ctx.share), and on rank 0 loads the tokenizer and chat
// format and serves the OpenAI API (daemon/api_routes.cc). SLOTS and CONTEXT_LEN size the
// engine. Readiness: the runtime is up (every slot's KV blocks allocated at start), and the
// daemon's probe runs a real greedy completion through probe().
#include "daemon/backend_native.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/api_routes.h"
#include "daemon/backend.h"
#include "daemon/engine/runtime.h"
#include "daemon/memory_guard.h"
#include "daemon/metrics.h"
#include "daemon/openai/structured.h"
#include "daemon/tokenizer/py_json.h"
#include "env/nccl_env.h"
#include "kernels/cuda_runtime.h"

namespace spark::daemon {

Result<engine::EngineOptions> engine_options_from(const RingConfig& cfg) {
  engine::EngineOptions o;
  o.slots = static_cast<int>(cfg.get_int("SLOTS"));
  o.max_context = static_cast<int>(cfg.get_int("CONTEXT_LEN"));
  if (o.slots < 1 || o.max_context < 1)
    return make_error(Errc::config, fmt::format("SLOTS ({}) and CONTEXT_LEN ({}) must be positive",
                                                o.slots, o.max_context));
  const int64_t chunk = cfg.get_int("PREFILL_CHUNK");  // the config check bounds it too
  if (chunk < 1 || chunk > (1 << 20))
    return make_error(Errc::config, fmt::format("PREFILL_CHUNK ({}) must be 1-{}: tokens one "
                                                "engine step computes",
                                                chunk, 1 << 20));
  o.max_batch_tokens = static_cast<int>(chunk);
  o.kv_cache_bytes =
      ~0ull;  // exactly SLOTS full contexts (num_blocks = slots * blocks per context)
  const std::string kv = cfg.get("KV_DTYPE");
  if (kv != "auto" && kv != "fp32" && kv != "bf16" && kv != "fp8")
    return make_error(Errc::unsupported,
                      fmt::format("KV_DTYPE={} is not available in the native engine, which keeps "
                                  "the KV cache in bf16 (GPU), fp32 or fp8 (e4m3) — set "
                                  "KV_DTYPE=auto, bf16, fp8 or fp32",
                                  kv));
  o.kv_dtype = kv;
  o.kv_from_free_memory = true;  // on a GPU: at most what is free after the weights
  o.mem_reserve = static_cast<uint64_t>(cfg.get_int("MEM_RESERVE"));
  return o;
}

namespace {
constexpr const char* kComp = "native";

// COLLECTIVE: nccl asks for it (and fails with the reason where it cannot be had); auto takes
// it for a ring of several ranks where this node has a GPU and libnccl, unless a node's
// fabric address is loopback (test rings whose ranks share one GPU, which NCCL refuses).
Result<bool> use_nccl(const RingConfig& cfg, int world) {
  const std::string mode = cfg.get("COLLECTIVE").empty() ? "auto" : cfg.get("COLLECTIVE");
  if (mode == "gloo" || (mode == "auto" && world < 2)) return false;
  auto gpus = kernels::cuda_device_count();
  auto lib = engine::nccl::load();
  if (mode == "nccl") {
    if (!gpus) return make_error(Errc::unsupported, "COLLECTIVE=nccl: " + gpus.error().message);
    if (!lib) return make_error(Errc::unsupported, "COLLECTIVE=nccl: " + lib.error().message);
    return true;
  }
  if (!gpus || !lib) {
    log::info(kComp, "COLLECTIVE=auto: Gloo on the CPU, because {}",
              !gpus ? gpus.error().message : lib.error().message);
    return false;
  }
  for (const auto& n : cfg.nodes)
    if (auto ip = parse_ipv4(n.fabric_ip); ip && (*ip >> 24) == 127) {
      log::info(kComp,
                "COLLECTIVE=auto: Gloo on the CPU, because {} has a loopback fabric "
                "address (ranks of one host sharing a GPU)",
                n.name);
      return false;
    }
  return true;
}

class NativeBackend final : public Backend {
 public:
  explicit NativeBackend(const RingConfig& cfg) : cfg_(cfg) {}
  ~NativeBackend() override { stop(std::chrono::milliseconds(0)); }

  const char* name() const override { return "native"; }

  Status start(BackendContext& ctx) override {
    const RingConfig& cfg = ctx.cfg ? *ctx.cfg : cfg_;
    const NodeConfig& node = cfg.nodes.at(static_cast<size_t>(ctx.place.node));
    std::string dir = node.model_path.empty() ? cfg.get("MODEL_PATH") : node.model_path;
    if (dir.empty())
      return make_error(Errc::config, "native engine: no model directory: set MODEL_PATH (or NODE" +
                                          std::to_string(ctx.place.node) +
                                          "_MODEL_PATH) to a Hugging Face model directory, e.g. "
                                          "one written by `sparkctl demo-model DIR`");
    std::error_code ec;
    if (!std::filesystem::is_regular_file(dir + "/config.json", ec))
      return make_error(Errc::not_found,
                        "native engine: " + dir + "/config.json not found (rank " +
                            std::to_string(ctx.place.rank) + ", node " + node.name +
                            "): MODEL_PATH must be a Hugging Face model directory; `sparkctl "
                            "demo-model " +
                            dir + "` writes a small demo one");
    auto eo = engine_options_from(cfg);
    if (!eo) return eo.error();
    // CONTEXT_LEN above what the model was trained for: set in the file or the environment,
    // an error naming both; the default, served at the model's maximum with a warning.
    if (auto mc = engine::load_model_config(dir); mc && eo->max_context > mc->max_position) {
      auto it = cfg.settings.find("CONTEXT_LEN");
      const bool set = it != cfg.settings.end() && it->second.source != "default";
      std::string what =
          fmt::format("CONTEXT_LEN {}{} is above the model's max_position_embeddings {} ({})",
                      eo->max_context, set ? fmt::format(" ({})", it->second.source) : " (default)",
                      mc->max_position, dir + "/config.json");
      if (set)
        return make_error(Errc::config,
                          fmt::format("{}: set CONTEXT_LEN={} or less", what, mc->max_position));
      log::warn(kComp, "{}: serving at most {} tokens per request", what, mc->max_position);
    }

    // Rank 0 needs the tokenizer and chat format; load them first so a broken tokenizer
    // fails before minutes of weight loading.
    std::shared_ptr<ApiModel> api;
    if (ctx.place.rank == 0) {
      api = std::make_shared<ApiModel>();
      auto t = tok::Tokenizer::from_file(dir + "/tokenizer.json");
      if (!t) return t.error();
      api->tokenizer = std::move(*t);
      auto tcfg = tok::load_tokenizer_config(dir);
      if (!tcfg) return tcfg.error();
      auto mc = engine::load_model_config(dir);
      if (!mc) return mc.error();
      tok::jinja::RenderLimits limits;
      limits.max_steps =
          static_cast<uint64_t>(std::max<int64_t>(1, cfg.get_int("TEMPLATE_MAX_STEPS")));
      limits.timeout =
          std::chrono::milliseconds(static_cast<int64_t>(cfg.get_duration_ms("TEMPLATE_TIMEOUT")));
      auto fmt = tok::choose_chat_format(cfg.get("CHAT_FORMAT"), *tcfg, mc->architecture,
                                         &api->tokenizer, limits);
      if (!fmt) return fmt.error();
      api->chat_format = *fmt;
      if (ctx.progress)
        ctx.progress(fmt::format("chat format {} (from {})", tok::chat_family_name(fmt->family),
                                 fmt->source));
      for (const auto& s : fmt->stop_tokens())
        if (auto id = api->tokenizer.token_to_id(s)) api->stop_token_ids.insert(*id);
      for (int id : mc->eos_token_ids) api->stop_token_ids.insert(id);
      // Ids the model cannot produce (a tokenizer larger than the embedding) never stop it.
      std::erase_if(api->stop_token_ids, [&](int32_t id) { return id >= mc->vocab_size; });
      if (api->tokenizer.byte_level_decoder()) {
        const std::vector<int32_t> ends(api->stop_token_ids.begin(), api->stop_token_ids.end());
        const auto limit = static_cast<size_t>(mc->vocab_size);
        if (fmt->family == tok::ChatFamily::harmony) {
          // A constrained final message ends at <|return|>, a forced call at <|call|>.
          auto only = [&](const char* name) {
            auto id = api->tokenizer.token_to_id(name);
            return id && *id < mc->vocab_size ? std::vector<int32_t>{*id} : ends;
          };
          api->token_trie =
              openai::make_token_trie(api->tokenizer, only("<|return|>"), limit, false, true);
          api->tool_token_trie =
              openai::make_token_trie(api->tokenizer, only("<|call|>"), limit, false, true);
        } else {
          api->token_trie = openai::make_token_trie(api->tokenizer, ends, limit);
          api->tool_token_trie = openai::make_token_trie(api->tokenizer, ends, limit, true);
        }
      }
      api->escape_special = cfg.get("CHAT_SPECIAL_TOKENS") != "allow";
      api->model = cfg.get("MODEL");
      if (api->model.empty()) api->model = std::filesystem::path(dir).filename().string();
      api->created = static_cast<int64_t>(std::time(nullptr));
      if (ctx.memory_guard) {
        MemoryGuard* g = ctx.memory_guard;
        api->admit = [g] { return g->admit(); };
        g->set_cancel_hook([st = api_](const std::string& why) { return st->cancel_newest(why); });
      }
      api->metrics = ctx.metrics;
      log::info(kComp, "tokenizer: {} tokens, chat format {} ({})", api->tokenizer.vocab_size(),
                tok::chat_family_name(fmt->family), fmt->source);
    }

    engine::RuntimeOptions o;
    o.model_dir = dir;
    o.rank = ctx.place.rank;
    o.world = ctx.world_size;
    o.bind_host = node.fabric_ip.empty() ? "127.0.0.1" : node.fabric_ip;
    o.store_host = cfg.nodes.at(0).fabric_ip.empty() ? o.bind_host : cfg.nodes.at(0).fabric_ip;
    o.share = ctx.share;
    o.progress = ctx.progress;
    o.engine = *eo;
    if (Metrics* m = ctx.metrics)  // tokens per step, as vLLM's iteration_tokens_total
      o.engine.on_step = [m](const engine::StepTrace& t) {
        int tokens = 0;
        for (const auto& c : t.chunks) tokens += c.tokens;
        m->observe("sparkd_iteration_tokens", tokens);
      };
    o.missing_ranks = ctx.missing_ranks;
    if (ctx.store_set && ctx.store_get)
      o.store = std::make_shared<engine::FunctionStore>(ctx.store_set, ctx.store_get);
    auto nccl = use_nccl(cfg, ctx.world_size);
    if (!nccl) return nccl.error();
    if (*nccl) {
      o.nccl = true;
      // A collective that waits past HEARTBEAT_TIMEOUT means a rank is gone: rank 0 is then
      // fatal within that time, and the request in flight fails with the reason.
      if (!cfg.get("HEARTBEAT_TIMEOUT").empty())
        o.nccl_options.op_timeout = std::chrono::milliseconds(
            std::max<uint64_t>(1000, cfg.get_duration_ms("HEARTBEAT_TIMEOUT")));
      if (!cfg.get("JOIN_TIMEOUT").empty())
        o.nccl_options.init_timeout =
            std::chrono::milliseconds(cfg.get_duration_ms("JOIN_TIMEOUT"));
      o.nccl_options.missing_ranks = ctx.missing_ranks;
      o.fabric.timeout = o.nccl_options.op_timeout;
      o.fabric_test = cfg.get("FABRIC_TEST").empty() || cfg.get_bool("FABRIC_TEST");
      auto floor = env::fabric_min_busbw(cfg);
      if (!floor) return floor.error();
      o.fabric_expect =
          engine::fabric_expect_from_env(ctx.place.rank, ctx.world_size, node.name, *floor);
      auto applied = env::apply_nccl_debug_env(ctx.log_dir, ctx.place.rank);
      o.nccl_debug_file = applied.debug_file;
      log::info(kComp, "rank {}: NCCL environment: {}", ctx.place.rank, applied.summary);
    }
    o.device = cfg.get("DEVICE");
    o.weights_placement = cfg.get("WEIGHTS_PLACEMENT");
    o.expert_parallel = cfg.get("EXPERT_PARALLEL");
    if (ctx.world_size > 1 && !ctx.share)
      return make_error(Errc::internal,
                        "native engine: a ring of " + std::to_string(ctx.world_size) +
                            " ranks without the daemon's rendezvous (no share function)");
    {
      std::lock_guard lk(mu_);
      loading_ = true;
    }
    o.cancel = &stopping_;
    // Sizes are checked against the checkpoint and MemAvailable before anything is
    // allocated; an allocation that fails anyway is a fatal state with its reason, never
    // an abort.
    Result<std::unique_ptr<engine::Runtime>> rt = make_error(Errc::internal, "not started");
    try {
      rt = engine::Runtime::start(std::move(o));
    } catch (const std::bad_alloc&) {
      rt = make_error(Errc::resource,
                      "out of memory while loading " + dir +
                          " (an allocation failed; check SLOTS, CONTEXT_LEN and free memory)");
    } catch (const std::length_error& e) {
      rt =
          make_error(Errc::resource, "allocation too large while loading " + dir + ": " + e.what());
    }
    std::lock_guard lk(mu_);
    loading_ = false;
    if (!rt) return rt.error();
    rt_ = std::move(*rt);
    if (api) {
      api->engine = rt_->engine();
      api->max_context = api->engine->max_context();
      api->limits.max_tokens_cap = api->max_context;
      api_->set(api);
      log::info(kComp, "serving {} on rank 0: {} slots, context {} tokens", api->model, eo->slots,
                api->max_context);
    }
    slots_ = eo->slots;
    metrics_ = ctx.metrics;
    return Status::Ok();
  }

  BackendStatus status() override {
    BackendStatus s;
    std::lock_guard lk(mu_);
    s.slots_total = slots_;
    if (!rt_) {
      s.reason = loading_ ? "loading the model" : "not started";
      return s;
    }
    auto r = rt_->status();
    if (const auto* f = rt_->fabric_report()) s.fabric = engine::to_json(*f);
    for (const auto& f : rt_->fabric_reports()) s.fabric_ranks.push_back(engine::to_json(f));
    s.device = r.device;
    s.device_note = r.device_fallback;
    s.model_info = r.model;
    s.ready = r.ready;
    s.fatal = r.fatal;
    s.reason = r.reason;
    if (rt_->engine()) {
      // The KV cache as the engine keeps it (KV_DTYPE resolved: bf16, fp32 or fp8).
      if (s.model_info.is_object())
        s.model_info["kv_cache"] = {{"dtype", r.stats.kv_dtype},
                                    {"block_size", r.stats.block_size},
                                    {"blocks", r.stats.blocks_total}};
      s.slots_total = r.stats.slots;
      s.slots_busy = r.stats.running;
      s.requests_waiting = r.stats.waiting;
      s.oldest_call = std::chrono::milliseconds(r.stats.step_running_ms);
      s.oldest_call_what = "forward step";
      if (metrics_) {
        const auto& st = r.stats;
        auto d = [](uint64_t v) { return static_cast<double>(v); };
        // vLLM counts every prompt token it prefills, prefix-cache hits included.
        metrics_->set("sparkd_prompt_tokens_total", d(st.prompt_tokens + st.cached_tokens));
        metrics_->set("sparkd_prompt_tokens_computed_total", d(st.prompt_tokens));
        metrics_->set("sparkd_generation_tokens_total", d(st.generated_tokens));
        metrics_->set("sparkd_prefix_cache_queries_total", d(st.prefix_queries));
        metrics_->set("sparkd_prefix_cache_hits_total", d(st.cached_tokens));
        if (st.blocks_total > 0) {
          metrics_->set("sparkd_kv_cache_usage_ratio",
                        1.0 - static_cast<double>(st.blocks_available) / st.blocks_total);
          metrics_->set("sparkd_cache_config_info", 1,
                        {{"block_size", std::to_string(st.block_size)},
                         {"cache_dtype", st.kv_dtype},
                         {"enable_prefix_caching", st.prefix_caching ? "True" : "False"},
                         {"num_gpu_blocks", std::to_string(st.blocks_total)}});
        }
      }
    }
    return s;
  }

  void stop(std::chrono::milliseconds) override {
    stopping_.store(true);  // a load in progress gives up at its next tensor
    std::unique_ptr<engine::Runtime> rt;
    {
      std::lock_guard lk(mu_);
      rt = std::move(rt_);
    }
    api_->set(nullptr);
    if (aborter_.joinable()) aborter_.join();
    if (rt) {
      rt->abort_collectives("sparkd is stopping");
      rt->stop();
    }
  }

  void on_ring_problem(const std::string& why) override {
    // ncclCommAbort can take a while (it joins NCCL's threads): never on the caller's thread,
    // which is the daemon's reactor. Once per engine.
    std::lock_guard lk(mu_);
    if (!rt_ || aborting_) return;
    aborting_ = true;
    aborter_ = std::thread([rt = rt_.get(), why] { rt->abort_collectives(why); });
  }

  Result<std::string> probe(const std::string& prompt, std::chrono::milliseconds timeout) override {
    auto m = api_->get();
    if (!m || !m->engine)
      return make_error(Errc::precondition, "native engine: the model is not loaded");
    std::vector<int32_t> ids = m->tokenizer.encode(prompt, true);
    if (ids.empty())
      return make_error(Errc::internal, "native engine: the probe prompt encodes to no tokens");
    engine::SamplingParams p;
    p.temperature = 0;
    p.max_tokens = 8;
    p.ignore_eos = true;  // a few real tokens whatever the weights say
    auto r = engine::generate_blocking(*m->engine, ids, p, static_cast<int>(timeout.count()));
    if (!r) return r.error();
    if (r->tokens.empty() || r->tokens[0].empty())
      return make_error(Errc::internal,
                        "native engine: the probe completion produced no tokens (finish " +
                            std::string(engine::finish_reason_name(
                                r->finish.empty() ? engine::FinishReason::error : r->finish[0])) +
                            ")");
    std::string text = m->tokenizer.decode(r->tokens[0], false);
    if (trim(text).empty()) {
      // Random weights may pick whitespace: the tokens are still a real completion.
      text = "[" + std::to_string(r->tokens[0].size()) + " tokens:";
      for (auto id : r->tokens[0]) text += " " + std::to_string(id);
      text += "]";
    }
    return text;
  }

  void add_routes(HttpServer& server) override { add_api_routes(server, api_); }

 private:
  RingConfig cfg_;
  std::shared_ptr<ApiState> api_ = std::make_shared<ApiState>();
  std::mutex mu_;
  std::unique_ptr<engine::Runtime> rt_;
  bool loading_ = false;
  bool aborting_ = false;
  std::thread aborter_;  // aborts the collectives off the reactor (on_ring_problem)
  std::atomic<bool> stopping_{false};
  int slots_ = 0;
  Metrics* metrics_ = nullptr;
};
}  // namespace

std::unique_ptr<Backend> make_native_backend(const RingConfig& cfg, int /*rank*/) {
  return std::make_unique<NativeBackend>(cfg);
}

}  // namespace spark::daemon
