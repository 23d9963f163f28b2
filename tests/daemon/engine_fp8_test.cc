// FP8 checkpoints (F8_E4M3 projections with 128x128 block scales, as DeepSeek, Qwen, GLM and
// MiniMax publish them): the e4m3 codes, quantization_config as published and what is
// refused, the loader's widening held against the same model written with the dequantized
// values (dense and MoE, one and two ranks), splits that would cut a scale block, and
// checkpoints damaged in FP8-specific ways. Against transformers: the qwen3_fp8 and
// qwen3_moe_fp8 fixtures of tools/gen_reference_hub.py (engine_reference_test.cc).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/safetensors.h"
#include "daemon/engine/weight_format.h"
#include "support/fp8_config.h"
#include "support/tempdir.h"
#include "support/tp_threads.h"

using namespace spark;
using namespace spark::engine;

namespace {

using test::fp8_config;

// Writes `cfg` as an FP8 checkpoint into `fp8_dir` and the same model with the values its FP8
// form dequantizes to into `deq_dir`.
void write_fp8_pair(const std::string& fp8_dir, const std::string& deq_dir, const ModelConfig& cfg,
                    DType dtype, uint64_t seed) {
  RandomCheckpointSpec q{cfg, dtype, seed, 1};
  q.fp8 = true;
  RandomCheckpointSpec deq = q;
  deq.fp8_dequantized = true;
  REQUIRE(write_random_checkpoint(fp8_dir, q).ok());
  REQUIRE(write_random_checkpoint(deq_dir, deq).ok());
}

std::vector<test::TpSeq> seqs() {
  std::vector<int32_t> a = {1, 17, 99, 250, 3, 77, 310, 12, 5, 300, 301, 17};
  std::vector<int32_t> b = {1, 9, 8, 7, 6, 5, 4, 3, 2, 100};
  for (int i = 0; i < 6; ++i) {
    a.push_back(static_cast<int32_t>((i * 37 + 11) % 384));
    b.push_back(static_cast<int32_t>((i * 53 + 5) % 384));
  }
  return {{a, 8}, {b, 5}};
}

Result<std::shared_ptr<Device>> cpu(int) {
  return make_cpu_device();
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string load_error(const std::string& dir, int rank = 0, int world = 1) {
  auto m = Model::load(dir, rank, world);
  return m ? std::string() : m.error().message;
}

// Rewrites DIR/model.safetensors after `edit` changes its tensors (name -> dtype, shape,
// bytes); tensors erased by `edit` are left out.
struct RawTensor {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};
void rewrite(const std::string& dir,
             const std::function<void(std::map<std::string, RawTensor>&)>& edit) {
  const std::string path = dir + "/model.safetensors";
  std::map<std::string, RawTensor> ts;
  {
    auto f = SafetensorsFile::open(path);
    REQUIRE(f.ok());
    for (const auto& t : f->header().tensors) {
      RawTensor r{t.dtype, t.shape, std::vector<char>(t.end - t.begin)};
      REQUIRE(f->read_raw(t, Slice{}, r.bytes.data()).ok());
      ts[t.name] = std::move(r);
    }
  }
  edit(ts);
  std::vector<TensorToWrite> out;
  for (const auto& [name, r] : ts) {
    TensorToWrite w{name, r.shape, nullptr};
    w.raw = r.bytes.data();
    w.raw_dtype = r.dtype;
    out.push_back(w);
  }
  REQUIRE(write_safetensors(path, out, DType::f32).ok());
}

void set_f32(RawTensor& t, size_t i, float v) {
  std::memcpy(t.bytes.data() + 4 * i, &v, 4);
}

}  // namespace

TEST_CASE("fp8: e4m3 codes decode as the format defines and encode back with ties to even") {
  CHECK(fp8_e4m3_to_float(0x00) == 0.f);
  CHECK(std::signbit(fp8_e4m3_to_float(0x80)));
  CHECK(fp8_e4m3_to_float(0x01) == std::ldexp(1.f, -9));  // the smallest subnormal
  CHECK(fp8_e4m3_to_float(0x07) == 7 * std::ldexp(1.f, -9));
  CHECK(fp8_e4m3_to_float(0x08) == std::ldexp(1.f, -6));  // the smallest normal
  CHECK(fp8_e4m3_to_float(0x38) == 1.f);
  CHECK(fp8_e4m3_to_float(0x39) == 1.125f);
  CHECK(fp8_e4m3_to_float(0xb8) == -1.f);
  CHECK(fp8_e4m3_to_float(0x7e) == 448.f);  // the largest
  CHECK(std::isnan(fp8_e4m3_to_float(0x7f)));
  CHECK(std::isnan(fp8_e4m3_to_float(0xff)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    CAPTURE(c);
    CHECK(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(c))) == c);
  }
  CHECK(float_to_fp8_e4m3(1.0625f) == 0x38);  // halfway 1 and 1.125: the even code
  CHECK(float_to_fp8_e4m3(1.1875f) == 0x3a);  // halfway 1.125 and 1.25: the even code
  CHECK(float_to_fp8_e4m3(1.07f) == 0x39);
  CHECK(float_to_fp8_e4m3(1000.f) == 0x7e);  // saturates
  CHECK(float_to_fp8_e4m3(-1000.f) == 0xfe);
}

TEST_CASE("fp8: quantization_config as published is read; another format is refused by field") {
  auto base = nlohmann::json::parse(R"({"architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3", "vocab_size": 384, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "max_position_embeddings": 512})");
  auto with = [&](const nlohmann::json& q) {
    auto j = base;
    j["quantization_config"] = q;
    return parse_model_config(j.dump(), "/m/config.json");
  };
  // DeepSeek-V3's (no module list), Qwen3-*-FP8's (no fmt), DeepSeek-V3.1's ue8m0 scales.
  auto ds = with(nlohmann::json::parse(
      R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": [128, 128]})"));
  REQUIRE_MESSAGE(ds.ok(), ds.error().message);
  CHECK(ds->weights.fp8());
  CHECK(ds->weights.block_n == 128);
  CHECK(ds->weights.describe() == "fp8 e4m3, 128x128 block scales");
  auto qw = with(nlohmann::json::parse(
      R"({"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["lm_head", "model.layers.*.mlp.gate"]})"));
  REQUIRE(qw.ok());
  CHECK(qw->weights.is_not_converted("lm_head.weight"));
  CHECK(qw->weights.is_not_converted("model.layers.7.mlp.gate.weight"));
  CHECK_FALSE(qw->weights.is_not_converted("model.layers.7.mlp.gate_proj.weight"));
  CHECK_FALSE(qw->weights.is_not_converted("model.layers.7.self_attn.q_proj.weight"));
  auto ue = with(nlohmann::json::parse(
      R"({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
          "weight_block_size": [128, 128]})"));
  REQUIRE(ue.ok());
  CHECK(ue->weights.ue8m0_scales);
  auto plain = parse_model_config(base.dump(), "/m/config.json");
  REQUIRE(plain.ok());
  CHECK_FALSE(plain->weights.fp8());

  struct Bad {
    const char* q;
    const char* field;
    const char* value;
  };
  for (const Bad& b : {
           Bad{R"({"quant_method": "awq", "bits": 4})", "quant_method", "\"awq\""},
           Bad{R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})", "fmt",
               "\"e5m2\""},
           Bad{R"({"quant_method": "fp8", "weight_block_size": [64, 64]})", "weight_block_size",
               "[64,64]"},
           Bad{R"({"quant_method": "fp8", "activation_scheme": "dynamic"})", "weight_block_size",
               "per-tensor"},
           Bad{R"({"quant_method": "fp8", "activation_scheme": "static",
                   "weight_block_size": [128, 128]})",
               "activation_scheme", "\"static\""},
           Bad{R"({"quant_method": "fp8", "scale_fmt": "e4m3", "weight_block_size": [128, 128]})",
               "scale_fmt", "\"e4m3\""},
       }) {
    CAPTURE(b.q);
    auto r = with(nlohmann::json::parse(b.q));
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code == Errc::unsupported);
    CHECK(contains(r.error().message, "/m/config.json"));
    CHECK(contains(r.error().message, std::string("quantization_config.") + b.field));
    CHECK(contains(r.error().message, b.value));
  }
}

TEST_CASE("fp8: a block-scaled checkpoint gives the logits of its dequantized values") {
  test::TempDir tmp;
  for (Family f : {Family::qwen3, Family::qwen3_moe}) {
    const std::string name = architecture_name(f);
    CAPTURE(name);
    const auto cfg = fp8_config(f);
    RandomCheckpointSpec q{cfg, DType::f32, 31, 1};
    q.fp8 = true;
    RandomCheckpointSpec deq = q;
    deq.fp8_dequantized = true;
    RandomCheckpointSpec unq{cfg, DType::f32, 31, 1};
    REQUIRE(write_random_checkpoint(tmp / (name + "-fp8"), q).ok());
    REQUIRE(write_random_checkpoint(tmp / (name + "-deq"), deq).ok());
    REQUIRE(write_random_checkpoint(tmp / (name + "-unq"), unq).ok());
    auto a = test::run_tp_threads(tmp / (name + "-fp8"), 1, seqs(), cpu);
    REQUIRE_MESSAGE(a.error.empty(), a.error);
    auto b = test::run_tp_threads(tmp / (name + "-deq"), 1, seqs(), cpu);
    REQUIRE_MESSAGE(b.error.empty(), b.error);
    auto u = test::run_tp_threads(tmp / (name + "-unq"), 1, seqs(), cpu);
    REQUIRE_MESSAGE(u.error.empty(), u.error);
    // The same fp32 weights: the same logits, to the bit.
    CHECK(test::max_logit_diff(a, b) == 0.0);
    // The weights were quantized (the unquantized model differs), and the FP8 files are read
    // at a byte a weight: under half of the F32 twin's bytes.
    CHECK(test::max_logit_diff(a, u) > 1e-3);
    CHECK(a.bytes_read_rank0 * 2 < b.bytes_read_rank0);
    // Two ranks, each widening its own slices (experts tensor-parallel by whole blocks, and
    // expert-parallel), give one rank's logits.
    for (auto split : {plan::MoeSplit::automatic, plan::MoeSplit::expert}) {
      if (!cfg.is_moe() && split == plan::MoeSplit::expert) continue;
      auto tp = test::run_tp_threads(tmp / (name + "-fp8"), 2, seqs(), cpu, {}, split);
      REQUIRE_MESSAGE(tp.error.empty(), tp.error);
      const double d = test::max_logit_diff(tp, b);
      MESSAGE(name << " fp8 x2 " << std::string(plan::moe_split_name(split))
                   << ": max |logit diff| " << d);
      CHECK(d < 2e-4);
      CHECK(tp.bytes_read_rank0 < a.bytes_read_rank0);
    }
  }
}

TEST_CASE(
    "fp8: projections stay FP8 as stored, a byte a weight and the scales, as the plan counts") {
  test::TempDir tmp;
  for (Family f : {Family::qwen3, Family::qwen3_moe}) {
    const std::string name = architecture_name(f);
    CAPTURE(name);
    const auto cfg = fp8_config(f);
    write_fp8_pair(tmp / (name + "-fp8"), tmp / (name + "-deq"), cfg, DType::bf16, 17);
    LoadReport a, b;
    auto ma = Model::load(tmp / (name + "-fp8"), 0, 1, &a);
    REQUIRE_MESSAGE(ma.ok(), ma.error().message);
    auto mb = Model::load(tmp / (name + "-deq"), 0, 1, &b);
    REQUIRE_MESSAGE(mb.ok(), mb.error().message);
    const ShardPlan& p = (*ma)->shard_plan();
    // What the loader holds is what the plan (and so `sparkctl plan` and preflight) counts.
    CHECK(a.weight_bytes == p.held_bytes(4, 4));
    CHECK(b.weight_bytes == (*mb)->shard_plan().held_bytes(4, 4));
    // Every projection is FP8: a quarter of the fp32 twin's bytes, plus one fp32 scale per
    // 128 x 128 block; embeddings, norms and the router stay in the compute type.
    uint64_t proj = 0, scales = 0, fp8_dests = 0;
    for (const auto& d : p.dests)
      if (d.fp8) {
        ++fp8_dests;
        proj += d.numel;
        scales += d.scale_bytes();
        CHECK(d.scale_row_shift == 7);
        CHECK(d.scale_bytes() * 128 * 128 / 4 >= d.numel);
      }
    CHECK(fp8_dests > 0);
    CHECK(b.weight_bytes - a.weight_bytes == proj * 3 - scales);
    // A GPU that keeps FP8 holds the projections at a byte plus the scales; one that widens
    // them, as the dequantized model.
    CHECK(p.held_bytes(2, 2) + proj - scales == (*mb)->shard_plan().held_bytes(2, 2));
    CHECK(p.held_bytes(2, 2, false) == (*mb)->shard_plan().held_bytes(2, 2));
  }
}

TEST_CASE("fp8: a fused gate/up whose halves are not whole blocks keeps a scale row per row") {
  // Intermediate 192: gate's rows [0, 192) and up's [192, 384) of the fused [gate | up]
  // matrix, up starting inside the second 128-row block.
  auto cfg = fp8_config(Family::qwen3);
  cfg.intermediate_size = 192;
  test::TempDir tmp;
  write_fp8_pair(tmp / "fp8", tmp / "deq", cfg, DType::f32, 23);
  auto m = Model::load(tmp / "fp8", 0, 1);
  REQUIRE_MESSAGE(m.ok(), m.error().message);
  int per_row = 0;
  for (const auto& d : (*m)->shard_plan().dests)
    if (d.fp8 && d.role == WeightRole::w_gate_up) {
      ++per_row;
      CHECK(d.scale_row_shift == 0);
      CHECK(d.scale_rows == 384);
    }
  CHECK(per_row == cfg.num_layers);
  auto a = test::run_tp_threads(tmp / "fp8", 1, seqs(), cpu);
  REQUIRE_MESSAGE(a.error.empty(), a.error);
  auto b = test::run_tp_threads(tmp / "deq", 1, seqs(), cpu);
  REQUIRE_MESSAGE(b.error.empty(), b.error);
  CHECK(test::max_logit_diff(a, b) == 0.0);
}

TEST_CASE("fp8: a split that would cut a scale block is refused; FP8 experts go expert-parallel") {
  // KV heads of 64: two ranks would hold 64 rows each of k_proj's 128-row blocks.
  auto c = fp8_config(Family::qwen3);
  c.head_dim = 64;
  c.rotary_dim = 64;
  test::TempDir tmp;
  RandomCheckpointSpec s{c, DType::bf16, 5, 1};
  s.fp8 = true;
  REQUIRE(write_random_checkpoint(tmp.path(), s).ok());
  CHECK(load_error(tmp.path()).empty());  // one rank holds whole tensors
  const std::string e = load_error(tmp.path(), 1, 2);
  CAPTURE(e);
  CHECK(contains(e, "would cut FP8 scale blocks"));
  CHECK(contains(e, "k_proj.weight"));
  CHECK(contains(e, "rank 1 holds rows [64, 128)"));
  CHECK(contains(e, "multiples of 128"));

  // Experts of 128 at two ranks: tensor-parallel would cut every block, so auto holds whole
  // experts per rank and says why; EXPERT_PARALLEL=tp is refused.
  auto m = load_model_config(tmp.path());
  REQUIRE(m.ok());
  auto mc = fp8_config(Family::qwen3_moe);
  mc.moe.expert_inter = 128;
  mc.weights = m->weights;
  mc.moe.expert_block = 128;
  PlanOptions o;
  o.rank = 0;
  o.world = 2;
  auto p = make_shard_plan(mc, o, "/m");
  REQUIRE_MESSAGE(p.ok(), p.error().message);
  CHECK(p->placement == plan::MoeSplit::expert);
  CHECK(contains(p->placement_reason, "whole 128-blocks"));
  o.placement = plan::MoeSplit::tensor;
  auto bad = make_shard_plan(mc, o, "/m");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.error().message, "128-blocks"));
}

TEST_CASE("fp8: a checkpoint damaged in an FP8 way fails the load naming the tensor") {
  const auto cfg = fp8_config(Family::qwen3);
  const std::string w = "model.layers.1.self_attn.o_proj.weight";
  const std::string sc = w + "_scale_inv";
  struct Case {
    const char* what;
    std::function<void(std::map<std::string, RawTensor>&)> edit;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"scale tensor missing", [&](auto& ts) { ts.erase(sc); }, {w, sc, "no scale tensor"}},
      {"scale shape off by one block",
       [&](auto& ts) {
         auto& t = ts[sc];
         t.shape[0] += 1;
         t.bytes.resize(t.bytes.size() + static_cast<size_t>(4 * t.shape[1]));
       },
       {sc, "shape", w}},
      {"NaN scale", [&](auto& ts) { set_f32(ts[sc], 1, std::nanf("")); }, {sc, "block [0][1]"}},
      {"zero scale", [&](auto& ts) { set_f32(ts[sc], 0, 0.f); }, {sc, "block [0][0]", "positive"}},
      {"negative scale", [&](auto& ts) { set_f32(ts[sc], 0, -0.5f); }, {sc, "block [0][0]"}},
      {"F8_E5M2 where e4m3 is declared",
       [&](auto& ts) { ts[w].dtype = DType::f8_e5m2; },
       {w, "F8_E5M2", "declares e4m3"}},
      {"scales stored as F8",
       [&](auto& ts) {
         auto& t = ts[sc];
         t.dtype = DType::u8;
         t.bytes.resize(t.bytes.size() / 4);
       },
       {sc, "F32 or BF16"}},
  };
  for (const auto& cs : cases) {
    CAPTURE(cs.what);
    test::TempDir tmp;
    RandomCheckpointSpec s{cfg, DType::bf16, 9, 1};
    s.fp8 = true;
    REQUIRE(write_random_checkpoint(tmp.path(), s).ok());
    REQUIRE(load_error(tmp.path()).empty());
    rewrite(tmp.path(), cs.edit);
    const std::string e = load_error(tmp.path());
    CAPTURE(e);
    REQUIRE_FALSE(e.empty());
    for (const auto& want : cs.says) CHECK(contains(e, want));
  }
  // F8_E4M3 tensors under a config.json that declares no FP8: the scales would be unknown.
  test::TempDir tmp;
  RandomCheckpointSpec s{cfg, DType::bf16, 9, 1};
  s.fp8 = true;
  REQUIRE(write_random_checkpoint(tmp.path(), s).ok());
  auto j = nlohmann::json::parse(*read_file(tmp / "config.json"));
  j.erase("quantization_config");
  tmp.write("config.json", j.dump());
  const std::string e = load_error(tmp.path());
  CAPTURE(e);
  CHECK(contains(e, "F8_E4M3"));
  CHECK(contains(e, "no FP8 quantization_config"));
}

TEST_CASE("fp8: the model describes its checkpoint's weight format for /health and status") {
  test::TempDir tmp;
  RandomCheckpointSpec s{fp8_config(Family::qwen3_moe), DType::bf16, 3, 1};
  s.fp8 = true;
  REQUIRE(write_random_checkpoint(tmp.path(), s).ok());
  auto m = Model::load(tmp.path(), 0, 1);
  REQUIRE_MESSAGE(m.ok(), m.error().message);
  const auto j = (*m)->describe();
  CHECK(j["checkpoint_format"] == "fp8 e4m3, 128x128 block scales");
  // The projections stay FP8 (the CPU widens each as its product runs); norms, embeddings
  // and the router are fp32.
  CHECK(j["weights"] == "fp8+fp32");
}
