// Structured outputs through the engine on the CPU: the demo checkpoint (random weights, the
// project's byte-level BPE tokenizer) emits garbage unconstrained; under a JSON Schema every
// completion that ends by itself parses and validates, on the host sampler and on the CPU
// device that draws through the sampler's twin (the device path's mask upload), and on
// CUDA ("cuda engine"), whose sampler applies the mask on the GPU.
#include <doctest/doctest.h>

#include <filesystem>

#include "daemon/engine/demo_model.h"
#include "daemon/engine/engine.h"
#include "daemon/openai/structured.h"
#include "daemon/tokenizer/tokenizer.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

const char* kSchema = R"({
  "type": "object", "additionalProperties": false,
  "properties": {
    "ok": {"type": "boolean"},
    "count": {"type": "integer"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    "note": {"anyOf": [{"type": "null"}, {"type": "number"}]}
  },
  "required": ["ok", "count", "color", "tags", "note"]})";

struct Demo {
  test::TempDir dir;
  tok::Tokenizer tok;
  std::vector<int32_t> eos;
  Demo() {
    REQUIRE(write_demo_model(dir.path() + "/m", false).ok());
    auto t = tok::Tokenizer::from_file(dir.path() + "/m/tokenizer.json");
    REQUIRE(t.ok());
    tok = std::move(*t);
    auto cfg = load_model_config(dir.path() + "/m");
    REQUIRE(cfg.ok());
    for (int id : cfg->eos_token_ids) eos.push_back(id);
    REQUIRE_FALSE(eos.empty());
  }
  std::unique_ptr<Engine> engine(std::shared_ptr<Device> device) {
    auto m = device ? Model::load(dir.path() + "/m", 0, 1, device)
                    : Model::load(dir.path() + "/m", 0, 1);
    REQUIRE(m.ok());
    EngineOptions o;
    o.slots = 4;
    auto e = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
    REQUIRE_MESSAGE(e.ok(), (e.ok() ? std::string() : e.error().message));
    return std::move(*e);
  }
};

bool valid(const grammar::Json& x) {
  if (!x.is_object() || x.size() != 5) return false;
  if (!x["ok"].is_boolean() || !x["count"].is_number_integer()) return false;
  if (x["color"] != "red" && x["color"] != "green" && x["color"] != "blue") return false;
  if (!x["tags"].is_array()) return false;
  for (const auto& t : x["tags"])
    if (t != "a" && t != "b") return false;
  return x["note"].is_null() || x["note"].is_number();
}

}  // namespace

TEST_CASE("engine structured outputs: a random model's completions parse and validate") {
  Demo d;
  auto trie = openai::make_token_trie(d.tok, d.eos, d.tok.vocab_size());
  auto g = grammar::Grammar::from_schema(grammar::Json::parse(kSchema));
  REQUIRE(g.ok());
  auto constraint = std::make_shared<const grammar::Constraint>(grammar::Constraint{*g, trie});
  const std::vector<int32_t> prompt = d.tok.encode("Answer in JSON:", false);
  for (bool device_draws : {false, true}) {
    CAPTURE(device_draws);
    auto eng = d.engine(device_draws ? make_cpu_device_sampling() : nullptr);
    int ended = 0;
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      SamplingParams p;
      p.temperature = 1.0f;
      p.seed = seed;
      p.max_tokens = 400;
      p.constraint = constraint;
      auto r = generate_blocking(*eng, prompt, p);
      REQUIRE(r.ok());
      const auto& toks = r->tokens[0];
      if (r->finish[0] != FinishReason::stop) continue;  // cut by max_tokens: may not parse
      ++ended;
      REQUIRE(!toks.empty());
      CHECK(std::find(d.eos.begin(), d.eos.end(), toks.back()) != d.eos.end());
      const std::string text =
          d.tok.decode(std::vector<int32_t>(toks.begin(), toks.end() - 1), true);
      INFO(text);
      grammar::Json x;
      REQUIRE_NOTHROW(x = grammar::Json::parse(text));
      CHECK(valid(x));
    }
    CHECK(ended >= 3);
  }
  // The same model without the constraint: not one of these completions is the JSON asked for.
  auto eng = d.engine(nullptr);
  int parsed = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = seed;
    p.max_tokens = 60;
    auto r = generate_blocking(*eng, prompt, p);
    REQUIRE(r.ok());
    try {
      parsed += valid(grammar::Json::parse(d.tok.decode(r->tokens[0], true)));
    } catch (const std::exception&) {
    }
  }
  CHECK(parsed == 0);
}

TEST_CASE("engine structured outputs: json_object cut by max_tokens ends with length, mid-value") {
  // This model, once inside a key, repeats one word: the grammar lets a string run on, so
  // max_tokens ends it (finish length, as OpenAI does), and the text is then a prefix of an
  // object the grammar was writing, not a whole one.
  Demo d;
  auto trie = openai::make_token_trie(d.tok, d.eos, d.tok.vocab_size());
  auto constraint = std::make_shared<const grammar::Constraint>(
      grammar::Constraint{grammar::Grammar::any_object(), trie});
  auto eng = d.engine(nullptr);
  SamplingParams p;
  p.seed = 1;
  p.max_tokens = 40;
  p.constraint = constraint;
  auto r = generate_blocking(*eng, d.tok.encode("{", false), p);
  REQUIRE(r.ok());
  CHECK(r->finish[0] == FinishReason::length);
  REQUIRE(r->tokens[0].size() == 40);
  const std::string text = d.tok.decode(r->tokens[0], true);
  INFO(text);
  CHECK(text.rfind('{', 0) == 0);
  grammar::Matcher m(*constraint);
  CHECK(m.accept_bytes(text));  // every byte was one the grammar allowed
  CHECK_FALSE(m.can_end());     // but the object is not complete
  CHECK_THROWS((void)grammar::Json::parse(text).size());
}

TEST_CASE("cuda engine: structured outputs drawn on the GPU parse and validate") {
  if (test::skip_without_cuda()) return;
  auto cuda = make_cuda_device(0);
  REQUIRE_MESSAGE(cuda.ok(), (cuda.ok() ? std::string() : cuda.error().message));
  Demo d;
  auto trie = openai::make_token_trie(d.tok, d.eos, d.tok.vocab_size());
  auto g = grammar::Grammar::from_schema(grammar::Json::parse(kSchema));
  REQUIRE(g.ok());
  auto constraint = std::make_shared<const grammar::Constraint>(grammar::Constraint{*g, trie});
  const std::vector<int32_t> prompt = d.tok.encode("Answer in JSON:", false);
  auto eng = d.engine(*cuda);
  int ended = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    CAPTURE(seed);
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = seed;
    p.max_tokens = 400;
    p.constraint = constraint;
    auto r = generate_blocking(*eng, prompt, p);
    REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
    const auto& toks = r->tokens[0];
    if (r->finish[0] != FinishReason::stop) continue;  // cut by max_tokens: may not parse
    ++ended;
    REQUIRE(!toks.empty());
    const std::string text = d.tok.decode(std::vector<int32_t>(toks.begin(), toks.end() - 1), true);
    INFO(text);
    grammar::Json x;
    REQUIRE_NOTHROW(x = grammar::Json::parse(text));
    CHECK(valid(x));
  }
  CHECK(ended >= 3);
}
