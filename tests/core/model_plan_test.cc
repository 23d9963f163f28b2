// The per-layer memory plan (core/model_plan.h) against the configs of the models these
// rings serve: GLM-5.3-Flash (transformers' glm5_next defaults: 34 KDA linear-attention +
// 11 DSA layers), DeepSeek-V3.2, Qwen3-MoE, GLM-4.5 and Qwen3-Next, and vLLM's published
// arithmetic for GLM-5.3-Flash. Expected values are written out from the configs' numbers.
#include "core/model_plan.h"

#include <doctest/doctest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/kv_cache.h"
#include "env/model_files.h"
#include "env/plan.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::plan;

namespace {

ModelShape fixture(const std::string& name) {
  std::string path =
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models/plan/" + name + "/config.json";
  auto text = read_file(path);
  REQUIRE_MESSAGE(text, path);
  auto s = model_shape(nlohmann::json::parse(*text), path);
  REQUIRE_MESSAGE(s.ok(), (s.ok() ? std::string() : s.error().message));
  return *s;
}

const KvPart* find(const std::vector<KvPart>& parts, LayerKind k, const std::string& part) {
  for (const auto& p : parts)
    if (p.kind == k && p.part == part) return &p;
  return nullptr;
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

}  // namespace

TEST_CASE("plan: GLM-5.3-Flash keeps a state per sequence in its 34 linear layers") {
  ModelShape s = fixture("glm-5.3-flash");
  CHECK(s.arch == "Glm5NextForConditionalGeneration");
  CHECK(s.layers == 45);
  CHECK(s.count(LayerKind::linear_attention) == 34);
  CHECK(s.count(LayerKind::sparse_mla) == 11);
  CHECK(s.kv_lora_rank == 512);
  CHECK(s.qk_rope_head_dim == 0);
  CHECK(s.index_kpool == 16);
  CHECK(s.experts == 288);
  CHECK(s.experts_active == 8);
  CHECK(s.linear == LinearFamily::kda);

  const KvRecord vllm{KvLayout::vllm, "fp8"};
  auto two = kv_parts(s, vllm, {2, 1});
  const KvPart* latent = find(two, LayerKind::sparse_mla, "latent");
  const KvPart* index = find(two, LayerKind::sparse_mla, "indexer keys");
  const KvPart* tail = find(two, LayerKind::sparse_mla, "indexer tail");
  const KvPart* state = find(two, LayerKind::linear_attention, "state");
  REQUIRE(latent);
  REQUIRE(index);
  REQUIRE(tail);
  REQUIRE(state);
  // fp8_ds_mla: 512 fp8 latent + 4 fp32 scales + 64 bf16 RoPE (zeros here) = 656 bytes.
  CHECK(latent->layers == 11);
  CHECK(latent->bytes_per_state == 512 + 16 + 128);
  CHECK(latent->tokens_per_state == 1);
  // The indexer: 128 fp8 + one fp32 scale per 16-token pool.
  CHECK(index->bytes_per_state == 128 + 4);
  CHECK(index->tokens_per_state == 16);
  CHECK(tail->bytes_per_slot == 16 * 2 * 128 * 2);
  // KDA state at 2 ranks (32 of 64 heads): conv of q, k, v over 3 past tokens in bf16, and
  // a 128 x 128 fp32 matrix per head.
  CHECK(state->layers == 34);
  CHECK(state->bytes_per_state == 0);
  CHECK(state->bytes_per_slot == 3ull * 32 * 128 * 3 * 2 + 32ull * 128 * 128 * 4);

  // The latent is whole on every rank: two ranks keep as much per token as one ...
  auto one = kv_parts(s, vllm, {1, 1});
  CHECK(find(one, LayerKind::sparse_mla, "latent")->bytes_per_state == 656);
  CHECK(find(one, LayerKind::linear_attention, "state")->bytes_per_slot ==
        2 * state->bytes_per_slot);
  // ... unless each sequence's tokens are split across them.
  CHECK(find(kv_parts(s, vllm, {2, 2}), LayerKind::sparse_mla, "latent")->bytes_per_state == 328);

  // Per token, only the 11 DSA layers grow: far from the 22.5 KiB of every layer.
  const uint64_t per_token = kv_bytes_per_token_per_rank(s, vllm, {2, 1});
  CHECK(per_token == 11 * 656 + 11 * 9);  // 132/16 rounded up per token
  CHECK(kv_bytes_per_token_per_rank(s, vllm, {1, 1}) == per_token);

  // vLLM's figure for this model: about 7.1 GiB per million tokens per node.
  const uint64_t states = kv_bytes_per_sequence(two, 0);
  const uint64_t million = kv_bytes_per_sequence(two, 1000000) - states;
  CHECK(million == 11ull * 656 * 1000000 + 11ull * 132 * (1000000 / 16));
  const double gib_per_million = static_cast<double>(million) / kGiB;
  MESSAGE("GLM-5.3-Flash, vLLM records, 2 ranks: ", gib_per_million,
          " GiB per million tokens (vLLM: 7.1); fixed state per sequence ",
          static_cast<double>(states) / kGiB, " GiB");
  CHECK(std::fabs(gib_per_million - 7.1) / 7.1 < 0.10);

  // The published checkpoint pools 4 tokens per indexer key (vLLM's Glm5NextIndexerCache
  // tests name index_kpool 4 for zai-org/GLM-5.3-Flash): 656 + 132/4 bytes per DSA layer.
  ModelShape real = s;
  real.index_kpool = 4;
  auto real_parts = kv_parts(real, vllm, {2, 1});
  const double real_gib = static_cast<double>(kv_bytes_per_sequence(real_parts, 1000000) -
                                              kv_bytes_per_sequence(real_parts, 0)) /
                          kGiB;
  MESSAGE("with index_kpool 4: ", real_gib, " GiB per million tokens");
  CHECK(std::fabs(real_gib - 7.1) / 7.1 < 0.02);

  // The largest single-sequence context in 11.75 GiB of KV, from these records alone: the
  // fixed state is small, so about 1.7 M tokens. (vLLM's own estimate, 609,280, charges
  // about 7.4 GiB more per request than the records and states above account for.)
  const uint64_t budget = static_cast<uint64_t>(11.75 * kGiB);
  const int64_t max_ctx = max_context_for(two, 1, budget);
  MESSAGE("largest context in 11.75 GiB of KV: ", max_ctx, " tokens (vLLM estimate 609,280)");
  CHECK(kv_bytes_per_sequence(two, max_ctx) <= budget);
  CHECK(kv_bytes_per_sequence(two, max_ctx + 1) > budget);
  const auto analytic = static_cast<int64_t>((budget - states) * 16 / (16 * 656 * 11 + 132 * 11));
  CHECK(std::llabs(max_ctx - analytic) <= 16);
  CHECK(max_ctx > 1600000);

  // Our own layout: K-less latent in KV_DTYPE (fp8: 512 bytes) and bf16 indexer keys.
  auto ours = kv_parts(s, {KvLayout::native, "fp8"}, {2, 1});
  CHECK(find(ours, LayerKind::sparse_mla, "latent")->bytes_per_state == 512);
  CHECK(find(ours, LayerKind::sparse_mla, "indexer keys")->bytes_per_state == 128);
  CHECK(find(ours, LayerKind::sparse_mla, "indexer tail") == nullptr);
}

TEST_CASE("plan: DeepSeek-V3.2 MLA with a per-token indexer, not split by tensor parallel") {
  ModelShape s = fixture("deepseek-v3.2");
  CHECK(s.count(LayerKind::sparse_mla) == 61);
  CHECK(s.index_kpool == 1);
  CHECK(s.mtp_layers == 1);
  CHECK(s.experts == 256);
  const uint64_t vllm = kv_bytes_per_token_per_rank(s, {KvLayout::vllm, "fp8"}, {8, 1});
  CHECK(vllm == 61ull * 656 + 61ull * 132);
  const uint64_t bf16 = kv_bytes_per_token_per_rank(s, {KvLayout::native, "auto"}, {1, 1});
  CHECK(bf16 == 61ull * (512 + 64) * 2 + 61ull * 128 * 2);
  CHECK(kv_bytes_per_token_per_rank(s, {KvLayout::native, "auto"}, {8, 1}) == bf16);
  // vLLM without fp8: the latent and RoPE key in bf16 (no fp8_ds_mla record).
  CHECK(kv_bytes_per_token_per_rank(s, {KvLayout::vllm, "bf16"}, {1, 1}) ==
        61ull * (512 + 64) * 2 + 61ull * 132);
}

TEST_CASE("plan: Qwen3-MoE GQA heads split across ranks, a head never split") {
  ModelShape s = fixture("qwen3-30b-a3b");
  CHECK(s.count(LayerKind::full_attention) == 48);
  CHECK(s.kv_heads == 4);
  CHECK(s.head_dim == 128);
  CHECK(s.experts == 128);
  CHECK(s.experts_active == 8);
  const KvRecord r{KvLayout::native, "auto"};
  CHECK(kv_bytes_per_token_per_rank(s, r, {1, 1}) == 48ull * 2 * 4 * 128 * 2);
  CHECK(kv_bytes_per_token_per_rank(s, r, {2, 1}) == 48ull * 2 * 2 * 128 * 2);
  CHECK(kv_bytes_per_token_per_rank(s, r, {8, 1}) == 48ull * 2 * 1 * 128 * 2);

  // Experts: 57 of 61 GB; with 3 ranks expert parallel puts 43 of 128 experts on a rank.
  WeightInventory w{61'000'000'000, 57'000'000'000, true};
  CHECK(weights_per_rank(w, s, MoeSplit::tensor, 3) ==
        (4'000'000'000ull + 2) / 3 + (57'000'000'000ull + 2) / 3);
  CHECK(weights_per_rank(w, s, MoeSplit::expert, 3) ==
        (4'000'000'000ull + 2) / 3 + (57'000'000'000ull * 43 + 127) / 128);
  CHECK(weights_per_rank(w, s, MoeSplit::expert, 4) == weights_per_rank(w, s, MoeSplit::tensor, 4));
}

TEST_CASE("plan: GLM-4.5 grouped-query attention with its MTP layer recorded") {
  ModelShape s = fixture("glm-4.5");
  CHECK(s.count(LayerKind::full_attention) == 92);
  CHECK(s.mtp_layers == 1);
  CHECK(s.experts == 160);
  CHECK(kv_bytes_per_token_per_rank(s, {KvLayout::vllm, "fp8"}, {4, 1}) == 92ull * 2 * 2 * 128);
}

TEST_CASE("plan: Qwen3-Next gated delta net state from its head counts and dims") {
  ModelShape s = fixture("qwen3-next-80b-a3b");
  CHECK(s.linear == LinearFamily::gated_delta_net);
  CHECK(s.count(LayerKind::full_attention) == 12);  // every 4th layer
  CHECK(s.count(LayerKind::linear_attention) == 36);
  CHECK(s.kinds[3] == LayerKind::full_attention);
  CHECK(s.kinds[0] == LayerKind::linear_attention);
  auto parts = kv_parts(s, {KvLayout::vllm, "auto"}, {2, 1});
  const KvPart* st = find(parts, LayerKind::linear_attention, "state");
  REQUIRE(st);
  // conv over q, k (16 heads x 128) and v (32 x 128), halved; recurrent 16 v-heads of 128x128.
  CHECK(st->bytes_per_slot == (2ull * 8 * 128 + 16 * 128) * 3 * 2 + 16ull * 128 * 128 * 4);
  CHECK(kv_bytes_per_token_per_rank(s, {KvLayout::vllm, "auto"}, {2, 1}) ==
        12ull * 2 * 1 * 256 * 2);
}

TEST_CASE(
    "plan: sliding windows cap vLLM's KV per sequence, and ours where full layers keep the "
    "shared blocks (a ring of the window and a step's tokens)") {
  auto s = model_shape(nlohmann::json::parse(
                           R"({"num_hidden_layers":32,"num_attention_heads":32,
                               "num_key_value_heads":8,"head_dim":128,"sliding_window":4096})"),
                       "m/config.json");
  REQUIRE(s.ok());
  CHECK(s->count(LayerKind::sliding_attention) == 32);
  const uint64_t per_token = 32ull * 2 * 8 * 128 * 2;
  CHECK(kv_bytes_per_sequence(kv_parts(*s, {KvLayout::vllm, "auto"}, {1, 1}), 32768) ==
        per_token * 4096);
  CHECK(kv_bytes_per_sequence(kv_parts(*s, {KvLayout::native, "auto"}, {1, 1}), 32768) ==
        per_token * 32768);
  // A window caps the sequence: the whole window fits, then any context does.
  CHECK(max_context_for(kv_parts(*s, {KvLayout::vllm, "auto"}, {1, 1}), 1, per_token * 4096) >
        (int64_t{1} << 30));
  // Gemma-style layer_types mixes the two.
  auto mixed = model_shape(nlohmann::json::parse(
                               R"({"num_hidden_layers":3,"num_attention_heads":8,"head_dim":64,
                                   "sliding_window":512,"layer_types":["sliding_attention",
                                   "sliding_attention","full_attention"]})"),
                           "g/config.json");
  REQUIRE(mixed.ok());
  CHECK(mixed->count(LayerKind::sliding_attention) == 2);
  CHECK(mixed->count(LayerKind::full_attention) == 1);
  // 8 KV heads (none given: the attention heads) of 64, bf16: 2 x 8 x 64 x 2 bytes a token.
  const uint64_t layer_token = 2ull * 8 * 64 * 2;
  // Ours: the sliding layers keep 512 + 256 - 1 positions, in whole blocks of 16: 768.
  auto ours = kv_parts(*mixed, {KvLayout::native, "auto"}, {1, 1});
  REQUIRE(find(ours, LayerKind::sliding_attention, "K+V"));
  CHECK(find(ours, LayerKind::sliding_attention, "K+V")->window == 768);
  CHECK(find(ours, LayerKind::full_attention, "K+V")->window == 0);
  CHECK(kv_bytes_per_sequence(ours, 32768) == layer_token * (32768 + 2 * 768));
  KvRecord chunk64{KvLayout::native, "auto", 64};  // PREFILL_CHUNK 64: 575 -> 576
  CHECK(kv_bytes_per_sequence(kv_parts(*mixed, chunk64, {1, 1}), 32768) ==
        layer_token * (32768 + 2 * 576));
  // A context shorter than the ring keeps what it has.
  CHECK(kv_bytes_per_sequence(ours, 300) == layer_token * 300 * 3);
  CHECK(kv_bytes_per_sequence(kv_parts(*mixed, {KvLayout::vllm, "auto"}, {1, 1}), 32768) ==
        layer_token * (32768 + 2 * 512));
}

TEST_CASE("plan: an unknown layer type is an error naming it, not a guess") {
  auto bad = model_shape(nlohmann::json::parse(
                             R"({"num_hidden_layers":2,"num_attention_heads":4,"head_dim":64,
                                 "layer_types":["full_attention","mamba2_mixer"]})"),
                         "/models/x/config.json");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::config);
  CHECK(bad.error().message.find("/models/x/config.json: layer_types[1] is \"mamba2_mixer\"") !=
        std::string::npos);
  auto no_dims = model_shape(nlohmann::json::parse(
                                 R"({"num_hidden_layers":2,"num_attention_heads":4,"head_dim":64,
                                     "layer_types":["full_attention","linear_attention"]})"),
                             "c.json");
  REQUIRE_FALSE(no_dims.ok());
  CHECK(no_dims.error().message.find("linear_attention layers need their head counts") !=
        std::string::npos);
  auto short_list = model_shape(nlohmann::json::parse(
                                    R"({"num_hidden_layers":3,"num_attention_heads":4,
                                        "head_dim":64,"layer_types":["full_attention"]})"),
                                "c.json");
  CHECK_FALSE(short_list.ok());
  CHECK_FALSE(model_shape(nlohmann::json::parse(R"({"num_attention_heads":4})"), "c").ok());
}

TEST_CASE("plan: a row adds weights, KV with states, stated fixed costs and the reserve") {
  PlanInput in;
  in.shape = fixture("glm-5.3-flash");
  in.record = {KvLayout::vllm, "fp8"};
  in.weights = {160ull << 30, 150ull << 30, true};
  in.moe = MoeSplit::expert;
  in.context = 500000;
  in.slots = 2;
  in.reserve = 4ull << 30;
  in.workspace = 3ull << 30;
  in.mtp = 2ull << 30;
  in.vision = 1ull << 30;
  in.capacity_per_rank = 121ull << 30;
  PlanRow r = plan_row(in, 2);
  CHECK(r.ranks == 2);
  CHECK(r.weights_per_rank == (10ull << 30) / 2 + (150ull << 30) * 144 / 288);
  CHECK(r.state_per_rank ==
        2ull * (34 * (3ull * 32 * 128 * 3 * 2 + 32ull * 128 * 128 * 4) + 11 * 16 * 2 * 128 * 2));
  CHECK(r.kv_per_rank == 2 * kv_bytes_per_sequence(r.parts, 500000));
  CHECK(r.fixed_per_rank == 6ull << 30);
  CHECK(r.need_per_rank == r.weights_per_rank + r.kv_per_rank + r.fixed_per_rank + r.reserve);
  CHECK(r.fits);
  const uint64_t budget = (121ull << 30) - r.weights_per_rank - r.fixed_per_rank - r.reserve;
  CHECK(r.max_context == max_context_for(r.parts, 2, budget));
  CHECK(2 * kv_bytes_per_sequence(r.parts, r.max_context) <= budget);
  CHECK(2 * kv_bytes_per_sequence(r.parts, r.max_context + 1) > budget);
  in.capacity_per_rank = r.weights_per_rank;  // nothing left for KV
  CHECK(plan_row(in, 2).max_context == 0);
}

TEST_CASE("plan: with vLLM's constant stated, GLM-5.3-Flash plans what vLLM itself reports") {
  // vLLM's figures for this model at two ranks: 10.98 GiB of KV needed for 500,000 tokens and
  // 14.52 GiB for 1,000,000. The records give the slope; the constant of the line through the
  // two figures is the charge vLLM adds per request, stated as KV_OVERHEAD. Checked against
  // two other figures vLLM printed: 13.46 GiB needed for 850,000 tokens, and 609,280 the
  // largest context in 11.75 GiB.
  PlanInput in;
  in.shape = fixture("glm-5.3-flash");
  in.shape.index_kpool = 4;  // the published checkpoint
  in.record = {KvLayout::vllm, "fp8"};
  in.slots = 1;
  const double slope = (14.52 - 10.98) / 0.5;  // GiB per million tokens
  const double constant = 10.98 - 0.5 * slope;
  in.kv_overhead = static_cast<uint64_t>(constant * kGiB);
  in.context = 850000;
  in.capacity_per_rank = static_cast<uint64_t>(11.75 * kGiB);  // no weights: all of it is KV
  PlanRow r = plan_row(in, 2);
  const double need_gib = static_cast<double>(r.kv_per_rank) / kGiB;
  MESSAGE("850,000 tokens: ", need_gib,
          " GiB of KV (vLLM: 13.46); largest context in 11.75 GiB: ", r.max_context,
          " (vLLM: 609,280)");
  CHECK(r.kv_per_rank == kv_bytes_per_sequence(r.parts, 850000) + in.kv_overhead);
  CHECK(std::fabs(need_gib - 13.46) / 13.46 < 0.10);
  CHECK(std::fabs(static_cast<double>(r.max_context) - 609280.0) / 609280.0 < 0.10);
  CHECK(kv_bytes_per_sequence(r.parts, r.max_context) + in.kv_overhead <= in.capacity_per_rank);
  CHECK(kv_bytes_per_sequence(r.parts, r.max_context + 1) + in.kv_overhead > in.capacity_per_rank);
  // Without the stated charge the records alone leave room for more than twice as much.
  in.kv_overhead = 0;
  CHECK(plan_row(in, 2).max_context > 2 * 609280);
}

TEST_CASE("plan: the engine's KV cache holds what the plan says per token") {
  // Two ranks of an 8-KV-head, 128-dim, 4-layer model: the engine's fp32 K and V pools for
  // 10 blocks of 16 tokens are the plan's bytes per token per rank times 160 tokens.
  const ModelShape s = dense_attention_shape(4, 8, 128);
  const uint64_t per_token = kv_bytes_per_token_per_rank(s, {KvLayout::native, "fp32"}, {2, 1});
  spark::engine::KVCache cache(4, 10, 16, 8 / 2, 128);
  CHECK(cache.bytes() == per_token * 160);
}

namespace {

// A safetensors file whose header names `tensors` (name, bytes) over zeroed data.
std::string safetensors(const std::vector<std::pair<std::string, uint64_t>>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& [name, bytes] : tensors) {
    h[name] = {{"dtype", "U8"}, {"shape", {bytes}}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  }
  std::string text = h.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>(text.size() >> (8 * i));
  return out + text + std::string(off, '\0');
}

}  // namespace

TEST_CASE("plan: routed-expert bytes come from the shards' headers, quantized or not") {
  spark::test::TempDir d("plan-weights");
  d.write("m/config.json", R"({"num_hidden_layers":1,"num_attention_heads":4,"head_dim":8,
                              "n_routed_experts":4})");
  d.write("m/model.safetensors.index.json",
          R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  d.write("m/s1.safetensors",
          safetensors({{"model.layers.0.mlp.experts.0.down_proj.weight", 1000},
                       {"model.layers.0.mlp.experts.0.down_proj.weight_scale", 24},
                       {"model.layers.0.self_attn.q_proj.weight", 300}}));
  d.write("m/s2.safetensors",
          safetensors({{"model.layers.0.mlp.experts.gate_up_proj", 4000},
                       {"model.layers.0.mlp.shared_experts.up_proj.weight", 200}}));
  auto mf = spark::env::read_model_files(spark::env::Sysroot("/"), d / "m");
  REQUIRE(mf.config_ok);
  CHECK(mf.tensor_sizes);
  CHECK(mf.tensor_bytes == 1000 + 24 + 300 + 4000 + 200);
  CHECK(mf.expert_bytes == 1000 + 24 + 4000);
  auto in = spark::env::plan_input(mf, nullptr);
  REQUIRE(in.ok());
  CHECK(in->weights.experts == 5024);
  // A shard that is not safetensors leaves the split unknown (everything / R) and says why.
  d.write("m/s2.safetensors", std::string(16, '\0'));
  auto bad = spark::env::read_model_files(spark::env::Sysroot("/"), d / "m");
  CHECK_FALSE(bad.tensor_sizes);
  CHECK(bad.expert_bytes == 0);
  CHECK(bad.tensor_sizes_error.find("s2.safetensors") != std::string::npos);
}
