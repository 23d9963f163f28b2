// The engine against Hugging Face transformers: tests/fixtures/models/<name>/ holds tiny
// random-weight checkpoints with reference logits and greedy continuations written by
// tools/gen_reference.py (float32, eager attention). Bounds: max |logit difference| <= 1e-3
// at every recorded position (prompt and greedy steps; weights are identical values in both
// computations, so the bound holds for BF16 and F32 files alike), and identical greedy tokens
// for every recorded step (>= 64).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"

using namespace spark;
using namespace spark::engine;

namespace {

constexpr double kMaxLogitDiff = 1e-3;
const std::string kFixtures = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models";

std::vector<std::string> fixture_dirs() {
  std::vector<std::string> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(kFixtures, ec)) return out;
  for (const auto& e : std::filesystem::directory_iterator(kFixtures, ec))
    if (std::filesystem::exists(e.path() / "reference.json")) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

double max_diff(const float* a, const nlohmann::json& b) {
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i].get<double>()));
  return worst;
}

}  // namespace

TEST_CASE("reference: logits and greedy tokens match Hugging Face transformers") {
  const auto dirs = fixture_dirs();
  if (dirs.empty()) {
    MESSAGE("SKIP: no reference fixtures under "
            << kFixtures << " (generate them with tools/gen_reference.py on the GPU machine)");
    std::cout << "SKIP: reference fixtures absent: " << kFixtures << "\n";
    return;
  }
  for (const auto& dir : dirs) {
    CAPTURE(dir);
    auto text = read_file(dir + "/reference.json");
    REQUIRE(text);
    auto ref = nlohmann::json::parse(*text);
    auto m = Model::load(dir, 0, 1);
    REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
    auto& model = **m;
    const auto& c = model.config();
    CHECK(c.architecture == ref["architecture"].get<std::string>());
    const size_t V = static_cast<size_t>(c.vocab_size);

    // RoPE frequencies (llama3 scaling included).
    const auto& inv = ref["rope_inv_freq"];
    if (!inv.empty()) {
      REQUIRE(inv.size() == model.rope_inv_freq().size());
      for (size_t i = 0; i < inv.size(); ++i)
        CHECK(model.rope_inv_freq()[i] == doctest::Approx(inv[i].get<double>()).epsilon(1e-5));
    }

    std::vector<int32_t> prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const int steps = ref["greedy_steps"].get<int>();
    const int bs = 16;
    const int blocks = (static_cast<int>(prompt.size()) + steps) / bs + 2;
    auto cache_made = model.make_kv_cache(blocks, bs, ElemType::f32);  // K+V, or a latent
    REQUIRE(cache_made.ok());
    KVCache& cache = **cache_made;
    std::vector<int32_t> table(static_cast<size_t>(blocks));
    for (int i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = blocks - 1 - i;
    LocalCollective one;

    // Prompt logits at the recorded positions.
    std::vector<float> logits;
    SeqChunk ch{prompt.data(), static_cast<int>(prompt.size()), 0, table.data(), true};
    REQUIRE(model.forward({ch}, cache, one, &logits, true).ok());
    double worst = 0;
    const auto& positions = ref["prompt_logits_positions"];
    for (size_t r = 0; r < positions.size(); ++r)
      worst = std::max(
          worst, max_diff(logits.data() + positions[r].get<size_t>() * V, ref["prompt_logits"][r]));

    // Greedy decode through the KV cache, one token per step.
    std::vector<int32_t> seq = prompt;
    std::vector<int32_t> got;
    std::vector<float> last(logits.end() - static_cast<ptrdiff_t>(V), logits.end());
    const auto& expect_ids = ref["greedy_ids"];
    int first_mismatch = -1;
    for (int s = 0; s < steps; ++s) {
      const auto key = std::to_string(s);
      if (ref["greedy_full_logits"].contains(key))
        worst = std::max(worst, max_diff(last.data(), ref["greedy_full_logits"][key]));
      const auto& top = ref["greedy_top"][static_cast<size_t>(s)];
      for (size_t k = 0; k < top["ids"].size(); ++k)
        worst = std::max(
            worst, std::abs(last[top["ids"][k].get<size_t>()] - top["logits"][k].get<double>()));
      const int32_t tok =
          static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
      got.push_back(tok);
      if (first_mismatch < 0 && tok != expect_ids[static_cast<size_t>(s)].get<int32_t>())
        first_mismatch = s;
      seq.push_back(tok);
      SeqChunk d{&seq.back(), 1, static_cast<int>(seq.size()) - 1, table.data(), true};
      if (s + 1 < steps) REQUIRE(model.forward({d}, cache, one, &last).ok());
    }
    MESSAGE(dir << ": " << ref["weights_dtype"].get<std::string>() << ", max |logit diff| " << worst
                << " (bound " << kMaxLogitDiff << "), greedy steps " << steps << ", first mismatch "
                << first_mismatch);
    CHECK(steps >= 64);
    CHECK(worst <= kMaxLogitDiff);
    CHECK(first_mismatch == -1);
    CHECK(got == expect_ids.get<std::vector<int32_t>>());
  }
}

TEST_CASE("reference: chunked prefill gives the logits of whole prefill") {
  const auto dirs = fixture_dirs();
  if (dirs.empty()) {
    MESSAGE("SKIP: no reference fixtures under " << kFixtures);
    std::cout << "SKIP: reference fixtures absent: " << kFixtures << "\n";
    return;
  }
  for (const auto& dir : dirs) {
    CAPTURE(dir);
    auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
    auto m = Model::load(dir, 0, 1);
    REQUIRE(m.ok());
    auto& model = **m;
    const auto& c = model.config();
    const size_t V = static_cast<size_t>(c.vocab_size);
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    const int n = static_cast<int>(prompt.size());
    const int bs = 8, blocks = n / bs + 2;
    std::vector<int32_t> table(static_cast<size_t>(blocks));
    for (int i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = blocks - 1 - i;
    LocalCollective one;
    auto whole_cache_made = model.make_kv_cache(blocks, bs, ElemType::f32);  // K+V, or a latent
    REQUIRE(whole_cache_made.ok());
    KVCache& whole_cache = **whole_cache_made;
    std::vector<float> whole;
    SeqChunk all{prompt.data(), n, 0, table.data(), true};
    REQUIRE(model.forward({all}, whole_cache, one, &whole, true).ok());
    // Uneven chunks (as the scheduler cuts them), each one step through the cache.
    auto cache_made = model.make_kv_cache(blocks, bs, ElemType::f32);  // K+V, or a latent
    REQUIRE(cache_made.ok());
    KVCache& cache = **cache_made;
    std::vector<float> chunked, part;
    const int sizes[] = {5, 1, 3, 8, 2};
    for (int at = 0, k = 0; at < n; ++k) {
      const int len = std::min(sizes[k % 5], n - at);
      SeqChunk ch{prompt.data() + at, len, at, table.data(), true};
      REQUIRE(model.forward({ch}, cache, one, &part, true).ok());
      chunked.insert(chunked.end(), part.begin(), part.end());
      at += len;
    }
    REQUIRE(chunked.size() == whole.size());
    // Float rounding only: the products see other row counts, so the sums may round
    // differently (a chunking bug, a wrong position or block, is off by whole units).
    double worst = 0, scale = 1;
    for (size_t i = 0; i < whole.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(whole[i]) - chunked[i]));
      scale = std::max(scale, std::abs(static_cast<double>(whole[i])));
    }
    double ref_worst = 0;
    const auto& positions = ref["prompt_logits_positions"];
    for (size_t r = 0; r < positions.size(); ++r)
      ref_worst = std::max(ref_worst, max_diff(chunked.data() + positions[r].get<size_t>() * V,
                                               ref["prompt_logits"][r]));
    MESSAGE(dir << ": chunked vs whole max |logit diff| " << worst << " (max |logit| " << scale
                << "), vs transformers " << ref_worst);
    CHECK(worst <= 1e-5 * scale);
    CHECK(ref_worst <= kMaxLogitDiff);
  }
}

TEST_CASE(
    "reference: the scheduler (chunked prefill, batching, prefix cache) keeps the greedy tokens") {
  const auto dirs = fixture_dirs();
  if (dirs.empty()) {
    MESSAGE("SKIP: no reference fixtures under " << kFixtures);
    std::cout << "SKIP: reference fixtures absent: " << kFixtures << "\n";
    return;
  }
  for (const auto& dir : dirs) {
    CAPTURE(dir);
    auto ref = nlohmann::json::parse(*read_file(dir + "/reference.json"));
    auto m = Model::load(dir, 0, 1);
    REQUIRE(m.ok());
    EngineOptions o;
    o.slots = 2;
    o.block_size = 8;
    o.max_batch_tokens = 5;  // the prompt prefills in uneven chunks next to decodes
    auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
    REQUIRE(eng.ok());
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = ref["greedy_steps"].get<int>();
    p.ignore_eos = true;
    p.n = 2;  // two sequences of the same prompt in the same steps
    const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    auto r = generate_blocking(**eng, prompt, p);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
    const auto expect = ref["greedy_ids"].get<std::vector<int32_t>>();
    CHECK(r->tokens[0] == expect);
    CHECK(r->tokens[1] == expect);
    auto again = generate_blocking(**eng, prompt, p);  // now from the prefix cache
    REQUIRE(again.ok());
    CHECK(again->cached_prompt_tokens > 0);
    CHECK(again->tokens[0] == expect);
  }
}
