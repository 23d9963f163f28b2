// The engine on the CUDA device against Hugging Face transformers (the fp32 fixtures of
// tools/gen_reference.py) and through the scheduler. Without a GPU these print SKIP and
// return; SPARK_REQUIRE_GPU=1 makes that a failure.
//
// The bf16 bound: the GPU keeps weights, activations and KV in bf16 (8 significant bits,
// unit roundoff 2^-9 ~ 2e-3) and accumulates in fp32, as transformers does with
// torch_dtype=bfloat16. Measured on the H200 (tools/bf16_bound.py; bench/results/
// engine_gpu_bf16_bound-2026-12-01-h200.json), transformers' own bf16 run differs from its
// fp32 run by up to 0.107 (llama), 0.090 (mistral), 0.267 (qwen2, |logits| up to 50) and
// 0.066 (qwen3) over the same positions; the engine measured 0.074, 0.065, 0.163 and
// 0.048. The bound, kBf16LogitBound = 0.25, is the size of transformers' own bf16 spread:
// the engine must stay at least as close to the fp32 reference as transformers in bf16
// is, at every recorded position, teacher-forced along the reference's greedy path (fp32
// weights are rounded to bf16 once at load, as torch_dtype=bfloat16 does). The greedy token must
// equal the reference's at every step, except where the reference's own top-2 gap is below 2 x the
// bound (a bf16 near-tie): the test names such a step and prints the gap.
//
// A mixture of experts adds router near-ties: where the last chosen and the first unchosen
// expert's choice values (softmax probabilities or sigmoid scores, kRouterTie = 5e-3 apart at
// most) are within bf16's error of each other, the GPU may pick the other expert and the
// logits of that position and those after it move by more than the bound. Such a position is
// not covered by a looser bound: it is named with its margin (the twin's margins of the GPU's
// own router logits, Model::record_router_margins), and every other position keeps the bound.
// The scheduler's cases apply the same rule to greedy tokens: a flip behind such a tie on the
// reference's path (router_tie_step) is reported, any other must be a logit near-tie.
// transformers shows the same: on an H100 (bench/results/
// engine_gpu_bf16_bound-2026-12-06-h100.json, quantized fixtures through its dequantizing
// loader) its own bf16 run of the MoE fixtures moves the logits by up to 2.8 (deepseek_v3),
// 2.5 (mixtral) and 1.8 (gpt_oss) where the bf16 router picks another expert.
#include <doctest/doctest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string_view>

#include "core/strings.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/sampler.h"
#include "kernels/cuda_runtime.h"
#include "kernels/dtype.h"
#include "kernels/paged_attention.h"
#include "support/fp8_config.h"
#include "support/fp8_kv.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

constexpr double kBf16LogitBound = 0.25;
constexpr double kRouterTie = 5e-3;
const std::string kFixtures = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models";

std::vector<std::string> fixture_dirs() {
  std::vector<std::string> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(kFixtures, ec)) return out;
  for (const auto& e : std::filesystem::directory_iterator(kFixtures, ec)) {
    if (!std::filesystem::exists(e.path() / "reference.json")) continue;
    out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

double max_diff(const float* a, const nlohmann::json& b) {
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i].get<double>()));
  return worst;
}

std::shared_ptr<Device> cuda_or_skip() {
  if (test::skip_without_cuda()) return nullptr;
  auto d = make_cuda_device(0);
  REQUIRE_MESSAGE(d.ok(), (d.ok() ? std::string() : d.error().message));
  return *d;
}

double top2_gap(const nlohmann::json& top) {
  return top["logits"].size() < 2 ? 1e9
                                  : top["logits"][0].get<double>() - top["logits"][1].get<double>();
}

// Tokens `got` against the reference greedy ids: -1 when equal, else the step of the first
// difference, which must be a near-tie of the reference (else the test fails there), or come
// at or after `tie_from`, the first step behind a router near-tie (router_tie_step), where it
// is reported, not failed, as the bound test below does.
int check_greedy(const std::vector<int32_t>& got, const nlohmann::json& ref,
                 const std::string& what, int tie_from = INT_MAX, double bound = kBf16LogitBound) {
  const auto expect = ref["greedy_ids"].get<std::vector<int32_t>>();
  for (size_t s = 0; s < std::min(got.size(), expect.size()); ++s) {
    if (got[s] == expect[s]) continue;
    const double gap = top2_gap(ref["greedy_top"][s]);
    MESSAGE(what << ": greedy token differs at step " << s << " (got " << got[s] << ", reference "
                 << expect[s] << "); the reference's top-2 gap there is " << gap);
    if (static_cast<int>(s) >= tie_from) {
      MESSAGE(what << ": step " << s << " is behind a router near-tie (from step " << tie_from
                   << "): reported, not failed");
      return static_cast<int>(s);
    }
    CHECK_MESSAGE(gap < 2 * bound, "step " << s << " is not a near-tie: top-2 gap " << gap);
    return static_cast<int>(s);
  }
  CHECK(got.size() >= expect.size());
  return -1;
}

// A fresh engine on the CUDA device over fixture `dir` with `o` (blocks of 8 tokens), its
// KV cache in bf16.
std::unique_ptr<Engine> fixture_engine(const std::string& dir, EngineOptions o) {
  auto d = make_cuda_device(0);
  REQUIRE(d.ok());
  auto m = Model::load(dir, 0, 1, *d);
  REQUIRE(m.ok());
  o.block_size = 8;
  auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
  REQUIRE_MESSAGE(eng.ok(), (eng.ok() ? std::string() : eng.error().message));
  CHECK((*eng)->stats().kv_dtype == "bf16");
  return std::move(*eng);
}
std::unique_ptr<Engine> fixture_engine(const std::string& dir, int slots, int max_batch_tokens,
                                       bool graphs) {
  EngineOptions o;
  o.slots = slots;
  o.max_batch_tokens = max_batch_tokens;
  o.cuda_graphs = graphs;
  return fixture_engine(dir, o);
}

// The first greedy step of the reference's path that comes behind a router near-tie on this
// device (margin below kRouterTie, teacher-forced along the prompt and the reference's
// tokens, as the bound test below measures it), or INT_MAX: a dense model, or none on the
// path. Past such a tie the GPU may have picked another expert than transformers did, and
// its greedy tokens may leave the reference's with no logit near-tie.
int router_tie_step(const std::string& dir, const nlohmann::json& ref) {
  auto d = make_cuda_device(0);
  REQUIRE(d.ok());
  auto m = Model::load(dir, 0, 1, *d);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  auto& model = **m;
  if (!model.config().is_moe()) return INT_MAX;
  model.record_router_margins(true);
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const auto expect = ref["greedy_ids"].get<std::vector<int32_t>>();
  const int bs = 16;
  const int blocks = static_cast<int>(prompt.size() + expect.size()) / bs + 2;
  auto cache = model.make_kv_cache(blocks, bs, ElemType::bf16);
  REQUIRE(cache.ok());
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = i;
  LocalCollective one;
  std::vector<float> logits;
  auto tied = [&] {
    for (const auto& mg : model.router_margins())
      if (static_cast<double>(mg.last_chosen - mg.first_unchosen) < kRouterTie) return true;
    return false;
  };
  // The prompt's forward gives step 0's logits; token s's forward gives step s + 1's.
  SeqChunk ch{prompt.data(), static_cast<int>(prompt.size()), 0, table.data(), true};
  REQUIRE(model.forward({ch}, **cache, one, &logits, true).ok());
  if (tied()) return 0;
  std::vector<int32_t> seq = prompt;
  for (size_t s = 0; s + 1 < expect.size(); ++s) {
    seq.push_back(expect[s]);
    SeqChunk dch{&seq.back(), 1, static_cast<int>(seq.size()) - 1, table.data(), true};
    REQUIRE(model.forward({dch}, **cache, one, &logits).ok());
    if (tied()) return static_cast<int>(s) + 1;
  }
  return INT_MAX;
}

// Greedy sampling for the reference's steps, `n` choices.
SamplingParams greedy(const nlohmann::json& ref, int n) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = ref["greedy_steps"].get<int>();
  p.ignore_eos = true;
  p.n = n;
  return p;
}

}  // namespace

TEST_CASE("cuda engine: DEVICE=cpu|auto|cuda choose as documented") {
  std::string why;
  auto cpu = select_device("cpu", 0, &why);
  REQUIRE(cpu.ok());
  CHECK((*cpu)->info().kind == "cpu");
  auto bad = select_device("tpu", 0, &why);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("auto, cpu, cuda") != std::string::npos);
  why.clear();
  auto aut = select_device("auto", 0, &why);
  REQUIRE(aut.ok());
  const std::string skip = test::cuda_skip_reason();
  if (skip.empty()) {
    CHECK((*aut)->info().kind == "cuda");
    CHECK(why.empty());
    CHECK((*aut)->info().sm >= 90);
  } else {
    CHECK((*aut)->info().kind == "cpu");
    CHECK(why.find("DEVICE=auto chose the CPU") != std::string::npos);
    auto cuda = select_device("cuda", 0, &why);
    REQUIRE_FALSE(cuda.ok());
    CHECK(cuda.error().message.find("DEVICE=cuda") != std::string::npos);
    MESSAGE("SKIP (GPU half): " << skip);
  }
  // A bad setting of the CUDA device fails, GPU or not: auto does not hide it on the CPU.
  setenv("SPARK_CUDA_SHORT_ATTENTION", "many", 1);
  for (const char* choice : {"auto", "cuda"}) {
    CAPTURE(choice);
    why.clear();
    auto wrong = select_device(choice, 0, &why);
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.error().code == Errc::config);
    CHECK(wrong.error().message.find("SPARK_CUDA_SHORT_ATTENTION=many") != std::string::npos);
  }
  setenv("SPARK_CUDA_SHORT_ATTENTION", "-3", 1);
  CHECK(select_device("auto", 0, &why).error().code == Errc::config);
  unsetenv("SPARK_CUDA_SHORT_ATTENTION");
  // Latent attention's cap on its decode ranges: a count from 1 to 256.
  for (const char* value : {"many", "0", "257", "-1"}) {
    CAPTURE(value);
    setenv("SPARK_CUDA_MLA_SPLITS", value, 1);
    auto wrong = select_device("auto", 0, &why);
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.error().code == Errc::config);
    CHECK(wrong.error().message.find(std::string("SPARK_CUDA_MLA_SPLITS=") + value + ":") !=
          std::string::npos);
  }
  unsetenv("SPARK_CUDA_MLA_SPLITS");
  // The on/off switches take 0 or 1 only: "off" or "no" is not silently on.
  for (const char* var : {"SPARK_CUDA_PDL", "SPARK_CUDA_NORM_IN_PRODUCT", "SPARK_CUDA_FALLBACKS",
                          "SPARK_CUDA_MLA_SCALAR"}) {
    for (const char* value : {"off", "", "2"}) {
      CAPTURE(var);
      CAPTURE(value);
      setenv(var, value, 1);
      auto wrong = select_device("auto", 0, &why);
      REQUIRE_FALSE(wrong.ok());
      CHECK(wrong.error().code == Errc::config);
      CHECK(wrong.error().message.find(std::string(var) + "=" + value + ":") != std::string::npos);
    }
    unsetenv(var);
  }
  // The experts' form: auto, grouped, decode-mma or decode-fp32; a misspelling is an error.
  for (const char* value : {"decode", "mma", "fp32", ""}) {
    CAPTURE(value);
    setenv("SPARK_CUDA_MOE_FORM", value, 1);
    auto wrong = select_device("auto", 0, &why);
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.error().message.find(std::string("SPARK_CUDA_MOE_FORM=") + value + ":") !=
          std::string::npos);
  }
  // Each spelled value is taken (with or without a GPU: auto falls back to the CPU).
  for (const char* value : {"auto", "grouped", "decode-mma", "decode-fp32"}) {
    CAPTURE(value);
    setenv("SPARK_CUDA_MOE_FORM", value, 1);
    auto fine = select_device("auto", 0, &why);
    CHECK_MESSAGE(fine.ok(), (fine.ok() ? std::string() : fine.error().message));
  }
  unsetenv("SPARK_CUDA_MOE_FORM");
  // The FP8 prefill's path: auto, tensor-core or dequant.
  for (const char* value : {"tc", "tensor_core", "bf16", ""}) {
    CAPTURE(value);
    setenv("SPARK_CUDA_FP8_PREFILL", value, 1);
    auto wrong = select_device("auto", 0, &why);
    REQUIRE_FALSE(wrong.ok());
    CHECK(wrong.error().message.find(std::string("SPARK_CUDA_FP8_PREFILL=") + value + ":") !=
          std::string::npos);
  }
  for (const char* value : {"auto", "tensor-core", "dequant"}) {
    CAPTURE(value);
    setenv("SPARK_CUDA_FP8_PREFILL", value, 1);
    auto fine = select_device("auto", 0, &why);
    CHECK_MESSAGE(fine.ok(), (fine.ok() ? std::string() : fine.error().message));
  }
  unsetenv("SPARK_CUDA_FP8_PREFILL");
}

TEST_CASE("cuda engine: logits within the bf16 bound of transformers, greedy tokens agree") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  const auto dirs = fixture_dirs();
  REQUIRE_MESSAGE(!dirs.empty(), "no reference fixtures under " << kFixtures);
  for (const auto& dir : dirs) {
    CAPTURE(dir);
    auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
    // KV_DTYPE=fp8 (e4m3) adds its own stated bound to the bf16 one (not for latent
    // attention, which refuses it).
    for (const std::string kv : {"bf16", "fp32", "fp8"}) {
      CAPTURE(kv);
      // (fp8's is relative: of the fixture's largest |logit| at the recorded prompt
      // positions; and its rounding moves router choices at wider near-ties.)
      double scale = 1;
      for (const auto& row : ref["prompt_logits"])
        for (const auto& v : row) scale = std::max(scale, std::abs(v.get<double>()));
      auto d = make_cuda_device(0);
      REQUIRE(d.ok());
      LoadReport rep;
      auto m = Model::load(dir, 0, 1, *d, &rep);
      REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
      auto& model = **m;
      const auto& c = model.config();
      const size_t V = static_cast<size_t>(c.vocab_size);
      CHECK(rep.device.find("sm_") != std::string::npos);
      // Weights in device memory: the norms' weights are folded into q/k/v and gate/up.
      // (Not latent attention's: its input norm feeds q_a and kv_a, which stay unfolded; nor
      // into FP8 weights kept as stored.)
      const bool fp8 = model.describe()["weights"].get<std::string>().rfind("fp8", 0) == 0;
      CHECK(model.norms_folded() == (rep.bytes_in_place == 0 && !c.is_mla() && !fp8));
      // FP8 weights' prompt runs on the FP8 tensor cores where the GPU has them, which round
      // the activations to e4m3 as the fp8 cache rounds K and V: the same relative bound
      // again, and the same near-tie excuse.
      const double bound = kBf16LogitBound + (kv == "fp8" ? test::kFp8KvLogitBound * scale : 0.0) +
                           (fp8 ? test::kFp8ActLogitBound * scale : 0.0);
      const double router_tie = kv == "fp8" || fp8 ? test::kFp8RouterTie : kRouterTie;
      std::vector<int32_t> prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
      const int steps = ref["greedy_steps"].get<int>();
      const int bs = 16;
      const int blocks = (static_cast<int>(prompt.size()) + steps) / bs + 2;
      if (kv == "fp8" && c.is_mla()) continue;
      auto cache = model.make_kv_cache(blocks, bs,
                                       kv == "bf16"  ? ElemType::bf16
                                       : kv == "fp8" ? ElemType::fp8_e4m3
                                                     : ElemType::f32);
      REQUIRE(cache.ok());
      std::vector<int32_t> table(static_cast<size_t>(blocks));
      for (int i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = blocks - 1 - i;
      LocalCollective one;
      std::vector<float> logits;
      SeqChunk ch{prompt.data(), static_cast<int>(prompt.size()), 0, table.data(), true};
      // The smallest router margin up to each position (MoE models; +inf for dense ones).
      model.record_router_margins(c.is_moe());
      double margin_upto = INFINITY;
      auto take_margins = [&]() {
        for (const auto& mg : model.router_margins())
          margin_upto =
              std::min(margin_upto, static_cast<double>(mg.last_chosen - mg.first_unchosen));
      };
      REQUIRE(model.forward({ch}, **cache, one, &logits, true).ok());
      take_margins();
      double worst = 0;
      int router_ties = 0;
      // A position over the bound is excused only by a router near-tie at or before it.
      auto account = [&](double diff, int pos) {
        if (diff > bound && margin_upto < router_tie) {
          ++router_ties;
          MESSAGE(dir << ": position " << pos << " differs by " << diff
                      << " after a router near-tie (margin " << margin_upto << " < " << router_tie
                      << ")");
          return;
        }
        worst = std::max(worst, diff);
      };
      const auto& positions = ref["prompt_logits_positions"];
      for (size_t r = 0; r < positions.size(); ++r)
        account(max_diff(logits.data() + positions[r].get<size_t>() * V, ref["prompt_logits"][r]),
                positions[r].get<int>());
      // Teacher-forced along the reference's greedy path, so every step's logits compare.
      const auto expect = ref["greedy_ids"].get<std::vector<int32_t>>();
      std::vector<int32_t> seq = prompt, got;
      std::vector<float> last(logits.end() - static_cast<ptrdiff_t>(V), logits.end());
      for (int s = 0; s < steps; ++s) {
        const auto key = std::to_string(s);
        const int pos = static_cast<int>(seq.size()) - 1;
        if (ref["greedy_full_logits"].contains(key))
          account(max_diff(last.data(), ref["greedy_full_logits"][key]), pos);
        const auto& top = ref["greedy_top"][static_cast<size_t>(s)];
        for (size_t k = 0; k < top["ids"].size(); ++k)
          account(std::abs(last[top["ids"][k].get<size_t>()] - top["logits"][k].get<double>()),
                  pos);
        got.push_back(
            static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
        seq.push_back(expect[static_cast<size_t>(s)]);
        SeqChunk dch{&seq.back(), 1, static_cast<int>(seq.size()) - 1, table.data(), true};
        if (s + 1 < steps) {
          REQUIRE(model.forward({dch}, **cache, one, &last).ok());
          take_margins();
        }
      }
      // With a router near-tie behind it, a greedy flip is reported, not failed.
      const int flip =
          router_ties > 0 ? -1 : check_greedy(got, ref, "teacher-forced", INT_MAX, bound);
      MESSAGE(dir << " on " << rep.device << ", weights " << ref["weights_dtype"].get<std::string>()
                  << ", KV " << kv << ": max |logit diff| " << worst << " (bound " << bound
                  << "), greedy steps " << steps << ", first near-tie flip " << flip
                  << ", router near-tie positions " << router_ties << ", smallest router margin "
                  << margin_upto);
      CHECK(steps >= 64);
      CHECK(worst <= bound);
    }
  }
}

TEST_CASE(
    "cuda engine: the scheduler (chunked prefill, n=2, n=8, prefix cache) keeps greedy tokens") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  for (const auto& dir : fixture_dirs()) {
    CAPTURE(dir);
    auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
    // (GLM-4.5's fixture has a router near-tie in its prompt, margin 2.4e-4: with the
    // pre-Hopper attention its n = 8 decode leaves the reference at step 36, top-2 gap 0.75.)
    const int tie = router_tie_step(dir, ref);
    for (bool graphs : {true, false}) {
      CAPTURE(graphs);
      // Batches of 5 tokens: the prompt prefills in uneven chunks next to decodes.
      auto eng = fixture_engine(dir, 2, 5, graphs);
      const SamplingParams p = greedy(ref, 2);
      const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
      auto r = generate_blocking(*eng, prompt, p);
      REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
      check_greedy(r->tokens[0], ref, "scheduler choice 0", tie);
      check_greedy(r->tokens[1], ref, "scheduler choice 1", tie);
      auto again = generate_blocking(*eng, prompt, p);  // now from the prefix cache
      REQUIRE(again.ok());
      CHECK(again->cached_prompt_tokens > 0);
      check_greedy(again->tokens[0], ref, "prefix-cached", tie);
      // n = 8: every decode step has 8 rows, which the CUDA device runs through the own
      // kernel's tensor-core form (3 to 8 rows) with RoPE inside and, on the bf16 fixtures
      // (norm weights folded), the norms and SwiGLU too; prefill in chunks of up to 6 tokens
      // takes the same path.
      auto eng8 = fixture_engine(dir, 8, 6, graphs);
      auto r8 = generate_blocking(*eng8, prompt, greedy(ref, 8));
      REQUIRE_MESSAGE(r8.ok(), (r8.ok() ? std::string() : r8.error().message));
      REQUIRE(r8->tokens.size() == 8);
      for (int c = 0; c < 8; ++c)
        check_greedy(r8->tokens[c], ref, "n=8 choice " + std::to_string(c), tie);
    }
  }
}

TEST_CASE("cuda engine: overlapped decode gives the tokens and logprobs of steps one by one") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  for (const auto& dir : fixture_dirs()) {
    CAPTURE(dir);
    auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    // One request at a time, so both engines run the same steps on the same kernels: the
    // results must be the same bits.
    std::vector<BlockingResult> runs[2];
    uint64_t ahead[2] = {0, 0};
    for (int overlap : {0, 1}) {
      CAPTURE(overlap);
      EngineOptions o;
      o.slots = 2;
      o.overlap_decode = overlap == 1;
      auto eng = fixture_engine(dir, o);
      const SamplingParams g = greedy(ref, 1);
      auto r = generate_blocking(*eng, prompt, g);
      REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
      check_greedy(r->tokens[0], ref, overlap ? "overlapped" : "one by one");
      runs[overlap].push_back(*r);
      SamplingParams s;
      s.temperature = 0.8f;
      s.top_p = 0.95f;
      s.seed = 1234;
      s.n = 2;
      s.max_tokens = 40;
      s.logprobs = true;
      s.ignore_eos = true;
      auto sr = generate_blocking(*eng, prompt, s);
      REQUIRE(sr.ok());
      runs[overlap].push_back(*sr);
      // A stop id mid-stream: the step queued after it is dropped. Taken from a greedy run
      // over the cached prompt, as the stopped run's is: the first run prefilled it whole,
      // and at a fixture's near-tie (gpt-oss's) the two paths may pick different tokens.
      auto cached = generate_blocking(*eng, prompt, g);
      REQUIRE(cached.ok());
      CHECK(cached->cached_prompt_tokens > 0);
      runs[overlap].push_back(*cached);
      SamplingParams st = g;
      st.stop_token_ids = {cached->tokens[0][10]};
      auto stopped = generate_blocking(*eng, prompt, st);
      REQUIRE(stopped.ok());
      CHECK(stopped->finish[0] == FinishReason::stop);
      runs[overlap].push_back(*stopped);
      ahead[overlap] = eng->stats().steps_queued_ahead;
      CHECK(eng->stats().blocks_available == eng->stats().blocks_total);
    }
    CHECK(ahead[0] == 0);
    CHECK(ahead[1] > 0);
    for (size_t i = 0; i < runs[0].size(); ++i) {
      CAPTURE(i);
      CHECK(runs[1][i].tokens == runs[0][i].tokens);
      CHECK(runs[1][i].finish == runs[0][i].finish);
      CHECK(runs[1][i].logprobs == runs[0][i].logprobs);
    }
  }
}

TEST_CASE("cuda engine: a decode that outgrows the short-context graph goes on in the other") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  const std::string dir = kFixtures + "/llama";
  auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
  const auto cfg = nlohmann::json::parse(*read_file(dir + "/config.json"));
  const int head_dim = cfg["hidden_size"].get<int>() / cfg["num_attention_heads"].get<int>();
  if (kernels::attention_decode_short_max(head_dim, kernels::DType::bf16) == 0) {
    MESSAGE(
        "SKIP: this GPU has no short-context decode attention (before sm_90, no cluster "
        "launch, or SPARK_CUDA_FALLBACKS=1): no short-context graph to outgrow");
    return;
  }
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const int steps = ref["greedy_steps"].get<int>();
  // The short-context attention capped halfway through the decode: the bucket's
  // short-context graph serves the first half, the long-context graph the rest.
  const int cap = static_cast<int>(prompt.size()) + steps / 2;
  struct Env {
    explicit Env(const std::string& v) { setenv("SPARK_CUDA_SHORT_ATTENTION", v.c_str(), 1); }
    ~Env() { unsetenv("SPARK_CUDA_SHORT_ATTENTION"); }
  };
  std::map<std::string, std::vector<int32_t>> tokens;
  for (const std::string& setting :
       {std::to_string(cap) + " graphs", std::to_string(cap) + " eager",
        std::string("uncapped graphs")}) {
    CAPTURE(setting);
    const bool graphs = setting.ends_with("graphs");
    std::optional<Env> env;
    if (!setting.starts_with("uncapped")) env.emplace(std::to_string(cap));
    auto d = make_cuda_device(0);
    REQUIRE(d.ok());
    auto m = Model::load(dir, 0, 1, *d);
    REQUIRE(m.ok());
    Model* model = m->get();
    EngineOptions o;
    o.slots = 1;
    o.block_size = 8;
    o.cuda_graphs = graphs;
    auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
    REQUIRE_MESSAGE(eng.ok(), (eng.ok() ? std::string() : eng.error().message));
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = steps;
    p.ignore_eos = true;
    auto r = generate_blocking(**eng, prompt, p);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
    check_greedy(r->tokens[0], ref, setting);
    tokens[setting] = r->tokens[0];
    MESSAGE(setting << ": " << model->graph_captures() << " graph captures, "
                    << model->graph_replays() << " replays");
    if (setting == std::to_string(cap) + " graphs") {
      CHECK(model->graph_captures() == 2);  // bucket 1: short-context, then the other
      CHECK(model->graph_replays() >= static_cast<uint64_t>(steps - 4));
    } else if (graphs) {
      CHECK(model->graph_captures() == 1);  // every context within the short bound
    }
    (*eng)->stop();
  }
  // The same kernels on the same contexts, replayed or not: the same tokens.
  CHECK(tokens[std::to_string(cap) + " graphs"] == tokens[std::to_string(cap) + " eager"]);
}

TEST_CASE("cuda engine: cancel frees the slot; seeds repeat; a too-small memory fails at start") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  // A dense model and a mixture of experts (groups, a correction bias, a shared expert).
  for (const std::string& dir : {kFixtures + "/llama", kFixtures + "/glm4_moe"}) {
    CAPTURE(dir);
    {
      auto m = Model::load(dir, 0, 1, dev);
      REQUIRE(m.ok());
      EngineOptions o;
      o.slots = 1;
      o.max_context = 256;
      auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
      REQUIRE(eng.ok());
      SamplingParams p;
      p.temperature = 0.8f;
      p.top_p = 0.9f;
      p.seed = 7;
      p.max_tokens = 200;
      p.ignore_eos = true;
      std::atomic<int> seen{0};
      std::atomic<bool> cancelled{false};
      auto id = (*eng)->submit({{1, 2, 3}, p, [&](const TokenEvent& e) {
                                  if (e.token >= 0) ++seen;
                                  if (e.finish == FinishReason::cancelled) cancelled = true;
                                }});
      REQUIRE(id.ok());
      while (seen.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      (*eng)->cancel(*id);
      p.max_tokens = 16;
      auto a = generate_blocking(**eng, {1, 2, 3}, p);  // gets the only slot once it is freed
      REQUIRE_MESSAGE(a.ok(), (a.ok() ? std::string() : a.error().message));
      CHECK(cancelled.load());
      CHECK(seen.load() < 200);
      auto b = generate_blocking(**eng, {1, 2, 3}, p);
      REQUIRE(b.ok());
      CHECK(a->tokens[0].size() == 16);
      CHECK(a->tokens[0] == b->tokens[0]);  // same seed, same tokens
    }
    {
      auto m = Model::load(dir, 0, 1, dev);
      REQUIRE(m.ok());
      EngineOptions o;
      o.kv_from_free_memory = true;
      o.mem_reserve = 1ull << 50;  // leaves nothing for the KV cache
      auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
      REQUIRE_FALSE(eng.ok());
      CHECK(eng.error().code == Errc::resource);
      CHECK(eng.error().message.find("largest context that fits is 0 tokens") != std::string::npos);
      MESSAGE(eng.error().message);
    }
  }
}

TEST_CASE("cuda engine: penalties drawn on the device pick the host sampler's token") {
  // The same logits (one forward) drawn twice: by the host Sampler, which keeps the penalty
  // state, and by the device from the sequence's token list. The two samplers share their
  // arithmetic (sampler_core.h), so they must pick the same token in every row.
  auto dev = cuda_or_skip();
  if (!dev) return;
  const auto dirs = fixture_dirs();
  REQUIRE(!dirs.empty());
  auto m = Model::load(dirs.front(), 0, 1, dev);
  REQUIRE(m.ok());
  auto& model = **m;
  const int V = model.config().vocab_size;
  const int bs = 16, blocks = 8;
  auto cache = model.make_kv_cache(blocks, bs, ElemType::bf16);
  REQUIRE(cache.ok());
  LocalCollective one;
  // Three sequences; the penalty lists are each prompt plus an "output" that holds the
  // row's most likely token twice (so the penalties change the draw) and one other.
  std::vector<std::vector<int32_t>> seqs = {
      {5, 9, 5, 5, 12, 9, 9, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {7, 7, 7, 7, 7}};
  std::vector<std::vector<int32_t>> tables(seqs.size());
  std::vector<SeqChunk> chunks;
  for (size_t i = 0; i < seqs.size(); ++i) {
    tables[i] = {static_cast<int32_t>(2 * i), static_cast<int32_t>(2 * i + 1)};
    chunks.push_back({seqs[i].data(), static_cast<int>(seqs[i].size()), 0, tables[i].data(), true});
  }
  std::vector<float> logits;
  REQUIRE(model.forward(chunks, **cache, one, &logits).ok());
  REQUIRE(logits.size() == seqs.size() * static_cast<size_t>(V));
  std::vector<std::vector<int32_t>> lists = seqs;
  std::vector<int> out_start;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const float* row = logits.data() + i * static_cast<size_t>(V);
    const auto top = static_cast<int32_t>(std::max_element(row, row + V) - row);
    out_start.push_back(static_cast<int>(lists[i].size()));
    lists[i].insert(lists[i].end(), {top, static_cast<int32_t>(i + 20), top});
  }
  struct Case {
    float temp, rep, presence, freq;
  } cases[] = {{0, 1.8f, 0, 0}, {0, 1, 1.5f, 1.0f}, {1, 1.3f, 0.5f, 0.5f}, {0.7f, 0.6f, -1, 2}};
  int differ_from_plain = 0;
  for (const auto& c : cases)
    for (uint64_t seed : {1u, 2u, 3u}) {
      CAPTURE(c.temp);
      CAPTURE(c.rep);
      CAPTURE(seed);
      std::vector<kernels::SampleParams> params;
      std::vector<Device::PenaltyHistory> history;
      std::vector<int32_t> host;
      for (size_t i = 0; i < seqs.size(); ++i) {
        SamplingParams p;
        p.temperature = c.temp;
        p.repetition_penalty = c.rep;
        p.presence_penalty = c.presence;
        p.frequency_penalty = c.freq;
        p.seed = seed;
        p.logprobs = true;
        const auto& l = lists[i];
        Sampler smp(p, V, std::vector<int32_t>(l.begin(), l.begin() + out_start[i]), i);
        for (size_t t = static_cast<size_t>(out_start[i]); t < l.size(); ++t) smp.record(l[t]);
        params.push_back(smp.next_params());
        history.push_back({l.data(), static_cast<int>(l.size()), out_start[i]});
        host.push_back(smp.sample(logits.data() + i * static_cast<size_t>(V)).token);
        const auto plain = kernels::sample_ref(logits.data() + i * static_cast<size_t>(V), V,
                                               params.back(), nullptr, nullptr);
        differ_from_plain += plain.token != host.back();
      }
      std::vector<kernels::SampleResult> drawn;
      REQUIRE(model.forward_sample(chunks, **cache, one, params, &drawn, history).ok());
      REQUIRE(drawn.size() == seqs.size());
      for (size_t i = 0; i < seqs.size(); ++i) {
        CAPTURE(i);
        CHECK(drawn[i].token == host[i]);
      }
    }
  // The penalties matter here (else the check above could not tell them from none).
  MESSAGE(differ_from_plain << " of " << 12 * seqs.size()
                            << " draws differ from the same draw without penalties");
  CHECK(differ_from_plain > 0);
}

// The model in `dir` on the CUDA device against the CPU device, step by step: two sequences
// with interleaved blocks, A's prompt in two chunks (the second over a cached prefix) next to
// B's in one, then both decoding together on the CPU's greedy tokens; eager, then through
// CUDA graphs (whose tokens must be the eager steps'). Logits within the bf16 bound, and
// only a near-tie (or a router near-tie) may pick another token. `on_gpu_model` checks each
// CUDA model once loaded.
// `rel_bound` widens the logit bound by that fraction of the step's largest |logit| (the
// FP8 tensor cores' activation rounding), with `router_tie` the router margin under which a
// moved route is excused.
static void cuda_matches_cpu(const std::string& dir, const std::string& what,
                             const std::function<void(Model&)>& on_gpu_model = {},
                             double rel_bound = 0, double router_tie = kRouterTie) {
  auto h = Model::load(dir, 0, 1);
  REQUIRE(h.ok());
  Model& cpu = **h;
  const auto& c = cpu.config();
  const size_t V = static_cast<size_t>(c.vocab_size);
  const int bs = 8, blocks = 16;
  LocalCollective one;
  // Two sequences with interleaved blocks: A's prompt in two chunks (the second over a cached
  // prefix) next to B's in one, then both decode together on the CPU's greedy tokens.
  const std::vector<int32_t> ta = {9, 2, 14, 5, 0, 11, 7, 3}, tb = {1, 12, 6, 15, 4, 10, 8, 13};
  std::vector<int32_t> A, B;
  for (int i = 0; i < 13; ++i) A.push_back((i * 7 + 3) % c.vocab_size);
  for (int i = 0; i < 9; ++i) B.push_back((i * 5 + 1) % c.vocab_size);
  A.reserve(64), B.reserve(64);  // the chunks point into them
  struct Step {
    std::vector<SeqChunk> chunks;
    bool all = false;
  };
  std::vector<Step> steps;
  std::vector<std::vector<float>> want;  // the CPU's logits per step
  auto argmax = [&](const float* row) {
    return static_cast<int32_t>(std::max_element(row, row + V) - row);
  };
  {
    auto cc = cpu.make_kv_cache(blocks, bs, ElemType::f32);
    REQUIRE(cc.ok());
    auto run_cpu = [&](Step st) {
      std::vector<float> lg;
      REQUIRE(cpu.forward(st.chunks, **cc, one, &lg, st.all).ok());
      steps.push_back(std::move(st));
      want.push_back(lg);
      return lg;
    };
    run_cpu({{SeqChunk{A.data(), 6, 0, ta.data(), true}, SeqChunk{B.data(), 9, 0, tb.data(), true}},
             true});
    auto lg = run_cpu({{SeqChunk{A.data() + 6, 7, 6, ta.data(), true}}, false});
    A.push_back(argmax(lg.data()));
    B.push_back(B.back());
    for (int s = 0; s < 8; ++s) {
      const int pa = static_cast<int>(A.size()) - 1, pb = static_cast<int>(B.size()) - 1;
      lg = run_cpu({{SeqChunk{A.data() + pa, 1, pa, ta.data(), true},
                     SeqChunk{B.data() + pb, 1, pb, tb.data(), true}},
                    false});
      A.push_back(argmax(lg.data()));
      B.push_back(argmax(lg.data() + V));
    }
  }
  auto top2_gap_of = [&](const float* row) {
    std::vector<float> r(row, row + V);
    std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<float>());
    return static_cast<double>(r[0] - r[1]);
  };
  // Eager with the router's margins recorded (a near-tie may route another expert from there
  // on), then through CUDA graphs (decode captured, then replayed; the margins are host reads,
  // so not recorded there): the graphs' steps must give the eager steps' tokens.
  std::vector<int32_t> eager_tokens;
  std::vector<bool> excused(steps.size(), false);
  for (bool graphs : {false, true}) {
    CAPTURE(graphs);
    auto d = make_cuda_device(0);
    REQUIRE(d.ok());
    auto g = Model::load(dir, 0, 1, *d);
    REQUIRE_MESSAGE(g.ok(), (g.ok() ? std::string() : g.error().message));
    Model& gpu = **g;
    if (on_gpu_model) on_gpu_model(gpu);
    REQUIRE(gpu.prepare(32, 2, blocks / 2 * bs, bs, graphs).ok());
    auto gc = gpu.make_kv_cache(blocks, bs, ElemType::bf16);
    REQUIRE(gc.ok());
    gpu.record_router_margins(!graphs);
    double margin_upto = INFINITY, worst = 0;
    std::vector<int32_t> tokens;
    for (size_t i = 0; i < steps.size(); ++i) {
      CAPTURE(i);
      std::vector<float> lg;
      REQUIRE(gpu.forward(steps[i].chunks, **gc, one, &lg, steps[i].all).ok());
      REQUIRE(lg.size() == want[i].size());
      for (const auto& mg : gpu.router_margins())
        margin_upto =
            std::min(margin_upto, static_cast<double>(mg.last_chosen - mg.first_unchosen));
      if (!graphs && margin_upto < router_tie) excused[i] = true;
      double diff = 0, largest = 0;
      for (size_t k = 0; k < lg.size(); ++k) {
        diff = std::max(diff, std::abs(static_cast<double>(lg[k]) - want[i][k]));
        largest = std::max(largest, std::abs(static_cast<double>(want[i][k])));
      }
      const double bound = kBf16LogitBound + rel_bound * largest;
      if (excused[i]) {
        MESSAGE("step " << i << ": logits " << diff << " apart after a router near-tie");
      } else {
        CHECK(diff <= bound);
        worst = std::max(worst, diff);
      }
      if (i < 2) continue;
      for (size_t k = 0; k < 2; ++k) {
        const int32_t gt = argmax(lg.data() + k * V), ct = argmax(want[i].data() + k * V);
        tokens.push_back(gt);
        // Only a bf16 near-tie of the CPU's logits (or a router tie) may pick another token.
        if (gt != ct && !excused[i])
          CHECK_MESSAGE(top2_gap_of(want[i].data() + k * V) < 2 * bound,
                        "step " << i << " sequence " << k << ": greedy " << gt << " vs " << ct);
      }
    }
    MESSAGE(what << " on CUDA" << (graphs ? " (graphs)" : "") << " vs the CPU: max |logit diff| "
                 << worst << " (bound " << kBf16LogitBound << " + " << rel_bound
                 << " of the largest |logit|)");
    if (graphs) {
      CHECK(gpu.graph_captures() >= 1);
      CHECK(gpu.graph_replays() >= 1);
      CHECK(tokens == eager_tokens);
    } else {
      eager_tokens = tokens;
    }
  }
}

TEST_CASE("cuda engine: latent attention (DeepSeek-V3) gives the CPU device's logits and tokens") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::deepseek_v3), DType::bf16, 3, 1})
          .ok());
  REQUIRE(load_model_config(dir.path())->is_mla());
  cuda_matches_cpu(dir.path(), "DeepSeek-V3");
}

TEST_CASE(
    "cuda engine: gpt-oss (sinks, sliding windows, MXFP4 experts) gives the CPU device's logits") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::gpt_oss), DType::bf16, 5, 1}).ok());
  REQUIRE(load_model_config(dir.path())->family == Family::gpt_oss);
  // Its experts stay MXFP4, packed as stored (the expert launch's MXFP4 forms).
  cuda_matches_cpu(dir.path(), "gpt-oss",
                   [](Model& m) { CHECK(m.describe()["weights"] == "mxfp4+bf16"); });
}

TEST_CASE(
    "cuda engine: gpt-oss's sliding layers kept apart give whole contexts' tokens and logprobs") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  test::TempDir dir;
  auto cfg = small_config(Family::gpt_oss);
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::bf16, 41, 1}).ok());
  // Windows of 8, blocks of 8, steps of up to 8 tokens: a ring of 2 blocks a sequence, which
  // the 45-token prompt and the 40 tokens after it wrap many times.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 45; ++i) prompt.push_back((i * 53 + 7) % (cfg.vocab_size - 3) + 3);
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 40;
  p.ignore_eos = true;
  p.logprobs = true;
  p.n = 2;
  for (bool graphs : {true, false}) {
    CAPTURE(graphs);
    std::optional<BlockingResult> whole;
    uint64_t whole_bytes = 0;
    for (bool apart : {false, true}) {
      CAPTURE(apart);
      EngineOptions o;
      o.slots = 2;
      o.max_batch_tokens = 8;
      o.cuda_graphs = graphs;
      o.window_kv = apart;
      auto eng = fixture_engine(dir.path(), o);
      CHECK(eng->stats().window_ring_blocks == (apart ? 2 : 0));
      auto r = generate_blocking(*eng, prompt, p);
      REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
      if (!apart) {
        whole = *r;
        whole_bytes = eng->stats().kv_bytes;
        continue;
      }
      CHECK(eng->stats().kv_bytes < whole_bytes);
      // The same kernels read the same values: the same tokens and logprobs.
      for (int c = 0; c < 2; ++c) {
        CAPTURE(c);
        CHECK(r->tokens[static_cast<size_t>(c)] == whole->tokens[static_cast<size_t>(c)]);
        double worst = 0;
        for (size_t i = 0; i < r->logprobs[static_cast<size_t>(c)].size(); ++i)
          worst = std::max(
              worst, static_cast<double>(std::abs(r->logprobs[static_cast<size_t>(c)][i] -
                                                  whole->logprobs[static_cast<size_t>(c)][i])));
        CHECK(worst <= 1e-3);
      }
      // A prefix hit (5 blocks) recomputes the window's reach for the ring (7 tokens: one
      // windowed layer of the two), 33 not computed; the whole context keeps all 40.
      auto again = generate_blocking(*eng, prompt, p);
      REQUIRE(again.ok());
      CHECK(again->cached_prompt_tokens == 40 - 7);
      for (int c = 0; c < 2; ++c)
        CHECK(again->tokens[static_cast<size_t>(c)].front() ==
              whole->tokens[static_cast<size_t>(c)].front());
    }
  }
}

TEST_CASE("cuda engine: FP8 weights kept as stored give the CPU device's logits and tokens") {
  auto dev = cuda_or_skip();
  if (!dev) return;
  for (Family f : {Family::qwen3, Family::qwen3_moe}) {
    const std::string name = architecture_name(f);
    CAPTURE(name);
    // Every projection whole 128-blocks; decode steps run the FP8 kernel (dense) or the FP8
    // experts, the 15-row prefill chunk the dequantized tiles (SPARK_CUDA_FP8_PREFILL=dequant:
    // the bf16 bound) or the FP8 tensor cores (12 rows, the last 3 on the decode kernel;
    // required, so a product they did not take fails the step), whose activations' rounding
    // to e4m3 adds test::kFp8ActLogitBound of the step's largest |logit| and may move a
    // router choice at a margin under test::kFp8RouterTie.
    const auto c = test::fp8_config(f);
    test::TempDir dir;
    RandomCheckpointSpec spec{c, DType::bf16, 7, 1};
    spec.fp8 = true;
    REQUIRE(write_random_checkpoint(dir.path(), spec).ok());
    auto lim = kernels::cuda_device_limits(0);
    REQUIRE(lim.ok());
    for (const char* mode : {"dequant", "tensor-core"}) {
      CAPTURE(mode);
      if (std::string_view(mode) == "tensor-core" && lim->cc_major != 9) {
        MESSAGE(
            "the FP8 tensor-core prefill is Hopper's (cuBLASLt's block-scaled FP8): not "
            "on sm_"
            << lim->cc_major << lim->cc_minor);
        continue;
      }
      setenv("SPARK_CUDA_FP8_PREFILL", mode, 1);
      const bool tc = std::string_view(mode) == "tensor-core";
      cuda_matches_cpu(
          dir.path(), name + " FP8 (" + mode + ")",
          [](Model& m) { CHECK(m.describe()["weights"] == "fp8+bf16"); },
          tc ? test::kFp8ActLogitBound : 0.0, tc ? test::kFp8RouterTie : kRouterTie);
    }
    unsetenv("SPARK_CUDA_FP8_PREFILL");
  }
}

// gpt-oss's experts (biases, interleaved gate/up, the clamped activation) through the CUDA
// device's moe_experts against the CPU device's, on the same bf16 values and the routes each
// device's router picks from logits a unit apart (no near-ties): the decode form (3 rows)
// and the grouped form (40 rows), with the down bias and without. The CPU keeps the
// activation in fp32 where the GPU rounds it to bf16: each output within two bf16 ulps plus
// 2% of its row's mean |output|. This is the engine's experts call as the MoE block makes it.
TEST_CASE("cuda engine: gpt-oss's experts on the CUDA device give the CPU device's sums") {
  auto cuda = cuda_or_skip();
  if (!cuda) return;
  auto cpu = make_cpu_device();
  const int H = 256, I = 128, E = 8, K = 4;
  std::mt19937 rng(20261205);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto fill = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& f : v) f = kernels::round_to(kernels::DType::bf16, scale * u(rng));
    return v;
  };
  const size_t Hs = H, Is = I, Es = E;
  const auto gu = fill(Es * 2 * Is * Hs, 12.f / 16.f), gub = fill(Es * 2 * Is, 2.f);
  const auto dn = fill(Es * Hs * Is, 1.f / std::sqrt(float(I))), db = fill(Es * Hs, 1.f);
  // One device's buffer of host floats in `type`.
  auto put = [](Device& d, ElemType type, const std::vector<float>& v) {
    auto b = d.alloc(type, v.size());
    REQUIRE_MESSAGE(b.ok(), (b.ok() ? std::string() : b.error().message));
    REQUIRE(d.upload(*b, v.data(), DType::f32).ok());
    return *b;
  };
  for (const int rows : {3, 40}) {
    for (const bool down_bias : {true, false}) {
      CAPTURE(rows);
      CAPTURE(down_bias);
      const size_t R = static_cast<size_t>(rows);
      const auto x = fill(R * Hs, 1.f);
      // Router logits: each row a permutation of 0, 1, ..., E - 1 (a unit between experts).
      std::vector<float> logits(R * Es);
      std::vector<int> perm(Es);
      std::iota(perm.begin(), perm.end(), 0);
      for (size_t r = 0; r < R; ++r) {
        std::shuffle(perm.begin(), perm.end(), rng);
        for (size_t e = 0; e < Es; ++e) logits[r * Es + e] = static_cast<float>(perm[e]);
      }
      std::vector<std::vector<float>> outs;
      for (Device* d : {cpu.get(), cuda.get()}) {
        const ElemType ct = d->compute_type(), vt = d->vector_type();
        const Buffer bx = put(*d, ct, x), bgu = put(*d, ct, gu), bdn = put(*d, ct, dn);
        const Buffer bgub = put(*d, vt, gub), bdb = put(*d, vt, db);
        const Buffer blg = put(*d, ElemType::f32, logits);
        auto ids = d->alloc(ElemType::i32, R * K);
        auto wts = d->alloc(ElemType::f32, R * K);
        auto out = d->alloc(ct, R * Hs);
        REQUIRE((ids.ok() && wts.ok() && out.ok()));
        Device::MoeRoute rt;
        rt.experts = E, rt.top_k = K, rt.norm_topk = true;
        REQUIRE(d->moe_route(blg, Buffer(), rt, *ids, *wts, rows).ok());
        Device::MoeExperts e;
        e.gate_up = &bgu, e.down = &bdn, e.expert0 = 0, e.experts = E;
        e.inter = I, e.hidden = H, e.top_k = K;
        const Buffer none;
        e.shared_gate_up = &none, e.shared_down = &none, e.shared_inter = 0;
        e.gate_up_bias = &bgub, e.down_bias = down_bias ? &bdb : &none;
        e.interleaved = true, e.swiglu_limit = 7.f, e.swiglu_alpha = 1.702f;
        REQUIRE_FALSE(e.plain());
        const auto s = d->moe_experts(bx, *ids, *wts, e, *out, rows);
        REQUIRE_MESSAGE(s.ok(), s.message());
        REQUIRE(d->synchronize().ok());
        std::vector<float> o(R * Hs);
        REQUIRE(d->to_host(*out, o.data(), o.size()).ok());
        outs.push_back(std::move(o));
      }
      const auto& want = outs[0];
      const auto& got = outs[1];
      size_t bad = 0;
      double worst = 0;
      for (size_t r = 0; r < R; ++r) {
        double mean = 0;
        for (size_t h = 0; h < Hs; ++h) mean += std::fabs(want[r * Hs + h]);
        mean /= static_cast<double>(Hs);
        for (size_t h = 0; h < Hs; ++h) {
          const size_t i = r * Hs + h;
          const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want[i]), 1e-30f)) - 7);
          const double err = std::fabs(double{got[i]} - want[i]);
          worst = std::max(worst, err);
          bad += !(err <= 2 * ulp + 0.02 * mean);
        }
      }
      MESSAGE("gpt-oss experts, " << rows << " rows, down bias " << down_bias
                                  << ": max |cuda - cpu| " << worst);
      CHECK(bad == 0);
    }
  }
}
