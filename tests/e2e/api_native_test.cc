// The real sparkd serving the demo model (`sparkctl demo-model`, random weights) through
// the native engine: the OpenAI API end to end over HTTP — models, chat (exact JSON shape),
// streaming with include_usage, n=2, seeds, logprobs, stop strings, context_length_exceeded,
// a client that disconnects mid-stream (its slot is freed at once), tools, /tokenize and
// /detokenize, a gpt-oss demo model with the harmony chat format, and the official OpenAI Node
// client (skipped when node or the package is missing).
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "core/http_client.h"
#include "core/strings.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

constexpr int kContext = 1024;
constexpr int kSlots = 2;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One sparkd (rank 0 of env/examples/local.env) on the demo model, shared by the tests here.
struct Server {
  test::TempDir dir{"api-e2e"};
  int port = 0;
  std::unique_ptr<test::Child> child;
  std::string error;

  // fixture: "" = the demo model; "gpt-oss" = the demo model of GptOssForCausalLM with the
  // gpt-oss-like tokenizer and gpt-oss's chat template (tests/fixtures/harmony);
  // else a tests/fixtures/models/<name> checkpoint (HF random init: nearly flat logits, so
  // sampling seeds visibly matter) with the tokenizer fixture.
  // chat_template: written to the model's chat_template.jinja when not empty.
  explicit Server(const std::string& fixture = "",
                  const std::map<std::string, std::string>& extra_env = {},
                  const std::string& chat_template = "") {
    int context = kContext;
    if (fixture.empty() || fixture == "gpt-oss") {
      std::vector<std::string> cmd = {SPARKCTL_BIN, "demo-model", dir / "model"};
      if (!fixture.empty()) cmd.insert(cmd.end(), {"--arch", "GptOssForCausalLM"});
      auto [st, out] = test::run_capture(cmd, {}, std::chrono::seconds(60));
      if (st != 0) {
        error = "sparkctl demo-model failed: " + out;
        return;
      }
      if (!fixture.empty()) {
        namespace fs = std::filesystem;
        std::string src = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/harmony/";
        for (const char* f : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
          fs::copy_file(src + f, dir / (std::string("model/") + f),
                        fs::copy_options::overwrite_existing);
      }
    } else {
      namespace fs = std::filesystem;
      fs::create_directories(dir / "model");
      std::string src = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/";
      for (const auto& e : fs::directory_iterator(src + "models/" + fixture))
        if (e.path().filename() != "reference.json")
          fs::copy_file(e.path(), dir / ("model/" + e.path().filename().string()));
      for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
        fs::copy_file(src + "tokenizer/" + f, dir / (std::string("model/") + f));
      // A CONTEXT_LEN set above the model's max_position_embeddings is refused at load:
      // the fixtures are shorter than kContext.
      std::ifstream cf(dir / "model/config.json");
      auto cj = nlohmann::json::parse(cf, nullptr, false);
      if (cj.is_object() && cj.contains("max_position_embeddings"))
        context = std::min(context, cj["max_position_embeddings"].get<int>());
    }
    if (!chat_template.empty()) dir.write("model/chat_template.jinja", chat_template);
    port = test::free_port();
    std::map<std::string, std::string> env = {
        {"MODEL_PATH", dir / "model"},
        {"STATE_DIR", dir / "state"},
        {"RDZV_PORT", std::to_string(test::free_port())},
        {"SLOTS", std::to_string(kSlots)},
        {"CONTEXT_LEN", std::to_string(context)},
        {"PROBE_PROMPT", "a"}};  // byte-level ids, inside the fixtures' small vocab
    for (const auto& [k, v] : extra_env) env[k] = v;
    child = std::make_unique<test::Child>(
        std::vector<std::string>{
            SPARKD_BIN, "--config", std::string(SPARK_SOURCE_DIR) + "/env/examples/local.env",
            "--rank", "0", "--port", std::to_string(port), "--log-file", dir / "sparkd.log"},
        env, dir / "out.txt");
    auto end = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < end) {
      auto h = health();
      if (h.value("state", "") == "ready") return;
      if (h.value("state", "") == "fatal") break;
      std::this_thread::sleep_for(100ms);
    }
    error = "sparkd did not become ready within 60 s; /health: " + health().dump() + "\nlog:\n" +
            slurp(dir / "sparkd.log") + slurp(dir / "out.txt");
  }
  ~Server() {
    if (child) {
      child->signal(SIGTERM);
      if (!child->wait_for(15s)) child->signal(SIGKILL);
    }
  }
  json health() const {
    HttpCall c;
    c.port = static_cast<uint16_t>(port);
    c.target = "/health";
    c.timeout = 2000ms;
    auto r = http_call(c);
    if (!r.ok()) return json::object();
    return json::parse(r->body, nullptr, false);
  }
  HttpReply call(const std::string& method, const std::string& target,
                 const std::string& body = "") const {
    HttpCall c;
    c.method = method;
    c.port = static_cast<uint16_t>(port);
    c.target = target;
    c.body = body;
    c.timeout = 60000ms;
    auto r = http_call(c);
    REQUIRE_MESSAGE(r.ok(), method << " " << target << ": " << r.error().message);
    return *r;
  }
  json post(const std::string& target, const json& body, int expect_status = 200) const {
    auto r = call("POST", target, body.dump());
    INFO(target << " -> " << r.status << " " << r.body);
    CHECK(r.status == expect_status);
    return json::parse(r.body);
  }
};

Server& server() {
  static Server s;
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  return s;
}

Server& gptoss_server() {
  static Server s("gpt-oss");
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  return s;
}

Server& fixture_server() {
  static Server s("qwen2");
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  return s;
}

json hello() {
  return json::array({{{"role", "system"}, {"content", "Be brief."}},
                      {{"role", "user"}, {"content", "Say hello."}}});
}

std::vector<std::string> keys(const json& j) {
  std::vector<std::string> k;
  for (auto it = j.begin(); it != j.end(); ++it) k.push_back(it.key());
  std::sort(k.begin(), k.end());
  return k;
}

// The "data: " payloads of an SSE body, in order.
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    size_t end = body.find("\n\n", pos);
    REQUIRE(end != std::string::npos);
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end + 2;
  }
  return out;
}

}  // namespace

TEST_CASE(
    "e2e api: an allocation that fails inside a chat template render is a 400 naming the "
    "template and its limits; the daemon goes on serving") {
  // A fault-injection shim (tests/fault/fault_inject_alloc.cc) makes every allocation of
  // 16 MiB or more throw std::bad_alloc, as on a machine whose memory is spent. Two-message
  // chats build a 40 MB string (within the render's 64 MiB limit, so the budget lets it
  // grow) and meet it; everything else sparkd does stays far below.
  test::TempDir logdir("api-e2e-alloc");
  const std::string refused = logdir / "refused.log";
  Server s("",
           {{"LD_PRELOAD", FAULT_INJECT_ALLOC},
            {"SPARK_FAULT_ALLOC_OVER", std::to_string(16u << 20)},
            {"SPARK_FAULT_ALLOC_LOG", refused}},
           "{% for m in messages %}{{ m.content }}{% endfor %}{% if messages | length == 2 %}\n"
           "{{ ('ab' * 20000000) | length }}{% endif %}");
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  REQUIRE_MESSAGE(slurp(refused).empty(), "an allocation was refused before any request");
  json two = {{"model", "demo"},
              {"max_tokens", 2},
              {"messages", json::array({{{"role", "user"}, {"content", "a"}},
                                        {{"role", "assistant"}, {"content", "b"}}})}};
  json one = {{"model", "demo"},
              {"max_tokens", 2},
              {"messages", json::array({{{"role", "user"}, {"content", "a"}}})}};
  for (int round = 0; round < 2; ++round) {
    auto r = s.call("POST", "/v1/chat/completions", two.dump());
    INFO("round " << round << ": " << r.status << " " << r.body);
    CHECK(r.status == 400);
    auto j = json::parse(r.body, nullptr, false);
    REQUIRE(j.is_object());
    const std::string msg = j["error"]["message"].get<std::string>();
    // The render itself caught it: the template and its line, and the limits it stayed in.
    CHECK(msg.find("chat_template line 2: the render ran out of memory") != std::string::npos);
    CHECK(msg.find("64 MiB per string") != std::string::npos);
    // The fault fired inside that render (not elsewhere), once per round at least.
    const std::string log = slurp(refused);
    CHECK(std::count(log.begin(), log.end(), '\n') >= round + 1);
    // The daemon goes on: a chat that renders small is answered, /health stays ready.
    auto ok = s.post("/v1/chat/completions", one);
    CHECK(ok["choices"].size() == 1);
    CHECK(s.health().value("state", "") == "ready");
  }
  CHECK(s.child->running());
}

TEST_CASE("e2e api: GET /v1/models lists the served model with its context length") {
  auto& s = server();
  auto r = s.call("GET", "/v1/models");
  REQUIRE(r.status == 200);
  auto j = json::parse(r.body);
  CHECK(j["object"] == "list");
  REQUIRE(j["data"].size() == 1);
  CHECK(j["data"][0]["id"] == "demo");
  CHECK(j["data"][0]["object"] == "model");
  CHECK(j["data"][0]["max_model_len"] == kContext);
  auto h = s.health();
  CHECK(h["probe"]["status"] == "passed");
  CHECK(h["slots"]["total"] == kSlots);
}

TEST_CASE("e2e api: chat completion has OpenAI's exact shape; streaming gives the same text") {
  auto& s = server();
  json req = {{"model", "demo"}, {"messages", hello()}, {"max_tokens", 12}, {"temperature", 0}};
  auto j = s.post("/v1/chat/completions", req);
  CHECK(keys(j) ==
        std::vector<std::string>{"choices", "created", "id", "model", "object", "usage"});
  CHECK(j["object"] == "chat.completion");
  CHECK(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  CHECK(j["model"] == "demo");
  REQUIRE(j["choices"].size() == 1);
  const json& c = j["choices"][0];
  CHECK(keys(c) == std::vector<std::string>{"finish_reason", "index", "logprobs", "message"});
  CHECK(c["index"] == 0);
  CHECK(c["message"]["role"] == "assistant");
  CHECK(c["message"]["content"].is_string());
  CHECK(c["logprobs"].is_null());
  const json& u = j["usage"];
  CHECK(u["completion_tokens"].get<int>() >= 1);
  CHECK(u["completion_tokens"].get<int>() <= 12);
  CHECK(u["total_tokens"] == u["prompt_tokens"].get<int>() + u["completion_tokens"].get<int>());
  if (c["finish_reason"] == "length") CHECK(u["completion_tokens"] == 12);
  // prompt_tokens is the rendered chat's length, as /tokenize counts it.
  auto t = s.post("/tokenize", {{"messages", hello()}});
  CHECK(t["count"] == u["prompt_tokens"]);

  // Streaming with include_usage: same greedy text, usage in the last chunk only.
  req["stream"] = true;
  req["stream_options"] = {{"include_usage", true}};
  auto r = s.call("POST", "/v1/chat/completions", req.dump());
  REQUIRE(r.status == 200);
  auto ev = sse_events(r.body);
  REQUIRE(ev.size() >= 3);
  CHECK(ev.back() == "[DONE]");
  std::string text, finish;
  for (size_t i = 0; i + 2 < ev.size(); ++i) {
    auto k = json::parse(ev[i]);
    CHECK(k["object"] == "chat.completion.chunk");
    CHECK(k["usage"].is_null());
    CHECK(k["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
    REQUIRE(k["choices"].size() == 1);
    if (i == 0) CHECK(k["choices"][0]["delta"]["role"] == "assistant");
    if (k["choices"][0]["delta"].contains("content"))
      text += k["choices"][0]["delta"]["content"].get<std::string>();
    if (!k["choices"][0]["finish_reason"].is_null())
      finish = k["choices"][0]["finish_reason"].get<std::string>();
  }
  auto last = json::parse(ev[ev.size() - 2]);
  CHECK(last["choices"].empty());
  // The same usage, but for the prefix cache's share (this second request may hit it).
  auto counts = [](json x) {
    x.erase("prompt_tokens_details");
    return x;
  };
  CHECK(counts(last["usage"]) == counts(u));
  for (const json* x : {&u, static_cast<const json*>(&last["usage"])}) {
    REQUIRE(x->contains("prompt_tokens_details"));
    const json& cached = x->at("prompt_tokens_details").value("cached_tokens", json());
    REQUIRE(cached.is_number_integer());
    CHECK(cached.get<int>() >= 0);
    CHECK(cached.get<int>() <= x->at("prompt_tokens").get<int>());
  }
  CHECK(text == c["message"]["content"].get<std::string>());
  CHECK(finish == c["finish_reason"].get<std::string>());
}

TEST_CASE("e2e api: n=2, seeds reproduce, logprobs match greedy choices") {
  {
    // A checkpoint with nearly flat logits (the demo's are peaked: every seed agrees there);
    // its vocabulary is smaller than the tokenizer's, so the prompt is token ids.
    auto& f = fixture_server();
    // Even these logits are peaked; temperature 2 and a frequency penalty open them up.
    json req = {{"prompt", json::array({1, 2, 3, 4, 5})},
                {"max_tokens", 16},
                {"temperature", 2.0},
                {"frequency_penalty", 2.0},
                {"seed", 1234},
                {"n", 2},
                {"logprobs", 1}};
    auto a = f.post("/v1/completions", req);
    CHECK(a["object"] == "text_completion");
    REQUIRE(a["choices"].size() == 2);
    CHECK(a["choices"][0]["index"] == 0);
    CHECK(a["choices"][1]["index"] == 1);
    auto toks = [](const json& c) { return c["logprobs"]["tokens"]; };
    CHECK(toks(a["choices"][0]) != toks(a["choices"][1]));  // two samples, not one copied
    auto b = f.post("/v1/completions", req);
    CHECK(toks(a["choices"][0]) == toks(b["choices"][0]));
    CHECK(toks(a["choices"][1]) == toks(b["choices"][1]));
    req["n"] = 1;
    std::set<std::string> seen;
    for (int seed : {1, 2, 3}) {
      req["seed"] = seed;
      seen.insert(toks(f.post("/v1/completions", req)["choices"][0]).dump());
    }
    CHECK(seen.size() == 3);  // the seed reaches the sampler
  }
  auto& s = server();
  json n2 = {{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"n", 2}, {"seed", 5}};
  auto j = s.post("/v1/completions", n2);
  CHECK(j["choices"].size() == 2);
  CHECK(j["usage"]["completion_tokens"].get<int>() >= 2);

  json lr = {{"messages", hello()},
             {"max_tokens", 6},
             {"temperature", 0},
             {"logprobs", true},
             {"top_logprobs", 3}};
  auto l = s.post("/v1/chat/completions", lr);
  const json& content = l["choices"][0]["logprobs"]["content"];
  REQUIRE(content.is_array());
  CHECK(content.size() == l["usage"]["completion_tokens"].get<size_t>() -
                              (l["choices"][0]["finish_reason"] == "stop" ? 1 : 0));
  for (const auto& t : content) {
    REQUIRE(t["top_logprobs"].size() == 3);
    CHECK(t["logprob"].get<double>() <= 0.0);
    CHECK(t["bytes"].is_array());
    // Greedy: the chosen token is the most likely alternative.
    CHECK(t["top_logprobs"][0]["token"] == t["token"]);
    CHECK(t["top_logprobs"][0]["logprob"].get<double>() ==
          doctest::Approx(t["logprob"].get<double>()));
    CHECK(t["top_logprobs"][0]["logprob"].get<double>() >=
          t["top_logprobs"][1]["logprob"].get<double>());
  }
}

TEST_CASE(
    "e2e api: completions echo + logprobs score the prompt (first null), max_tokens 0 and "
    "text_offset, as evaluation harnesses use them") {
  auto& s = server();
  const std::string prompt = "Once upon a time there was a fox";
  auto ids = s.post("/tokenize", {{"prompt", prompt}})["tokens"].get<std::vector<int>>();
  REQUIRE(ids.size() >= 4);
  const size_t P = ids.size();
  // The tokens' texts sit at their offsets in the returned text (a special token the text
  // does not spell, such as a BOS, takes no room).
  auto check_offsets = [](const json& lp, const std::string& text) {
    size_t last = 0;
    for (size_t i = 0; i < lp["tokens"].size(); ++i) {
      CAPTURE(i);
      const auto tok = lp["tokens"][i].get<std::string>();
      const auto off = lp["text_offset"][i].get<size_t>();
      CHECK(off >= last);
      CHECK((text.compare(off, tok.size(), tok) == 0 || (i == 0 && off == 0)));
      last = off;
    }
  };

  auto z = s.post(
      "/v1/completions",
      {{"prompt", prompt}, {"echo", true}, {"logprobs", 3}, {"max_tokens", 0}, {"temperature", 0}});
  const json& zc = z["choices"][0];
  CHECK(zc["text"] == prompt);
  CHECK(zc["finish_reason"] == "length");
  CHECK(z["usage"]["completion_tokens"] == 0);
  CHECK(z["usage"]["prompt_tokens"] == P);
  const json& zl = zc["logprobs"];
  REQUIRE(zl["tokens"].size() == P);
  CHECK(zl["token_logprobs"][0].is_null());
  CHECK(zl["top_logprobs"][0].is_null());
  for (size_t i = 1; i < P; ++i) {
    CHECK(zl["token_logprobs"][i].get<double>() <= 0.0);
    CHECK(zl["top_logprobs"][i].size() >= 1);
  }
  check_offsets(zl, zc["text"]);

  // A prompt token's alternatives are what a generation after the tokens before it reports.
  const size_t k = P - 2;
  std::vector<int> prefix(ids.begin(), ids.begin() + static_cast<long>(k));
  auto g = s.post("/v1/completions", {{"prompt", prefix},
                                      {"max_tokens", 1},
                                      {"temperature", 0},
                                      {"logprobs", 3},
                                      {"ignore_eos", true}});
  const json& want = g["choices"][0]["logprobs"]["top_logprobs"][0];
  const json& got = zl["top_logprobs"][k];
  REQUIRE(want.size() == got.size());
  for (auto it = want.begin(); it != want.end(); ++it) {
    CAPTURE(it.key());
    REQUIRE(got.contains(it.key()));
    CHECK(got[it.key()].get<double>() == doctest::Approx(it.value().get<double>()).epsilon(1e-3));
  }

  // With generated tokens: they follow the prompt's, their offsets after the prompt's text.
  auto e = s.post("/v1/completions", {{"prompt", prompt},
                                      {"echo", true},
                                      {"logprobs", 1},
                                      {"max_tokens", 3},
                                      {"temperature", 0},
                                      {"ignore_eos", true}});
  const json& ec = e["choices"][0];
  const std::string etext = ec["text"];
  CHECK(etext.rfind(prompt, 0) == 0);
  REQUIRE(ec["logprobs"]["tokens"].size() == P + 3);
  CHECK(ec["logprobs"]["text_offset"][P] == prompt.size());
  check_offsets(ec["logprobs"], etext);

  // Streaming: the first chunk is the echoed prompt with its logprobs.
  auto st = s.call(
      "POST", "/v1/completions",
      json{{"prompt", prompt}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 2}, {"stream", true}}
          .dump());
  REQUIRE(st.status == 200);
  auto events = sse_events(st.body);
  REQUIRE(events.size() >= 2);
  auto first = json::parse(events[0]);
  CHECK(first["choices"][0]["text"] == prompt);
  CHECK(first["choices"][0]["logprobs"]["tokens"].size() == P);
  CHECK(first["choices"][0]["logprobs"]["token_logprobs"][0].is_null());

  auto bad = s.post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 0}}, 400);
  CHECK(bad["error"]["param"] == "max_tokens");
}

TEST_CASE("e2e api: a stop string cuts the text before it; finish_reason stop") {
  auto& s = server();
  json req = {{"prompt", "The capital of France is"},
              {"max_tokens", 16},
              {"temperature", 0},
              {"ignore_eos", true}};
  auto full = s.post("/v1/completions", req)["choices"][0]["text"].get<std::string>();
  REQUIRE(full.size() > 6);
  std::string stop = full.substr(full.size() / 2, 2);
  req["stop"] = json::array({stop});
  auto cut = s.post("/v1/completions", req);
  CHECK(cut["choices"][0]["text"] == full.substr(0, full.find(stop)));
  CHECK(cut["choices"][0]["finish_reason"] == "stop");
  // Streaming cuts at the same place.
  req["stream"] = true;
  auto r = s.call("POST", "/v1/completions", req.dump());
  std::string text;
  for (const auto& e : sse_events(r.body))
    if (e != "[DONE]") text += json::parse(e)["choices"][0]["text"].get<std::string>();
  CHECK(text == cut["choices"][0]["text"].get<std::string>());
}

TEST_CASE("e2e api: OpenAI-shaped errors: context_length_exceeded, bad values, unknown model") {
  auto& s = server();
  std::string big;
  for (int i = 0; i < kContext; ++i) big += "hello ";
  auto e = s.post("/v1/chat/completions",
                  {{"messages", json::array({{{"role", "user"}, {"content", big}}})}}, 400);
  CHECK(e["error"]["code"] == "context_length_exceeded");
  CHECK(e["error"]["type"] == "invalid_request_error");
  CHECK(e["error"]["param"] == "messages");
  CHECK(e["error"]["message"].get<std::string>().find(std::to_string(kContext)) !=
        std::string::npos);
  e = s.post("/v1/completions", {{"prompt", "x"}, {"max_tokens", kContext + 1}}, 400);
  CHECK(e["error"]["type"] == "invalid_request_error");
  e = s.post("/v1/chat/completions", {{"messages", hello()}, {"temperature", 5}}, 400);
  CHECK(e["error"]["param"] == "temperature");
  e = s.post("/v1/chat/completions", {{"model", "nope"}, {"messages", hello()}}, 404);
  CHECK(e["error"]["code"] == "model_not_found");
  auto r = s.call("POST", "/v1/chat/completions", "{not json");
  CHECK(r.status == 400);
  CHECK(json::parse(r.body)["error"]["type"] == "invalid_request_error");
}

TEST_CASE("e2e api: /tokenize and /detokenize round-trip") {
  auto& s = server();
  auto t = s.post("/tokenize", {{"prompt", "Hello 👋 world"}, {"add_special_tokens", false}});
  CHECK(t["count"].get<size_t>() == t["tokens"].size());
  CHECK(t["max_model_len"] == kContext);
  auto d = s.post("/detokenize", {{"tokens", t["tokens"]}});
  CHECK(d["prompt"] == "Hello 👋 world");
}

TEST_CASE("e2e api: /tokenize of text that cannot fit is refused before it is tokenized") {
  auto& s = server();
  std::string big;
  for (int i = 0; big.size() < (4u << 20); ++i) big += "word" + std::to_string(i) + " ";
  auto j = s.post("/tokenize", {{"prompt", big}}, 400);
  CHECK(j["error"]["code"] == "context_length_exceeded");
  CHECK(j["error"]["message"].get<std::string>().find("counting stopped at the limit") !=
        std::string::npos);
}

TEST_CASE(
    "e2e api: a chat template that never ends holds no other route and stops with its "
    "client") {
  // One message: a loop of 10^12 steps (no step budget, no deadline here); the load's
  // probe (three messages) and two messages take the other branches.
  Server s("", {{"TEMPLATE_MAX_STEPS", "9000000000000000000"}, {"TEMPLATE_TIMEOUT", "0"}},
           "{% for m in messages %}{{ m.content }}{% endfor %}{% if messages | length == 1 %}\n"
           "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}"
           "{% elif messages | length == 2 %}\n{{ 'a' | center(100000000) }}{% endif %}");
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  // A value past 64 MiB: 400 naming the line, checked before it is built.
  json two = {{"model", "demo"},
              {"messages", json::array({{{"role", "user"}, {"content", "a"}},
                                        {{"role", "assistant"}, {"content", "b"}}})}};
  auto big = s.post("/v1/chat/completions", two, 400);
  INFO(big.dump());
  CHECK(big["error"]["message"].get<std::string>().find("line 3: a string would pass 64 MiB") !=
        std::string::npos);
  // Two renders that never end, on connections held open.
  json one = {{"model", "demo"}, {"messages", json::array({{{"role", "user"}, {"content", "x"}}})}};
  std::string body = one.dump();
  std::string http =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  std::vector<int> fds;
  for (int k = 0; k < 2; ++k) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(s.port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::send(fd, http.data(), http.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(http.size()));
    fds.push_back(fd);
  }
  int inflight = 0;
  for (int i = 0; i < 500 && inflight < 2; ++i) {  // bounded: both reach the render
    inflight = s.health()["requests_in_flight"].get<int>();
    if (inflight < 2) std::this_thread::sleep_for(10ms);
  }
  REQUIRE(inflight == 2);
  // The other routes answer while both renders run.
  s.post("/v1/completions", {{"model", "demo"}, {"prompt", "a"}, {"max_tokens", 2}});
  s.post("/tokenize", {{"prompt", "Hello"}});
  CHECK(s.health()["requests_in_flight"].get<int>() == 2);  // still rendering
  // The clients go: their renders stop, nothing is left in flight.
  for (int fd : fds) ::close(fd);
  for (int i = 0; i < 500 && inflight != 0; ++i) {  // bounded: the renders notice
    inflight = s.health()["requests_in_flight"].get<int>();
    if (inflight != 0) std::this_thread::sleep_for(20ms);
  }
  CHECK(inflight == 0);
}

TEST_CASE("e2e api: tools are accepted; the model's non-tool output stays text") {
  // The demo weights are random, so the model does not emit <tool_call>; parsing real tool
  // calls into tool_calls is covered through the same CompletionWriter by openai_client --wire.
  auto& s = server();
  json tools =
      json::array({{{"type", "function"},
                    {"function",
                     {{"name", "get_weather"},
                      {"description", "Weather for a city"},
                      {"parameters",
                       {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
  json req = {{"messages", json::array({{{"role", "user"}, {"content", "Weather in Paris?"}}})},
              {"tools", tools},
              {"max_tokens", 8},
              {"temperature", 0}};
  auto j = s.post("/v1/chat/completions", req);
  CHECK(j["choices"][0]["message"]["content"].is_string());
  // The tools were rendered into the prompt: it is longer than without them.
  req.erase("tools");
  auto k = s.post("/v1/chat/completions", req);
  CHECK(j["usage"]["prompt_tokens"].get<int>() > k["usage"]["prompt_tokens"].get<int>() + 20);
}

TEST_CASE("e2e api: gpt-oss: harmony prompt with reasoning_effort; answers in OpenAI's shape") {
  // Random weights choose the channels, so this checks what holds for any output: the
  // harmony family is chosen, reasoning_effort reaches the prompt, generation ends on the
  // format's stop tokens (never shown), and streaming adds up to the same message. Parsing
  // of real harmony output: tests/daemon/harmony_test.cc, openai_harmony_test.cc and the
  // OpenAI client's harmony run (tests/scripts/openai_client_wire_test.sh).
  auto& s = gptoss_server();
  CHECK(slurp(s.dir / "sparkd.log").find("chat format harmony") != std::string::npos);
  json tools =
      json::array({{{"type", "function"},
                    {"function",
                     {{"name", "get_weather"},
                      {"description", "Weather for a city"},
                      {"parameters",
                       {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
  json msgs = json::array({{{"role", "system"}, {"content", "Be brief."}},
                           {{"role", "user"}, {"content", "Weather in Paris?"}}});
  auto t = s.post("/tokenize", {{"messages", msgs}, {"reasoning_effort", "high"}});
  auto d = s.post("/detokenize", {{"tokens", t["tokens"]}});
  const std::string prompt = d["prompt"].get<std::string>();
  CHECK(prompt.find("Reasoning: high") != std::string::npos);
  CHECK(prompt.find("# Instructions\n\nBe brief.") != std::string::npos);
  s.post("/v1/chat/completions", {{"messages", msgs}, {"reasoning_effort", "maximal"}}, 400);

  json req = {{"messages", msgs},
              {"tools", tools},
              {"max_tokens", 24},
              {"temperature", 0},
              {"reasoning_effort", "low"}};
  auto j = s.post("/v1/chat/completions", req);
  const json& c = j["choices"][0];
  const json& m = c["message"];
  const std::string finish = c["finish_reason"].get<std::string>();
  CHECK((finish == "stop" || finish == "length" || finish == "tool_calls"));
  CHECK((m["content"].is_string() || m["content"].is_null()));
  std::string content = m["content"].is_string() ? m["content"].get<std::string>() : "";
  std::string reasoning = m.value("reasoning_content", "");
  CHECK(m.value("reasoning", "") == reasoning);
  for (const char* stop : {"<|return|>", "<|call|>"}) {
    CHECK(content.find(stop) == std::string::npos);
    CHECK(reasoning.find(stop) == std::string::npos);
  }
  const json calls = m.value("tool_calls", json::array());
  CHECK((finish == "tool_calls") == !calls.empty());

  req["stream"] = true;
  auto r = s.call("POST", "/v1/chat/completions", req.dump());
  REQUIRE(r.status == 200);
  std::string s_content, s_reasoning, s_finish;
  json s_calls = json::array();
  for (const auto& e : sse_events(r.body)) {
    if (e == "[DONE]") break;
    const json k = json::parse(e);
    const json& ch = k["choices"][0];
    const json& delta = ch["delta"];
    s_content += delta.value("content", "");
    s_reasoning += delta.value("reasoning_content", "");
    for (const auto& tc : delta.value("tool_calls", json::array())) {
      if (tc.contains("id")) {
        s_calls.push_back(tc);
      } else {  // more arguments of the last call
        REQUIRE(!s_calls.empty());
        auto& args = s_calls.back()["function"]["arguments"];
        args = args.get<std::string>() + tc["function"].value("arguments", "");
      }
    }
    if (!ch["finish_reason"].is_null()) s_finish = ch["finish_reason"].get<std::string>();
  }
  CHECK(s_content == content);
  CHECK(s_reasoning == reasoning);
  CHECK(s_finish == finish);
  REQUIRE(s_calls.size() == calls.size());
  for (size_t i = 0; i < calls.size(); ++i) CHECK(s_calls[i]["function"] == calls[i]["function"]);
}

TEST_CASE(
    "e2e api: gpt-oss: under a forced tool call or a response format nothing ends the output "
    "before its constrained part, and a call parses and fits") {
  // Random weights choose whether to reason first (the analysis channel is free) and never
  // close an analysis message or open the final channel, so this checks what holds for any
  // output: a forced call either comes at once and then parses and fits, or the output is
  // reasoning that runs to max_tokens, never ending on a stop token first; a response format
  // likewise. The constrained parts with real harmony output are checked in
  // tests/daemon/openai_harmony_test.cc.
  auto& s = gptoss_server();
  json tools = json::array(
      {{{"type", "function"},
        {"function",
         {{"name", "set_mode"},
          {"description", "Sets the mode"},  // gpt-oss's template reads it
          {"parameters", json::parse(R"({"type": "object", "additionalProperties": false,
              "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer"}},
              "required": ["mode", "level"]})")}}}}});
  json msgs = json::array({{{"role", "user"}, {"content", "Go."}}});
  for (int seed = 1; seed <= 4; ++seed) {
    CAPTURE(seed);
    json req = {{"messages", msgs},
                {"tools", tools},
                {"tool_choice",
                 seed % 2 ? json("required")
                          : json({{"type", "function"}, {"function", {{"name", "set_mode"}}}})},
                {"max_tokens", 60},
                {"seed", seed},
                {"reasoning_effort", "low"}};
    auto j = s.post("/v1/chat/completions", req);
    INFO(j.dump());
    const auto& m = j["choices"][0]["message"];
    if (j["choices"][0]["finish_reason"] == "length") {
      CHECK(j["usage"]["completion_tokens"] == 60);
      CHECK_FALSE(m.contains("tool_calls"));
      CHECK((m["content"].is_null() || m["content"] == ""));
      continue;
    }
    CHECK(j["choices"][0]["finish_reason"] == "tool_calls");
    CHECK(m["content"].is_null());
    REQUIRE(m["tool_calls"].size() == 1);
    CHECK(m["tool_calls"][0]["function"]["name"] == "set_mode");
    json args = json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>());
    CHECK((args["mode"] == "fast" || args["mode"] == "slow"));
    CHECK(args["level"].is_number_integer());
  }
  json fmt_req = {{"messages", msgs},
                  {"max_tokens", 40},
                  {"seed", 3},
                  {"response_format", {{"type", "json_object"}}}};
  auto f = s.post("/v1/chat/completions", fmt_req);
  CHECK(f["choices"][0]["finish_reason"] == "length");
  CHECK(f["usage"]["completion_tokens"] == 40);
}

TEST_CASE("e2e api: structured outputs: json_schema and forced tool calls parse and fit") {
  // The demo model's random weights write garbage; under response_format json_schema and a
  // forced tool_choice every completion that ends by itself parses and fits the schema (the
  // schemas hold no free strings, so a random model ends well within max_tokens).
  auto& s = server();
  json schema = json::parse(R"({"type": "object", "additionalProperties": false,
      "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer"},
                     "hours": {"type": "array", "items": {"type": "integer"}}},
      "required": ["unit", "days", "hours"]})");
  int ended = 0;
  for (int seed = 1; seed <= 4; ++seed) {
    json req = {{"messages", json::array({{{"role", "user"}, {"content", "Forecast?"}}})},
                {"max_tokens", 300},
                {"seed", seed},
                {"response_format",
                 {{"type", "json_schema"}, {"json_schema", {{"name", "f"}, {"schema", schema}}}}}};
    auto j = s.post("/v1/chat/completions", req);
    if (j["choices"][0]["finish_reason"] != "stop") continue;
    ++ended;
    const std::string text = j["choices"][0]["message"]["content"].get<std::string>();
    INFO(text);
    json x;
    REQUIRE_NOTHROW(x = json::parse(text));
    CHECK((x["unit"] == "C" || x["unit"] == "F"));
    CHECK(x["days"].is_number_integer());
    CHECK(x["hours"].is_array());
    CHECK(x.size() == 3);
  }
  CHECK(ended >= 2);
  // A forced call: the named tool, its arguments fitting its parameters, finish tool_calls.
  json tools = json::array(
      {{{"type", "function"},
        {"function",
         {{"name", "set_mode"},
          {"parameters", json::parse(R"({"type": "object", "additionalProperties": false,
              "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer"}},
              "required": ["mode", "level"]})")}}}}});
  int calls = 0;
  for (int seed = 1; seed <= 3 && calls == 0; ++seed) {
    json req = {{"messages", json::array({{{"role", "user"}, {"content", "Go."}}})},
                {"tools", tools},
                {"tool_choice", {{"type", "function"}, {"function", {{"name", "set_mode"}}}}},
                {"max_tokens", 300},
                {"seed", seed}};
    auto j = s.post("/v1/chat/completions", req);
    if (j["choices"][0]["finish_reason"] == "length") continue;
    INFO(j.dump());
    CHECK(j["choices"][0]["finish_reason"] == "tool_calls");
    const auto& tc = j["choices"][0]["message"]["tool_calls"];
    REQUIRE(tc.size() == 1);
    CHECK(tc[0]["function"]["name"] == "set_mode");
    json args = json::parse(tc[0]["function"]["arguments"].get<std::string>());
    CHECK((args["mode"] == "fast" || args["mode"] == "slow"));
    CHECK(args["level"].is_number_integer());
    ++calls;
  }
  CHECK(calls == 1);
  // What the subset does not hold is a 400 naming the keyword; a named tool not in tools too.
  json bad = {
      {"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
      {"response_format",
       {{"type", "json_schema"},
        {"json_schema", {{"name", "p"}, {"schema", {{"type", "string"}, {"pattern", "^a$"}}}}}}}};
  auto e = s.post("/v1/chat/completions", bad, 400);
  CHECK(e["error"]["param"] == "response_format");
  CHECK(e["error"]["message"].get<std::string>().find("'pattern'") != std::string::npos);
  json unknown = {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})},
                  {"tools", tools},
                  {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}};
  auto u = s.post("/v1/chat/completions", unknown, 400);
  CHECK(u["error"]["param"] == "tool_choice");
}

namespace {
// Sends a long completion on a raw socket, waits until it holds a slot, hangs up, and returns
// how long the slot took to come free (or nullopt when it did not within 3 s).
std::optional<std::chrono::milliseconds> hang_up_mid_request(Server& s, bool stream) {
  json req = {
      {"prompt", "Once"}, {"max_tokens", kContext - 8}, {"ignore_eos", true}, {"stream", stream}};
  std::string body = req.dump();
  std::string http =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(s.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::send(fd, http.data(), http.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(http.size()));
  if (stream) {
    std::string got;
    char buf[4096];
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (got.find("\"text\"") == std::string::npos) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      REQUIRE(n > 0);
      got.append(buf, static_cast<size_t>(n));
    }
  }
  // The engine publishes its slot count after each step: wait for it to show this one.
  int before = 0;
  for (int i = 0; i < 200 && before != 1; ++i) {
    before = s.health()["slots"]["busy"].get<int>();
    if (before != 1) std::this_thread::sleep_for(10ms);
  }
  CHECK(before == 1);
  CHECK(s.health()["requests_in_flight"] == 1);
  auto t0 = std::chrono::steady_clock::now();
  ::close(fd);
  while (std::chrono::steady_clock::now() - t0 < 3s) {
    if (s.health()["slots"]["busy"].get<int>() == 0)
      return std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - t0);
    std::this_thread::sleep_for(20ms);
  }
  return std::nullopt;
}
}  // namespace

TEST_CASE("e2e api: a client that disconnects mid-request frees its slot at once") {
  auto& s = server();
  for (bool stream : {true, false}) {
    CAPTURE(stream);
    auto freed = hang_up_mid_request(s, stream);
    REQUIRE_MESSAGE(freed.has_value(), "the slot stayed busy 3 s after the disconnect");
    MESSAGE(std::string(stream ? "streaming" : "plain")
            << ": slot freed " << freed->count() << " ms after the disconnect");
    // (What freed it is the cancel, not the end of the completion: /metrics below counts
    // both requests as aborted.)
    // The HTTP session ended the request too.
    int inflight = -1;
    for (int i = 0; i < 100 && inflight != 0; ++i) {
      inflight = s.health()["requests_in_flight"].get<int>();
      if (inflight != 0) std::this_thread::sleep_for(10ms);
    }
    CHECK(inflight == 0);
  }
  CHECK(slurp(s.dir / "sparkd.log").find("client disconnected; cancelling") != std::string::npos);
  // The server still answers, and /metrics counted the aborted requests and the tokens.
  CHECK(s.call("GET", "/v1/models").status == 200);
  auto m = s.call("GET", "/metrics").body;
  CHECK(m.find("sparkd_request_success_total{finished_reason=\"abort\"} 2") != std::string::npos);
  CHECK(m.find("sparkd_generation_tokens_total ") != std::string::npos);
  CHECK(m.find("sparkd_time_to_first_token_seconds_count ") != std::string::npos);
}

namespace {
// Runs tests/e2e/openai_client/client_test.js (the official OpenAI Node client) against the
// server with the extra arguments; empty (after printing why) when node or the client
// package is not installed, which skips the calling test.
std::optional<std::pair<int, std::string>> run_openai_client(const Server& s,
                                                             std::vector<std::string> args) {
  const std::string dir = std::string(SPARK_SOURCE_DIR) + "/tests/e2e/openai_client";
  if (std::system("command -v node >/dev/null 2>&1") != 0) {
    MESSAGE("SKIP: node is not installed");
    std::puts("SKIP: node is not installed");
    return std::nullopt;
  }
  if (!std::filesystem::exists(dir + "/node_modules/openai")) {
    MESSAGE("SKIP: the openai npm package is not installed (cd " << dir << " && npm ci)");
    std::puts("SKIP: the openai npm package is not installed (npm ci in tests/e2e/openai_client)");
    return std::nullopt;
  }
  std::vector<std::string> cmd = {"/usr/bin/env", "node", dir + "/client_test.js", "--base-url",
                                  "http://127.0.0.1:" + std::to_string(s.port) + "/v1"};
  cmd.insert(cmd.end(), args.begin(), args.end());
  return test::run_capture(cmd, {}, std::chrono::seconds(180));
}
}  // namespace

TEST_CASE("e2e api: the official OpenAI Node client against sparkd") {
  auto r = run_openai_client(server(), {});
  if (!r) return;
  INFO(r->second);
  CHECK(r->first == 0);
  CHECK(r->second.find("# all checks passed") != std::string::npos);
}

TEST_CASE(
    "e2e api: gpt-oss through the official OpenAI Node client: a forced tool call, a tool round") {
  // The engine itself serves the gpt-oss demo model with the harmony template; the client's
  // checks (client_test.js --harmony-live) hold for any weights: one call that keeps to the
  // tool's schema, the same streamed, the tool round with the earlier reasoning served.
  auto r = run_openai_client(gptoss_server(), {"--harmony-live"});
  if (!r) return;
  INFO(r->second);
  CHECK(r->first == 0);
  CHECK(r->second.find("ok   harmony live: the forced call is one tool call to get_weather") !=
        std::string::npos);
  CHECK(r->second.find("# all checks passed") != std::string::npos);
}

TEST_CASE("e2e api: under the memory guard's cancel floor the newest request is cancelled (503)") {
  // A cancel floor above any machine's memory: the guard's next sample cancels what runs.
  Server s("", {{"MEM_GUARD_WAIT", "0"}, {"MEM_GUARD_CANCEL", "100000GiB"}});
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  json req = {{"prompt", "Once"}, {"max_tokens", kContext - 8}, {"ignore_eos", true}};
  auto r = s.call("POST", "/v1/completions", req.dump());
  INFO(r.body);
  CHECK(r.status == 503);
  auto j = json::parse(r.body);
  CHECK(j["error"]["code"] == "memory_pressure");
  CHECK(j["error"]["message"].get<std::string>().find("MemAvailable") != std::string::npos);
  // The engine frees the slot at its next step.
  int busy = -1;
  for (int i = 0; i < 100 && busy != 0; ++i) {
    busy = s.health()["slots"]["busy"].get<int>();
    if (busy != 0) std::this_thread::sleep_for(10ms);
  }
  CHECK(busy == 0);
  CHECK(s.call("GET", "/metrics").body.find("sparkd_mem_guard_cancels_total 1") !=
        std::string::npos);
}

namespace {
// The value of one sample line of /metrics ("name{labels} value"), or -1 when absent.
double sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, series.size() + 1, series + " ") == 0)
      return std::stod(line.substr(series.size() + 1));
  return -1;
}
}  // namespace

TEST_CASE("e2e api: /metrics twins mean what vLLM's mean (batch, prefix cache, phases)") {
  Server s;  // its own: the counters start at zero
  REQUIRE_MESSAGE(s.error.empty(), s.error);
  const std::string v = "{model_name=\"demo\",engine=\"0\"}";
  // The same prompt twice: the second finds its leading full blocks in the prefix cache.
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "Once upon a time ";
  json req = {{"prompt", prompt}, {"max_tokens", 4}, {"ignore_eos", true}};
  int P = 0;
  for (int i = 0; i < 2; ++i) {
    auto j = s.post("/v1/completions", req);
    P = j["usage"]["prompt_tokens"].get<int>();
    CHECK(j["usage"]["completion_tokens"] == 4);
  }
  REQUIRE(P > 32);
  // The engine publishes its counters after each step; the probe added its own tokens.
  auto m = s.call("GET", "/metrics").body;
  INFO(m);
  const double queries = sample(m, "vllm:prefix_cache_queries_total" + v);
  const double hits = sample(m, "vllm:prefix_cache_hits_total" + v);
  const double prompt_all = sample(m, "vllm:prompt_tokens_total" + v);
  const double computed = sample(m, "sparkd_prompt_tokens_computed_total");
  CHECK(hits >= (P - 1) / 16 * 16);  // the second request's full blocks, at least
  CHECK(prompt_all == computed + hits);
  CHECK(queries == prompt_all);  // every admitted prompt was looked up
  CHECK(sample(m, "vllm:gpu_prefix_cache_hits_total" + v) == hits);  // the deprecated name
  CHECK(sample(m, "vllm:num_preemptions_total" + v) == 0);
  // Per-sequence histograms: our two requests (the readiness probe bypasses the API).
  const double seqs = sample(m, "vllm:request_queue_time_seconds_count" + v);
  CHECK(seqs == 2);
  for (const char* h :
       {"vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count", "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count"})
    CHECK_MESSAGE(sample(m, h + v) == seqs, h);
  CHECK(sample(m, "vllm:request_prompt_tokens_sum" + v) == 2 * P);  // hits included
  CHECK(sample(m, "vllm:request_generation_tokens_sum" + v) == 8);
  // The requests' parameters, once per finished request: n 1, max_tokens 4 each.
  CHECK(sample(m, "vllm:request_params_n_count" + v) == 2);
  CHECK(sample(m, "vllm:request_params_n_sum" + v) == 2);
  CHECK(sample(m, "vllm:request_params_max_tokens_count" + v) == 2);
  CHECK(sample(m, "vllm:request_params_max_tokens_sum" + v) == 8);
  // Tokens per engine step: every computed token is in one step (the probe's too), none
  // twice. The second request's last step may land after its response, hence the bounds.
  const double steps = sample(m, "vllm:iteration_tokens_total_count" + v);
  const double step_tokens = sample(m, "vllm:iteration_tokens_total_sum" + v);
  CHECK(steps >= 2);
  CHECK(step_tokens >= P + 3);  // the first request's prompt and decodes at least
  CHECK(step_tokens <= computed + sample(m, "vllm:generation_tokens_total" + v));
  CHECK(sample(m, "sparkd_iteration_tokens_count") == steps);
  CHECK(m.find("vllm:cache_config_info{model_name=\"demo\",engine=\"0\",block_size=\"16\"") !=
        std::string::npos);
  CHECK(sample(m, "vllm:kv_cache_usage_perc" + v) == 0);
  CHECK(sample(m, "vllm:inter_token_latency_seconds_count" + v) ==
        sample(m, "vllm:time_per_output_token_seconds_count" + v));

  // One HTTP request with n=2 runs two sequences: vLLM's running gauge counts the batch.
  json big = {{"prompt", "Once"},
              {"max_tokens", kContext - 8},
              {"ignore_eos", true},
              {"n", 2},
              {"stream", true}};
  std::string body = big.dump();
  std::string http =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(s.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::send(fd, http.data(), http.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(http.size()));
  double running = -1;
  for (int i = 0; i < 500 && running != 2; ++i) {
    m = s.call("GET", "/metrics").body;
    running = sample(m, "vllm:num_requests_running" + v);
    if (running != 2) std::this_thread::sleep_for(10ms);
  }
  CHECK(running == 2);
  CHECK(sample(m, "sparkd_http_requests_in_flight") == 1);
  CHECK(sample(m, "vllm:kv_cache_usage_perc" + v) > 0);
  ::close(fd);
}
