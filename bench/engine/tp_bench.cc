#include "bench/engine/tp_bench.h"

#include <fmt/format.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/strings.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/tcp_store.h"

namespace spark::engine {

namespace {

using clock_t_ = std::chrono::steady_clock;

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

std::vector<int32_t> prompt_of(int salt, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < 8; ++i) p.push_back((i * 131 + salt * 977 + 7) % (vocab - 3) + 3);
  return p;
}

Result<std::shared_ptr<Collective>> connect(int port, int rank, int world) {
  GlooOptions g;
  g.rank = rank;
  g.world = world;
  g.store_port = port;
  g.timeout_ms = 60000;
  auto c = GlooCollective::connect(g);
  if (!c) return c.error();
  return std::shared_ptr<Collective>(*c);
}

// The engine with its control plane: per-step decode time of each round (ms), and what
// rank 1's control plane counted.
Result<std::vector<double>> engine_mode(const std::string& dir, int W, int batch, int tokens,
                                        int rounds, bool overlap, TpWorkerStats* rank1) {
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  if (!srv) return srv.error();
  const int port = (*srv)->port();
  std::vector<std::string> errors(static_cast<size_t>(W));
  std::vector<double> per_round;
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      auto fail = [&](const Error& e) { errors[static_cast<size_t>(r)] = e.message; };
      auto m = Model::load(dir, r, W);
      if (!m) return fail(m.error());
      auto c = connect(port, r, W);
      if (!c) return fail(c.error());
      if (r > 0) {
        TpWorkerOptions wo;
        if (r == 1) wo.stats = rank1;
        if (Status st = run_tp_worker(**m, **c, wo); !st.ok()) fail(st.error());
        return;
      }
      EngineOptions o;
      o.overlap_plan = overlap;
      o.slots = batch;
      o.prefix_caching = false;
      auto eng = Engine::start(std::move(*m), *c, o);
      if (!eng) return fail(eng.error());
      const int V = (*eng)->config().vocab_size;
      for (int round = 0; round < rounds; ++round) {
        struct Shared {
          std::mutex mu;
          std::condition_variable cv;
          int done = 0;
          std::vector<clock_t_::time_point> stamps;  // request 0's tokens
        } sh;
        for (int b = 0; b < batch; ++b) {
          SamplingParams p;
          p.temperature = 0;
          p.max_tokens = tokens + 1;  // the prefill's token, then `tokens` decode steps
          p.ignore_eos = true;
          auto id =
              (*eng)->submit({prompt_of(round * batch + b, V), p, [&sh, b](const TokenEvent& e) {
                                std::lock_guard<std::mutex> lk(sh.mu);
                                if (b == 0 && e.token >= 0) sh.stamps.push_back(clock_t_::now());
                                if (e.request_done) {
                                  ++sh.done;
                                  sh.cv.notify_all();
                                }
                              }});
          if (!id) return fail(id.error());
        }
        std::unique_lock<std::mutex> lk(sh.mu);
        sh.cv.wait(lk, [&] { return sh.done == batch; });
        if (sh.stamps.size() != static_cast<size_t>(tokens + 1))
          return fail(
              make_error(Errc::internal, fmt::format("request 0 produced {} tokens, expected {}",
                                                     sh.stamps.size(), tokens + 1)));
        for (size_t k = 1; k < sh.stamps.size(); ++k)
          per_round.push_back(
              std::chrono::duration<double, std::milli>(sh.stamps[k] - sh.stamps[k - 1]).count());
      }
      (*eng)->stop();
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r)
    if (!errors[static_cast<size_t>(r)].empty())
      return make_error(Errc::internal,
                        fmt::format("engine mode, rank {}: {}", r, errors[static_cast<size_t>(r)]));
  return per_round;
}

// The peer without a control plane: every rank runs the known steps itself.
Result<std::vector<double>> lockstep_mode(const std::string& dir, int W, int batch, int tokens,
                                          int rounds) {
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  if (!srv) return srv.error();
  const int port = (*srv)->port();
  std::vector<std::string> errors(static_cast<size_t>(W));
  std::vector<double> per_round;
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      auto fail = [&](const Error& e) { errors[static_cast<size_t>(r)] = e.message; };
      auto m = Model::load(dir, r, W);
      if (!m) return fail(m.error());
      auto c = connect(port, r, W);
      if (!c) return fail(c.error());
      Model& model = **m;
      const int V = model.config().vocab_size, bs = 16;
      const int per = (8 + tokens + bs) / bs + 1;
      auto cache = model.make_kv_cache(per * batch, bs, ElemType::f32);
      if (!cache) return fail(cache.error());
      if (Status st = model.prepare(std::max(256, batch), batch, per * bs, bs, false); !st.ok())
        return fail(st.error());
      std::vector<std::vector<int32_t>> tables(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b)
        for (int k = 0; k < per; ++k) tables[static_cast<size_t>(b)].push_back(b * per + k);
      std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(batch));
      for (int round = 0; round < rounds; ++round) {
        std::vector<SeqChunk> pre;
        for (int b = 0; b < batch; ++b) {
          seqs[static_cast<size_t>(b)] = prompt_of(round * batch + b, V);
          seqs[static_cast<size_t>(b)].reserve(static_cast<size_t>(8 + tokens + 1));
          pre.push_back({seqs[static_cast<size_t>(b)].data(), 8, 0,
                         tables[static_cast<size_t>(b)].data(), true});
        }
        std::vector<float> lg;
        if (Status st = model.forward(pre, **cache, **c, r == 0 ? &lg : nullptr); !st.ok())
          return fail(st.error());
        for (int s = 0; s < tokens; ++s) {
          const auto t0 = clock_t_::now();
          std::vector<SeqChunk> step;
          for (int b = 0; b < batch; ++b) {
            auto& q = seqs[static_cast<size_t>(b)];
            q.push_back(static_cast<int32_t>((s * 31 + b * 7 + 3) % V));
            step.push_back({&q.back(), 1, static_cast<int>(q.size()) - 1,
                            tables[static_cast<size_t>(b)].data(), true});
          }
          if (Status st = model.forward(step, **cache, **c, r == 0 ? &lg : nullptr); !st.ok())
            return fail(st.error());
          if (r == 0)  // the engine's greedy draw, so both sides do the same host work
            for (int b = 0; b < batch; ++b) {
              const float* row = lg.data() + static_cast<size_t>(b) * static_cast<size_t>(V);
              volatile auto best = std::max_element(row, row + V) - row;
              (void)best;
            }
          if (r == 0)
            per_round.push_back(
                std::chrono::duration<double, std::milli>(clock_t_::now() - t0).count());
        }
      }
      (void)(*c)->barrier();
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r)
    if (!errors[static_cast<size_t>(r)].empty())
      return make_error(Errc::internal, fmt::format("lock-step mode, rank {}: {}", r,
                                                    errors[static_cast<size_t>(r)]));
  return per_round;
}

}  // namespace

Result<int> run_tp_bench(const std::map<std::string, std::string>& opts) {
  auto num = [&](const char* k, int def) -> Result<int> {
    auto it = opts.find(k);
    if (it == opts.end()) return def;
    auto v = parse_i64(it->second);
    if (!v || *v < 1)
      return make_error(Errc::usage,
                        fmt::format("--{} must be a positive integer, not {}", k, it->second));
    return static_cast<int>(*v);
  };
  auto W = num("tp-size", 2), H = num("hidden", 512), L = num("layers", 8), V = num("vocab", 8192),
       B = num("batch", 1), T = num("tokens", 64), R = num("rounds", 3),
       threads = num("threads", 1);
  for (auto* x : {&W, &H, &L, &V, &B, &T, &R, &threads})
    if (!*x) return x->error();
  set_blas_threads(*threads);
  char tmpl[] = "/tmp/spark-tp-bench-XXXXXX";
  if (!::mkdtemp(tmpl)) return make_error(Errc::io, "mkdtemp failed");
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } cleanup{tmpl};
  auto cfg = small_config(Family::llama, *V, *H, *L);
  cfg.num_heads = 8;
  cfg.num_kv_heads = 8;
  cfg.head_dim = *H / 8;
  cfg.eos_token_ids = {};
  cfg.max_position = 4096;
  const std::string dir = cleanup.path + "/model";
  SPARK_TRY(write_random_checkpoint(dir, {cfg, DType::bf16, 7, 2}));
  TpWorkerStats ws_overlap, ws_lock;
  auto eng = engine_mode(dir, *W, *B, *T, *R, true, &ws_overlap);
  if (!eng) return eng.error();
  auto eng_lock = engine_mode(dir, *W, *B, *T, *R, false, &ws_lock);
  if (!eng_lock) return eng_lock.error();
  auto lock = lockstep_mode(dir, *W, *B, *T, *R);
  if (!lock) return lock.error();
  // The benchmark checks its own premise: the overlapped plans were posted ahead.
  if (ws_overlap.plans_ahead != ws_overlap.plans || ws_lock.plans_ahead != 0)
    return make_error(Errc::internal,
                      fmt::format("tpbench: rank 1 saw {} of {} overlapped plans posted ahead and "
                                  "{} lock-step ones",
                                  ws_overlap.plans_ahead, ws_overlap.plans, ws_lock.plans_ahead));
  const double e = quantile(*eng, 0.5), l = quantile(*lock, 0.5), el = quantile(*eng_lock, 0.5);
  const double e10 = quantile(*eng, 0.1), l10 = quantile(*lock, 0.1),
               el10 = quantile(*eng_lock, 0.1);
  auto share = [](uint64_t part, uint64_t whole) {
    return whole ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  nlohmann::json j = {
      {"bench", "tp_control_plane"},
      {"model", fmt::format("llama random, hidden {}, {} layers, vocab {}", *H, *L, *V)},
      {"tp", *W},
      {"batch", *B},
      {"decode_steps", *T},
      {"rounds", *R},
      {"blas_threads", *threads},
      {"engine_step_ms", e},
      {"engine_lockstep_plan_step_ms", el},
      {"lockstep_step_ms", l},
      {"engine_step_p10_ms", e10},
      {"engine_lockstep_plan_step_p10_ms", el10},
      {"lockstep_step_p10_ms", l10},
      {"control_plane_ms", e - l},
      {"control_plane_share", l > 0 ? (e - l) / e : 0},
      {"lockstep_plan_control_plane_ms", el - l},
      {"rank1_decode_steps", ws_overlap.decode_steps},
      {"rank1_decode_plans_ready_share",
       share(ws_overlap.decode_plans_ready, ws_overlap.decode_steps)},
      {"rank1_lockstep_plan_decode_plans_ready_share",
       share(ws_lock.decode_plans_ready, ws_lock.decode_steps)},
      {"plans", ws_overlap.plans},
      {"bare_plans", ws_overlap.bare_plans},
      {"bare_plan_bytes", kPlanHeaderBytes},
      {"plan_bytes_mean", share(ws_overlap.plan_bytes, ws_overlap.plans)}};
  if (opts.count("json")) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "# TP control plane, CPU path: {} ranks (threads, Gloo over loopback), {}, batch {}, {} "
      "decode steps x {} rounds, per-step median\n",
      *W, j["model"].get<std::string>(), *B, *T, *R);
  std::cout << fmt::format("{:<38} {:>10} {:>10} {:>10} {:>12}\n", "mode", "step_ms", "p10_ms",
                           "tok_s", "plan_ready");
  std::cout << fmt::format("{:<38} {:>10.3f} {:>10.3f} {:>10.1f} {:>11.0f}%\n",
                           "engine, plan overlapped", e, e10, *B * 1000.0 / e,
                           100 * share(ws_overlap.decode_plans_ready, ws_overlap.decode_steps));
  std::cout << fmt::format("{:<38} {:>10.3f} {:>10.3f} {:>10.1f} {:>11.0f}%\n",
                           "engine, plan after each step", el, el10, *B * 1000.0 / el,
                           100 * share(ws_lock.decode_plans_ready, ws_lock.decode_steps));
  std::cout << fmt::format("{:<38} {:>10.3f} {:>10.3f} {:>10.1f} {:>12}\n",
                           "lock-step (no control plane)", l, l10, *B * 1000.0 / l, "-");
  std::cout << fmt::format(
      "# control plane + scheduler: {:+.3f} ms per step overlapped, {:+.3f} ms with the plan "
      "after each step; plan_ready: rank 1's decode steps whose plan had already arrived; {} of "
      "{} plans had nothing new ({} bytes each)\n",
      e - l, el - l, ws_overlap.bare_plans, ws_overlap.plans, kPlanHeaderBytes);
  std::cout << j.dump() << "\n";
  return 0;
}

}  // namespace spark::engine
