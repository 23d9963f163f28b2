#pragma once
// Tensor parallelism in one process for tests: W ranks as W threads, each with its own
// device (a fresh CPU device, or its own CUDA device object and stream on a shared GPU) and
// a Gloo mesh over loopback, running the same forward steps in lock-step as the engine's
// workers do. Rank 0's logits come back per step, so a test compares them with TP=1 and
// with the CPU reference at every position (a two-process run only sees sampled tokens).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/model.h"
#include "daemon/engine/tcp_store.h"
#include "support/gloo.h"

namespace spark::test {

struct TpRun {
  std::vector<std::vector<float>> logits;  // per step: rank 0's logits (rows x vocab)
  std::string error;                       // the first rank's failure, "" when all passed
  uint64_t bytes_read_rank0 = 0;
  /// Per step: the smallest router margin (last chosen minus first unchosen expert's score,
  /// Model::router_margins) on rank 0 in this step or any before it; +inf on a dense model.
  std::vector<double> router_margin_upto;
};

/// Steps: each a list of sequences' chunks for one forward call; prompts prefill in step 0.
struct TpSeq {
  std::vector<int32_t> tokens;  // prompt + teacher-forced continuation
  int prompt = 0;               // tokens of the prompt (prefilled in step 0)
};

/// Runs every sequence of `seqs` together: one prefill step over all prompts, then one
/// decode step per remaining token (all sequences in each step, so steps have several logit
/// rows). `make_device` gives rank r its device; `stage` wraps the Gloo mesh for GPU ranks
/// (HostStagedCollective) when set; `placement` is EXPERT_PARALLEL for an MoE model.
inline TpRun run_tp_threads(
    const std::string& dir, int world, const std::vector<TpSeq>& seqs,
    const std::function<Result<std::shared_ptr<engine::Device>>(int)>& make_device,
    const std::function<std::shared_ptr<engine::Collective>(std::shared_ptr<engine::Collective>)>&
        stage = {},
    plan::MoeSplit placement = plan::MoeSplit::automatic) {
  using namespace engine;
  TpRun out;
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  REQUIRE_MESSAGE(srv.ok(), (srv.ok() ? std::string() : srv.error().message));
  const int port = (*srv)->port();
  std::vector<std::string> errors(static_cast<size_t>(world));
  auto body = [&](int r) -> Status {
    LoadReport rep;
    rep.expert_placement = placement;
    auto dev = make_device(r);  // no REQUIRE on these threads: failures come back as Status
    if (!dev) return dev.error();
    auto m = Model::load(dir, r, world, *dev, &rep);
    if (!m) return m.error();
    if (r == 0) out.bytes_read_rank0 = rep.bytes_read;
    std::shared_ptr<Collective> comm;
    if (world == 1) {
      comm = std::make_shared<LocalCollective>();
    } else {
      auto c = GlooCollective::connect(loopback_gloo(r, world, port, 30000));
      if (!c) return c.error();
      comm = *c;
      if (stage) comm = stage(comm);
    }
    const int bs = 8;
    int longest = 0;
    for (const auto& s : seqs) longest = std::max(longest, static_cast<int>(s.tokens.size()));
    const int per = (longest + bs - 1) / bs;
    auto cache =
        (*m)->make_kv_cache(per * static_cast<int>(seqs.size()), bs, (*m)->device().compute_type());
    if (!cache) return cache.error();
    const bool margins = r == 0 && (*m)->config().is_moe();
    (*m)->record_router_margins(margins);
    double margin_upto = INFINITY;
    std::vector<std::vector<int32_t>> tables(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int b = 0; b < per; ++b)  // interleaved blocks: tables are not trivially contiguous
        tables[i].push_back(b * static_cast<int>(seqs.size()) + static_cast<int>(i));
    size_t steps = 1;
    for (const auto& s : seqs) steps = std::max(steps, s.tokens.size() - s.prompt + 1);
    for (size_t st = 0; st < steps; ++st) {
      std::vector<SeqChunk> chunks;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const auto& s = seqs[i];
        if (st == 0) {
          chunks.push_back({s.tokens.data(), s.prompt, 0, tables[i].data(), true});
        } else {
          const int pos = s.prompt + static_cast<int>(st) - 1;
          if (pos >= static_cast<int>(s.tokens.size())) continue;
          chunks.push_back({s.tokens.data() + pos, 1, pos, tables[i].data(), true});
        }
      }
      std::vector<float> lg;
      SPARK_TRY((*m)->forward(chunks, **cache, *comm, r == 0 ? &lg : nullptr));
      if (r == 0) {
        out.logits.push_back(std::move(lg));
        for (const auto& mg : (*m)->router_margins())
          margin_upto =
              std::min(margin_upto, static_cast<double>(mg.last_chosen - mg.first_unchosen));
        out.router_margin_upto.push_back(margin_upto);
      }
    }
    return comm->barrier();
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      Status st = body(r);
      if (!st.ok()) errors[static_cast<size_t>(r)] = st.message();
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r)
    if (!errors[static_cast<size_t>(r)].empty() && out.error.empty())
      out.error = "rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)];
  return out;
}

/// Largest |a - b| over two runs' logits (same steps and shapes; a mismatch fails the test).
inline double max_logit_diff(const TpRun& a, const TpRun& b) {
  REQUIRE(a.logits.size() == b.logits.size());
  double worst = 0;
  for (size_t s = 0; s < a.logits.size(); ++s) {
    REQUIRE(a.logits[s].size() == b.logits[s].size());
    for (size_t i = 0; i < a.logits[s].size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(a.logits[s][i] - b.logits[s][i])));
  }
  return worst;
}

/// The same, but a step over `bound` after a router near-tie (either run's smallest margin
/// so far below `tie`) is counted in *excused instead: there a bf16 rounding may choose the
/// other expert, and the logits then differ by more than rounding. Returns the largest
/// difference of the steps not excused.
inline double max_logit_diff_beyond_ties(const TpRun& a, const TpRun& b, double bound, double tie,
                                         int* excused) {
  REQUIRE(a.logits.size() == b.logits.size());
  REQUIRE(a.router_margin_upto.size() == a.logits.size());
  REQUIRE(b.router_margin_upto.size() == b.logits.size());
  double worst = 0;
  *excused = 0;
  for (size_t s = 0; s < a.logits.size(); ++s) {
    REQUIRE(a.logits[s].size() == b.logits[s].size());
    double d = 0;
    for (size_t i = 0; i < a.logits[s].size(); ++i)
      d = std::max(d, static_cast<double>(std::abs(a.logits[s][i] - b.logits[s][i])));
    if (d > bound && std::min(a.router_margin_upto[s], b.router_margin_upto[s]) < tie) {
      ++*excused;
      continue;
    }
    worst = std::max(worst, d);
  }
  return worst;
}

}  // namespace spark::test
