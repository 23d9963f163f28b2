// Mixture-of-experts on the CPU: experts split tensor-parallel and expert-parallel over 2 and
// 4 ranks (Gloo over loopback, one thread a rank) give one rank's logits at every position
// of two sequences; the shard plan's choice and its reasons; the config fields the engine
// refuses; the multi-token-prediction layer left unread. The families' arithmetic against
// an independent implementation is in engine_model_test.cc, against transformers in
// engine_reference_test.cc (fixtures of every MoE family).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_cache.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "env/model_files.h"
#include "env/plan.h"
#include "support/tempdir.h"
#include "support/tp_threads.h"

using namespace spark;
using namespace spark::engine;

namespace {

// 8 heads and 4 KV heads (TP 1, 2 and 4 divide them), 8 experts of width 32; GLM's of width
// 30 with a shared expert as wide, which 4 ranks do not split: auto goes expert-parallel there
// and rank 0 holds the shared expert whole.
ModelConfig moe_config(Family f) {
  auto c = small_config(f, 384, 64, 3);
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 16;
  c.rotary_dim = f == Family::glm4_moe || f == Family::minimax_m2 ? 8 : 16;
  c.eos_token_ids = {};
  if (f == Family::glm4_moe) c.moe.expert_inter = c.moe.shared_inter = 30;
  return c;
}

std::vector<test::TpSeq> seqs() {
  std::vector<int32_t> a = {1, 17, 99, 250, 3, 77, 310, 12, 5, 300, 301, 17, 18, 19, 20};
  std::vector<int32_t> b = {1, 9, 8, 7, 6, 5, 4, 3, 2, 100, 200, 90, 91, 92};
  for (int i = 0; i < 12; ++i) {
    a.push_back(static_cast<int32_t>((i * 37 + 11) % 384));
    b.push_back(static_cast<int32_t>((i * 53 + 5) % 384));
  }
  return {{a, 9}, {b, 6}};
}

Result<std::shared_ptr<Device>> cpu(int) {
  return make_cpu_device();
}

}  // namespace

TEST_CASE(
    "moe: experts tensor-parallel and expert-parallel at 2 and 4 ranks give one rank's logits") {
  test::TempDir tmp;
  for (Family f : {Family::qwen3_moe, Family::mixtral, Family::glm4_moe, Family::minimax_m2}) {
    const std::string name = architecture_name(f);
    CAPTURE(name);
    const std::string dir = tmp / name;
    REQUIRE(write_random_checkpoint(dir, {moe_config(f), DType::f32, 11, 2}).ok());
    auto one = test::run_tp_threads(dir, 1, seqs(), cpu);
    REQUIRE_MESSAGE(one.error.empty(), one.error);
    for (auto split : {plan::MoeSplit::automatic, plan::MoeSplit::expert})
      for (int w : {2, 4}) {
        CAPTURE(w);
        CAPTURE(plan::moe_split_name(split));
        auto tp = test::run_tp_threads(dir, w, seqs(), cpu, {}, split);
        REQUIRE_MESSAGE(tp.error.empty(), tp.error);
        const double d = test::max_logit_diff(one, tp);
        MESSAGE(name << " " << std::string(plan::moe_split_name(split)) << " x" << w
                     << ": max |logit diff| " << d);
        CHECK(d < 2e-4);
        // Each rank reads only its share: every expert's slice (tp) or its experts (ep).
        CHECK(tp.bytes_read_rank0 < one.bytes_read_rank0);
      }
  }
}

TEST_CASE("moe: the shard plan splits experts as EXPERT_PARALLEL says, with its reason") {
  auto c = moe_config(Family::glm4_moe);  // 8 experts of width 30, a shared expert of 30
  PlanOptions o;
  o.world = 2;
  o.rank = 1;
  auto p = make_shard_plan(c, o, "m");
  REQUIRE(p.ok());
  CHECK(p->placement == plan::MoeSplit::tensor);  // 30 / 2: equal shares
  CHECK(p->expert_inter == 15);
  CHECK(p->experts == 8);
  CHECK(p->shared_inter == 15);
  CHECK(p->placement_reason.find("equal shares") != std::string::npos);
  o.world = 4;
  o.rank = 3;
  auto e = make_shard_plan(c, o, "m");
  REQUIRE_MESSAGE(e.ok(), (e.ok() ? "" : e.error().message));
  CHECK(e->placement == plan::MoeSplit::expert);  // 30 does not split 4 ways
  CHECK(e->expert0 == 6);
  CHECK(e->experts == 2);
  CHECK(e->expert_inter == 30);
  CHECK(e->shared_inter == 0);  // rank 0 holds the shared expert whole
  CHECK(e->placement_reason.find("whole experts") != std::string::npos);
  o.rank = 0;
  CHECK(make_shard_plan(c, o, "m")->shared_inter == 30);
  o.placement = plan::MoeSplit::tensor;
  auto bad = make_shard_plan(c, o, "m");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("EXPERT_PARALLEL=tp") != std::string::npos);
  CHECK(bad.error().message.find("30") != std::string::npos);
  // Expert-parallel over more ranks than experts leaves one empty: refused.
  c.moe.experts = 2;
  c.moe.n_group = 1, c.moe.topk_group = 1;
  c.moe.top_k = 1;
  o.placement = plan::MoeSplit::expert;
  auto empty = make_shard_plan(c, o, "m");
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.error().message.find("without any") != std::string::npos);
  // The same rule as `sparkctl plan` (core/model_plan.h).
  CHECK(plan::experts_split_evenly(1408, 4, 1));
  CHECK_FALSE(plan::experts_split_evenly(1408, 4, 128));  // 352 is not whole 128-blocks
  CHECK(plan::experts_split_evenly(768, 2, 128));
  CHECK_FALSE(plan::experts_split_evenly(2880, 4, 32));  // gpt-oss at 4 ranks
  CHECK(plan::experts_split_evenly(32, 1, 128));         // one rank cuts no block
}

TEST_CASE("moe: config fields that change the arithmetic and are not implemented are refused") {
  const std::string base =
      R"("vocab_size":64,"hidden_size":16,"intermediate_size":32,)"
      R"("num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,)";
  struct Case {
    const char* json;
    const char* needle;
  } cases[] = {
      {R"({"architectures":["Qwen3MoeForCausalLM"],)"
       "%s"
       R"("num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":8,"shared_expert_intermediate_size":16})",
       "shared_expert_intermediate_size"},
      {R"({"architectures":["Qwen3MoeForCausalLM"],)"
       "%s"
       R"("num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":8,"use_sliding_window":true})",
       "use_sliding_window"},
      {R"({"architectures":["Glm4MoeForCausalLM"],)"
       "%s"
       R"("n_routed_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":8,"topk_method":"greedy"})",
       "topk_method"},
      {R"({"architectures":["Glm4MoeForCausalLM"],)"
       "%s"
       R"("n_routed_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":8,"scoring_func":"softmax"})",
       "scoring_func"},
      {R"({"architectures":["MiniMaxM2ForCausalLM"],)"
       "%s"
       R"("num_local_experts":4,"num_experts_per_tok":2,"qk_norm_type":"per_head"})",
       "qk_norm_type"},
      {R"({"architectures":["MiniMaxM2ForCausalLM"],)"
       "%s"
       R"("num_local_experts":4,"num_experts_per_tok":2,"attn_type_list":[1,0]})",
       "attn_type_list"},
      {R"({"architectures":["MixtralForCausalLM"],)"
       "%s"
       R"("num_local_experts":4,"num_experts_per_tok":2,"layer_types":["full_attention","sliding_attention"]})",
       "layer_types"},
      {R"({"architectures":["MixtralForCausalLM"],)"
       "%s"
       R"("num_local_experts":4,"num_experts_per_tok":2,"mlp_bias":true})",
       "mlp_bias"},
  };
  for (const auto& cs : cases) {
    std::string text = cs.json;
    text.replace(text.find("%s"), 2, base);
    CAPTURE(text);
    auto r = parse_model_config(text, "/m/config.json");
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code == Errc::unsupported);
    CHECK(r.error().message.find(cs.needle) != std::string::npos);
    CHECK(r.error().message.find("/m/config.json") != std::string::npos);
  }
  auto arch = parse_model_config(R"({"architectures":["DbrxForCausalLM"],"vocab_size":10})", "c");
  REQUIRE_FALSE(arch.ok());
  for (const char* a : {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
                        "MiniMaxM2ForCausalLM", "LlamaForCausalLM"})
    CHECK(arch.error().message.find(a) != std::string::npos);
  // Groups that do not divide the experts, and top-k beyond the groups kept.
  auto g = parse_model_config(
      R"({"architectures":["Glm4MoeForCausalLM"],)" + base +
          R"("n_routed_experts":6,"num_experts_per_tok":2,"moe_intermediate_size":8,"n_group":4})",
      "c");
  REQUIRE_FALSE(g.ok());
  CHECK(g.error().message.find("n_group") != std::string::npos);
}

TEST_CASE("moe: the multi-token-prediction layer in the files is left unread and reported") {
  test::TempDir tmp;
  auto c = moe_config(Family::glm4_moe);
  REQUIRE(write_random_checkpoint(tmp / "m", {c, DType::f32, 3, 1}).ok());
  // The checkpoint with one more layer in its files than num_hidden_layers says: what GLM-4.5
  // ships (num_nextn_predict_layers = 1).
  auto text = read_file(tmp / "m/config.json");
  REQUIRE(text);
  auto j = nlohmann::json::parse(*text);
  j["num_hidden_layers"] = c.num_layers - 1;
  j["num_nextn_predict_layers"] = 1;
  std::string why;
  REQUIRE(write_file_atomic(tmp / "m/config.json", j.dump(), &why));
  LoadReport rep;
  auto m = Model::load(tmp / "m", 0, 1, make_cpu_device(), &rep);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? "" : m.error().message));
  CHECK(rep.skipped_prefixes == std::vector<std::string>{"model.layers.2."});
  CHECK_FALSE(rep.skipped_tensors.empty());
  for (const auto& t : rep.skipped_tensors) CHECK(starts_with(t, "model.layers.2."));
  const auto d = (*m)->describe();
  CHECK(d["experts"]["routed"] == 8);
  CHECK(d["skipped_mtp_layers"] == 1);
  CHECK(d["active_parameters"].get<uint64_t>() < d["parameters"].get<uint64_t>());
}

TEST_CASE("moe: router margins are recorded per layer and row on the CPU") {
  test::TempDir tmp;
  REQUIRE(
      write_random_checkpoint(tmp / "m", {moe_config(Family::qwen3_moe), DType::f32, 5, 1}).ok());
  auto m = Model::load(tmp / "m", 0, 1);
  REQUIRE(m.ok());
  (*m)->record_router_margins(true);
  const auto& c = (*m)->config();
  KVCache cache(c.num_layers, 4, 8, (*m)->local_kv_heads(), c.head_dim);
  std::vector<int32_t> toks = {1, 5, 9, 13, 17}, table = {0, 1, 2, 3};
  LocalCollective one;
  std::vector<float> lg;
  REQUIRE((*m)->forward({{toks.data(), 5, 0, table.data(), true}}, cache, one, &lg).ok());
  const auto& mg = (*m)->router_margins();
  CHECK(mg.size() == static_cast<size_t>(c.moe.moe_layers()) * 5);
  for (const auto& r : mg) CHECK(r.last_chosen >= r.first_unchosen);
}

TEST_CASE("moe: sparkctl plan and the engine agree on weights per rank, KV per token, context") {
  test::TempDir tmp;
  for (Family f :
       {Family::llama, Family::qwen3_moe, Family::mixtral, Family::glm4_moe, Family::minimax_m2}) {
    const std::string name = architecture_name(f);
    CAPTURE(name);
    const std::string dir = tmp / name;
    const ModelConfig mc = moe_config(f);
    REQUIRE(write_random_checkpoint(dir, {mc, DType::bf16, 11, 2}).ok());
    // The plan as `sparkctl plan` and preflight's mem.plan make it, from the directory.
    auto in = env::plan_input(env::read_model_files(env::Sysroot("/"), dir), nullptr);
    REQUIRE_MESSAGE(in.ok(), (in.ok() ? "" : in.error().message));
    REQUIRE_MESSAGE(in->engine_weights, in->engine_weights_why);
    in->record = {plan::KvLayout::native, "fp32"};  // the CPU engine's KV cache
    in->slots = 1;
    in->reserve = in->workspace = in->mtp = in->vision = in->kv_overhead = 0;
    const uint64_t kv_budget = 3 * 16 * 1536 + 5000;  // 3 blocks and a bit at one rank
    for (auto split : {plan::MoeSplit::automatic, plan::MoeSplit::tensor, plan::MoeSplit::expert})
      for (int w : {1, 2, 4}) {
        CAPTURE(w);
        CAPTURE(plan::moe_split_name(split));
        in->moe = split;
        in->capacity_per_rank = 0;
        const plan::PlanRow row = plan::plan_row(*in, w);
        // The engine, rank by rank, as sparkd loads it.
        uint64_t most_gpu = 0;
        bool refused = false;
        for (int r = 0; r < w && !refused; ++r) {
          LoadReport rep;
          rep.expert_placement = split;
          auto m = Model::load(dir, r, w, make_cpu_device(), &rep);
          if (!m.ok()) {
            refused = true;  // e.g. tp where the experts do not split: the plan says so too
            MESSAGE(name << ": the engine refuses: " << m.error().message);
            break;
          }
          PlanOptions o;
          o.rank = r;
          o.world = w;
          o.placement = split;
          auto p = make_shard_plan((*m)->config(), o, dir);
          REQUIRE(p.ok());
          // The plan's figure is the shard plan's; the shard plan's is what the engine holds.
          CHECK(p->held_bytes(4, 4) == rep.weight_bytes);  // fp32 on the CPU
          most_gpu = std::max(most_gpu, p->held_bytes(2, 2));
          // KV bytes per token: the engine's block size, the plan's per-token figure.
          CHECK(KVCache::block_bytes(ElemType::f32, mc.num_layers, 16, (*m)->local_kv_heads(),
                                     mc.head_dim) == row.kv_per_token_per_rank * 16);
        }
        CHECK(row.weights_from_engine == !refused);
        if (refused) continue;
        CHECK(row.weights_per_rank == most_gpu);
        // The largest context for a capacity of the weights and a KV budget.
        in->capacity_per_rank = row.weights_per_rank + kv_budget * 4 / static_cast<uint64_t>(w);
        const plan::PlanRow sized = plan::plan_row(*in, w);
        const uint64_t per_block = row.kv_per_token_per_rank * 16;
        CHECK(sized.max_context == static_cast<int64_t>((kv_budget * 4 / static_cast<uint64_t>(w)) /
                                                        row.kv_per_token_per_rank));
        if (w == 1) {
          // One rank: the engine itself sizes its cache from the same budget.
          auto m = Model::load(dir, 0, 1, make_cpu_device());
          REQUIRE(m.ok());
          EngineOptions eo;
          eo.slots = 1;
          eo.block_size = 16;
          eo.kv_cache_bytes = kv_budget * 4;
          auto e = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), eo);
          REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
          const int64_t tokens = int64_t{(*e)->stats().blocks_total} * 16;
          CHECK(static_cast<uint64_t>((*e)->stats().blocks_total) == kv_budget * 4 / per_block);
          CHECK(tokens <= sized.max_context);
          CHECK(sized.max_context - tokens < 16);  // the engine keeps whole blocks
          (*e)->stop();
        }
      }
  }
}
