// The bench's sections and gates, the protocol around them (warm-up, probes of what the
// server accepts, medians of runs) and the memory sampler with its guard.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <thread>

#include "cli/bench.h"
#include "core/strings.h"
#include "spark/version.h"

namespace spark::cli::bench {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> n = {"c1",
                                             "c8",
                                             "ttft",
                                             "prefill",
                                             "prefix_cache",
                                             "short_during_long",
                                             "known_answers",
                                             "count",
                                             "rare_tokens",
                                             "tool_calls",
                                             "determinism"};
  return n;
}

namespace {

bool is_gate(const std::string& s) {
  return s == "known_answers" || s == "count" || s == "rare_tokens" || s == "tool_calls" ||
         s == "determinism";
}

// Median, min, max of samples (the protocol's summary of --runs runs).
json stats(std::vector<double> v) {
  if (v.empty()) return nullptr;
  json runs = v;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  double med = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  return {{"median", med}, {"min", v.front()}, {"max", v.back()}, {"runs", runs}};
}

// Nearest-rank percentile of sorted samples.
double pct(const std::vector<double>& sorted, double p) {
  size_t k = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, k == 0 ? 0 : k - 1)];
}

json error_json(const Error& e) {
  return {{"kind", std::string(errc_name(e.code))}, {"message", e.message}};
}

// What every sized prompt ends with (a one-token reply keeps decode out of the timing).
constexpr const char* kReplyOneWord = "\nReply with one word.";

// Filler text: ordinary English words (a few tokens each on every tokenizer we know),
// drawn from a seeded generator so two prompts share nothing but the vocabulary.
std::string words(size_t n, uint64_t seed) {
  static const char* w[] = {
      "river",  "mountain", "quiet",   "engine",  "harbor",  "lantern", "garden",   "signal",
      "copper", "meadow",   "thunder", "pocket",  "window",  "silver",  "planet",   "orchard",
      "candle", "bridge",   "winter",  "forest",  "market",  "pencil",  "rocket",   "valley",
      "basket", "anchor",   "crystal", "feather", "journey", "kitchen", "library",  "marble",
      "number", "ocean",    "puzzle",  "rabbit",  "saddle",  "timber",  "umbrella", "velvet",
      "wagon",  "yellow",   "zebra",   "arrow",   "bottle",  "castle",  "desert",   "echo"};
  std::mt19937_64 rng(seed);
  std::string s;
  s.reserve(n * 8);
  for (size_t i = 0; i < n; ++i) {
    if (i) s += (i % 12 == 0) ? ". " : " ";
    s += w[rng() % (sizeof w / sizeof *w)];
  }
  return s + ".";
}

struct Sampler {
  Sampler(MemorySource* s, uint64_t f, milliseconds i, int n, std::atomic<bool>* c)
      : src(s), floor(f), interval(i), need(n), cancel(c) {}
  MemorySource* src;
  uint64_t floor;
  milliseconds interval;
  int need;
  std::atomic<bool>* cancel;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread th;
  struct Node {
    std::string name;
    uint64_t min = UINT64_MAX;
    uint64_t last = 0;
    int low_run = 0;
    int samples = 0;
    std::string error;
  };
  std::vector<Node> nodes;
  std::string cancel_reason;

  void sample() {
    std::vector<Runner*> rs;
    for (auto& r : src->runners) rs.push_back(r.get());
    auto res = fan_out(rs, {"grep '^MemAvailable:' /proc/meminfo"}, milliseconds(4000));
    std::lock_guard lk(mu);
    for (size_t i = 0; i < res.size() && i < nodes.size(); ++i) {
      auto& n = nodes[i];
      uint64_t kb = 0;
      if (res[i].result.ok() && res[i].result->exit_status == 0) {
        auto parts = split_list(res[i].result->out, ' ');
        if (parts.size() >= 2) kb = parse_u64(parts[1]).value_or(0);
      }
      if (kb == 0) {
        n.error = res[i].result.ok() ? "could not read MemAvailable from /proc/meminfo"
                                     : res[i].result.error().message;
        continue;
      }
      uint64_t b = kb * 1024;
      ++n.samples;
      n.last = b;
      n.min = std::min(n.min, b);
      n.low_run = b < floor ? n.low_run + 1 : 0;
      if (n.low_run >= need && cancel_reason.empty()) {
        cancel_reason = fmt::format(
            "node {}: MemAvailable {} stayed under BENCH_MEM_MIN {} for {} samples {:.0f} s "
            "apart; the run was cancelled (raise the floor's headroom: stop other work on the "
            "node, or lower BENCH_MEM_MIN)",
            n.name, format_size(b), format_size(floor), need, interval.count() / 1000.0);
        cancel->store(true);
      }
    }
  }
  void start() {
    for (auto& r : src->runners) {
      Node n;
      n.name = r->node();
      nodes.push_back(n);
    }
    if (nodes.empty()) return;
    th = std::thread([this] {
      std::unique_lock lk(mu);
      while (!stop) {
        lk.unlock();
        sample();
        lk.lock();
        cv.wait_for(lk, interval, [this] { return stop; });
      }
    });
  }
  void finish() {
    {
      std::lock_guard lk(mu);
      stop = true;
    }
    cv.notify_all();
    if (th.joinable()) th.join();
  }
  json report() {
    std::lock_guard lk(mu);
    if (nodes.empty()) return {{"sampled", false}, {"reason", src->why_none}};
    json j = {{"sampled", true},
              {"interval_s", interval.count() / 1000.0},
              {"floor_bytes", floor},
              {"nodes", json::array()}};
    uint64_t lowest = UINT64_MAX;
    for (const auto& n : nodes) {
      json e = {{"node", n.name}, {"samples", n.samples}};
      e["min_available_bytes"] = n.samples ? json(n.min) : json(nullptr);
      if (!n.error.empty()) e["error"] = n.error;
      if (n.samples) lowest = std::min(lowest, n.min);
      j["nodes"].push_back(e);
    }
    j["min_available_bytes"] = lowest == UINT64_MAX ? json(nullptr) : json(lowest);
    return j;
  }
};

struct Known {
  std::string id, prompt;
  std::vector<std::string> expect;
  int max_tokens = 64;
};

Result<std::vector<Known>> load_known(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return make_error(Errc::not_found,
                      fmt::format("known-answer set {}: cannot open it (name a JSONL file with "
                                  "--known-answers)",
                                  path));
  std::vector<Known> out;
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    if (trim(line).empty() || trim(line)[0] == '#') continue;
    json j = json::parse(line, nullptr, false);
    auto bad = [&](const std::string& why) {
      return make_error(Errc::config, fmt::format("{}:{}: {}", path, no, why));
    };
    if (!j.is_object()) return bad("not a JSON object");
    Known k;
    if (!j.contains("prompt") || !j["prompt"].is_string() || j["prompt"].get<std::string>().empty())
      return bad("no \"prompt\" string");
    k.prompt = j["prompt"].get<std::string>();
    k.id = j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>()
                                                   : fmt::format("line {}", no);
    if (!j.contains("expect")) return bad("no \"expect\" (a string or an array of strings)");
    const auto& e = j["expect"];
    if (e.is_string())
      k.expect.push_back(e.get<std::string>());
    else if (e.is_array())
      for (const auto& x : e) {
        if (!x.is_string()) return bad("\"expect\" holds something that is not a string");
        k.expect.push_back(x.get<std::string>());
      }
    if (k.expect.empty() || std::any_of(k.expect.begin(), k.expect.end(),
                                        [](const std::string& s) { return s.empty(); }))
      return bad("\"expect\" must hold at least one non-empty string");
    if (j.contains("max_tokens")) {
      if (!j["max_tokens"].is_number_integer() || j["max_tokens"].get<int>() < 1)
        return bad("\"max_tokens\" must be a positive integer");
      k.max_tokens = j["max_tokens"].get<int>();
    }
    out.push_back(std::move(k));
  }
  if (out.empty()) return make_error(Errc::config, fmt::format("{}: no questions in it", path));
  return out;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The answer without a <think> block the server left in the content.
std::string strip_thinking(const std::string& s) {
  auto e = s.find("</think>");
  return e == std::string::npos ? s : s.substr(e + 8);
}

std::string snippet(const std::string& s, size_t n = 160) {
  std::string t = s.size() > n ? s.substr(0, n) + "..." : s;
  return t;
}

class Bench {
 public:
  Bench(const Options& o, MemorySource& mem, const Progress& p)
      : o_(o), progress_(p), sampler_(&mem, o.mem_min, o.mem_interval, o.mem_samples, &cancel_) {
    std::random_device rd;
    salt_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }

  json run() {
    json res = {
        {"schema", "sparkctl-bench/1"}, {"sparkctl_version", kVersion}, {"base", o_.ep.base}};
    {
      auto t = std::time(nullptr);
      char buf[32];
      std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
      res["started"] = buf;
    }
    sampler_.start();
    json sections = json::object(), gates = json::object();
    auto setup = prepare();
    if (!setup.ok()) {
      res["error"] = error_json(setup.error());
    } else {
      res["server"] = server_;
      res["protocol"] = protocol_;
      for (const auto& name : section_names()) {
        if (!o_.sections.empty() &&
            std::find(o_.sections.begin(), o_.sections.end(), name) == o_.sections.end())
          continue;
        if (cancel_) break;
        say(fmt::format("{} ...", name));
        auto t0 = Clock::now();
        gate_now_ = is_gate(name);
        Result<json> r = run_one(name);
        json out;
        if (r.ok())
          out = std::move(*r);
        else
          out = {{"error", error_json(r.error())}};
        out["seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
        if (cancel_ && !out.contains("error"))
          out["error"] = error_json(make_error(Errc::resource, "cancelled by the memory guard"));
        say(fmt::format("{} done in {:.1f} s{}", name, out["seconds"].get<double>(),
                        out.contains("error")  ? ": " + out["error"]["message"].get<std::string>()
                        : out.contains("pass") ? (out["pass"].get<bool>() ? ": pass" : ": FAIL")
                                               : ""));
        (is_gate(name) ? gates : sections)[name] = std::move(out);
      }
    }
    sampler_.finish();
    res["sections"] = sections;
    res["gates"] = gates;
    res["memory"] = sampler_.report();
    res["cancelled"] =
        sampler_.cancel_reason.empty() ? json(nullptr) : json{{"reason", sampler_.cancel_reason}};
    res["label"] = o_.label.empty() ? fmt::format("{} @ {}", model_, o_.ep.base) : o_.label;
    bool ok = !res.contains("error") && sampler_.cancel_reason.empty();
    for (const auto* g : {&sections, &gates})
      for (const auto& [k, v] : g->items())
        ok = ok && !v.contains("error") && v.value("pass", true);
    res["ok"] = ok;
    return res;
  }

 private:
  void say(const std::string& s) {
    if (progress_) progress_(s);
  }
  uint64_t salt() { return salt_ + (++counter_) * 0x9E3779B97F4A7C15ull; }
  std::string salted(size_t n_words) {
    uint64_t s = salt();
    return fmt::format("[{:016x}] ", s) + words(n_words, s);
  }

  // A chat request with the run's protocol applied.
  json request(json messages, int max_tokens, bool fixed_length = true) {
    json b = {{"model", model_},
              {"messages", std::move(messages)},
              {"max_tokens", max_tokens},
              {"temperature", o_.temperature}};
    if (fixed_length && ignore_eos_) b["ignore_eos"] = true;
    if (kwargs_) b["chat_template_kwargs"] = {{"enable_thinking", o_.thinking}};
    return b;
  }
  json user(const std::string& text) {
    return json::array({{{"role", "user"}, {"content", text}}});
  }

  Result<Generation> gen(json body, const std::string& what) {
    if (o_.gate_max_tokens > 0 && gate_now_ && body["max_tokens"].get<int>() > o_.gate_max_tokens)
      body["max_tokens"] = o_.gate_max_tokens;
    return generate(o_.ep, std::move(body), o_.dl, what, &cancel_);
  }

  // Words for a prompt of about `tokens` tokens (from the calibration).
  size_t words_for(int tokens) const {
    double w = (tokens - overhead_) / per_word_;
    return static_cast<size_t>(std::max(1.0, w));
  }

  Status prepare() {
    auto models = get_json(o_.ep, o_.ep.prefix + "/models", milliseconds(10000));
    if (!models) return models.error();
    const json& data = (*models).contains("data") ? (*models)["data"] : json();
    if (!data.is_array() || data.empty() || !data[0].is_object() || !data[0].contains("id"))
      return make_error(Errc::remote,
                        fmt::format("GET http://{}:{}{}/models: no model in the reply", o_.ep.host,
                                    o_.ep.port, o_.ep.prefix));
    model_ = o_.model.empty() ? data[0]["id"].get<std::string>() : o_.model;
    server_ = {{"model_id", data[0]["id"]}};
    for (const auto& m : data)
      if (m.is_object() && m.value("id", "") == model_) {
        server_["model_id"] = model_;
        if (m.contains("max_model_len") && m["max_model_len"].is_number_integer())
          max_len_ = m["max_model_len"].get<int>();
        if (m.contains("owned_by")) server_["owned_by"] = m["owned_by"];
      }
    if (max_len_ > 0) server_["max_model_len"] = max_len_;
    // Version: vLLM's /version, else our /health; the Server header otherwise.
    server_["version"] = nullptr;
    for (const char* p : {"/version", "/health"}) {
      auto v = get_json(o_.ep, p, milliseconds(5000));
      if (v.ok() && v->is_object() && v->contains("version") && (*v)["version"].is_string()) {
        server_["version"] = (*v)["version"];
        server_["version_from"] = p;
        break;
      }
    }
    say(fmt::format(
        "model {} at {} (server version {})", model_, o_.ep.base,
        server_["version"].is_string() ? server_["version"].get<std::string>() : "unknown"));
    // The first request after boot can be several times slower: sent, timed, discarded.
    auto w = gen(request(user("Say hello."), 8, false), "warm-up request");
    if (!w) return w.error();
    protocol_["warmup"] = {{"discarded", true}, {"seconds", w->total}};
    // What the server accepts. A 400 naming the field means it does not.
    auto probe = gen(
        [&] {
          json b = request(user("Write a long story about the sea."), 16, false);
          b["ignore_eos"] = true;
          return b;
        }(),
        "ignore_eos probe");
    if (probe.ok()) {
      ignore_eos_ = true;
      protocol_["ignore_eos"] =
          probe->tokens == 16
              ? "accepted"
              : fmt::format(
                    "accepted, but the reply ended after {} of 16 tokens (not honoured: "
                    "decode figures are of replies of varying length)",
                    probe->tokens);
    } else if (probe.error().code == Errc::remote) {
      protocol_["ignore_eos"] = "refused by the server (" + probe.error().message +
                                "): max_tokens is an upper bound, decode figures count the "
                                "tokens each reply had";
    } else {
      return probe.error();
    }
    auto kw = gen(
        [&] {
          json b = request(user("Say hello."), 4, false);
          b["chat_template_kwargs"] = {{"enable_thinking", o_.thinking}};
          return b;
        }(),
        "chat_template_kwargs probe");
    if (kw.ok()) {
      kwargs_ = true;
      protocol_["chat_template_kwargs"] = "accepted";
    } else if (kw.error().code == Errc::remote) {
      protocol_["chat_template_kwargs"] =
          "refused by the server (" + kw.error().message + "): thinking cannot be switched";
    } else {
      return kw.error();
    }
    // Calibration: template overhead and tokens per filler word, from usage, framed like
    // the sized prompts (salt ahead, instruction behind) so that the overhead counts them.
    auto a = gen(request(user(salted(1) + kReplyOneWord), 1, false), "calibration request 1");
    if (!a) return a.error();
    auto b = gen(request(user(salted(200) + kReplyOneWord), 1, false), "calibration request 2");
    if (!b) return b.error();
    if (a->prompt_tokens > 0 && b->prompt_tokens > a->prompt_tokens) {
      overhead_ = a->prompt_tokens;
      per_word_ = (b->prompt_tokens - a->prompt_tokens) / 199.0;
      protocol_["calibration"] = {{"template_tokens", overhead_}, {"tokens_per_word", per_word_}};
    } else {
      protocol_["calibration"] =
          "the server reports no usage.prompt_tokens: prompt sizes are estimates (1.3 tokens "
          "per word)";
    }
    protocol_["runs"] = o_.runs;
    protocol_["temperature"] = o_.temperature;
    protocol_["thinking"] = o_.thinking;
    protocol_["decode_max_tokens"] = o_.decode_tokens;
    return Status::Ok();
  }

  bool fits(int tokens, int max_tokens) const {
    return max_len_ <= 0 || tokens + max_tokens <= max_len_;
  }

  Result<json> run_one(const std::string& n) {
    if (n == "c1") return c1();
    if (n == "c8") return c8();
    if (n == "ttft") return ttft();
    if (n == "prefill") return prefill();
    if (n == "prefix_cache") return prefix_cache();
    if (n == "short_during_long") return short_during_long();
    if (n == "known_answers") return known_answers();
    if (n == "count") return count();
    if (n == "rare_tokens") return rare_tokens();
    if (n == "tool_calls") return tool_calls();
    if (n == "determinism") return determinism();
    return make_error(Errc::internal, "unknown section " + n);
  }

  json length_note(const std::vector<int>& tokens) {
    for (int t : tokens)
      if (t != o_.decode_tokens)
        return fmt::format("a reply had {} tokens of max_tokens {}{}", t, o_.decode_tokens,
                           ignore_eos_ ? "" : " (the server refused ignore_eos)");
    return nullptr;
  }

  Result<json> c1() {
    std::vector<double> rate, ttft;
    std::vector<int> toks;
    for (int i = 0; i < o_.runs; ++i) {
      auto g =
          gen(request(user("Tell me a long story about a lighthouse keeper."), o_.decode_tokens),
              fmt::format("c1 run {}", i + 1));
      if (!g) return g.error();
      rate.push_back(g->decode_rate());
      ttft.push_back(g->ttft);
      toks.push_back(g->tokens);
    }
    return json{{"tokens_per_s", stats(rate)},
                {"ttft_s", stats(ttft)},
                {"tokens", toks},
                {"length_note", length_note(toks)}};
  }

  Result<json> c8() {
    std::vector<double> agg, per;
    std::vector<int> toks;
    const int c = o_.concurrency;
    for (int i = 0; i < o_.runs; ++i) {
      std::vector<std::optional<Result<Generation>>> gs(static_cast<size_t>(c));
      std::vector<std::thread> th;
      auto t0 = Clock::now();
      for (int k = 0; k < c; ++k)
        th.emplace_back([&, k] {
          gs[static_cast<size_t>(k)] =
              gen(request(user(fmt::format("Stream {}: tell me a long story about a harbor.", k)),
                          o_.decode_tokens),
                  fmt::format("c{} run {} stream {}", c, i + 1, k + 1));
        });
      for (auto& t : th) t.join();
      double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      int total = 0;
      std::vector<double> rates;
      for (auto& g : gs) {
        if (!g->ok()) return g->error();
        total += (*g)->tokens;
        toks.push_back((*g)->tokens);
        rates.push_back((*g)->decode_rate());
      }
      agg.push_back(total / wall);
      auto s = stats(rates);
      per.push_back(s["median"].get<double>());
    }
    return json{{"streams", c},
                {"aggregate_tokens_per_s", stats(agg)},
                {"per_stream_tokens_per_s", stats(per)},
                {"length_note", length_note(toks)}};
  }

  Result<json> ttft() {
    std::vector<double> t;
    for (int i = 0; i < o_.ttft_samples; ++i) {
      auto g =
          gen(request(user(salted(8) + " Answer in one word: what colour is the sky?"), 4, false),
              fmt::format("ttft sample {}", i + 1));
      if (!g) return g.error();
      t.push_back(g->ttft);
    }
    std::sort(t.begin(), t.end());
    return json{
        {"samples", t.size()}, {"p50_s", pct(t, 50)}, {"p95_s", pct(t, 95)}, {"max_s", t.back()}};
  }

  Result<json> prefill() {
    json sizes = json::array();
    std::vector<int> ordered = o_.prefill_sizes;
    std::sort(ordered.begin(), ordered.end());
    for (int size : ordered) {
      json e = {{"target_tokens", size}};
      if (!fits(size, 1)) {
        e["skipped"] = fmt::format("over the server's max_model_len {}", max_len_);
        sizes.push_back(e);
        continue;
      }
      std::vector<double> rate, ttft;
      int ptoks = -1;
      double n_words = static_cast<double>(words_for(size));
      for (int i = 0; i < o_.runs; ++i) {
        // Salted at the start: no two prompts share a prefix, so none is a cache hit.
        auto g = gen(request(user(salted(static_cast<size_t>(std::max(1.0, n_words))) +
                                  kReplyOneWord),
                             1, false),
                     fmt::format("prefill {} run {}", size, i + 1));
        if (!g) return g.error();
        ptoks = g->prompt_tokens;
        // Random words tokenize unevenly: steer the next run toward the target from this
        // run's count, so the sizes reported converge on those asked for.
        if (ptoks > 0 && per_word_ > 0) n_words += (size - ptoks) / per_word_;
        // Tokens actually computed: the chat template's fixed head (the same in every
        // request) may come from the prefix cache even though the salt follows it.
        double n = ptoks > 0 ? ptoks - std::max(0, g->cached_tokens) : size;
        rate.push_back(n / g->ttft);
        ttft.push_back(g->ttft);
        if (g->cached_tokens > 0) e["cached_tokens_seen"] = g->cached_tokens;
      }
      e["prompt_tokens"] = ptoks;
      e["ttft_s"] = stats(ttft);
      e["tokens_per_s"] = stats(rate);
      sizes.push_back(e);
    }
    check_inversion(sizes);
    return json{{"sizes", sizes}};
  }

  Result<json> prefix_cache() {
    if (!fits(o_.prefix_tokens + 64, 8))
      return json{{"skipped", fmt::format("a {}-token prefix is over max_model_len {}",
                                          o_.prefix_tokens, max_len_)}};
    std::vector<double> cold, warm, hit;
    bool reported = true;
    for (int i = 0; i < o_.runs; ++i) {
      json msgs =
          json::array({{{"role", "system"},
                        {"content", "Context document:\n" + salted(words_for(o_.prefix_tokens))}},
                       {{"role", "user"}, {"content", "Summarize the document in one sentence."}}});
      auto a = gen(request(msgs, 8, false), fmt::format("prefix-cache run {} first turn", i + 1));
      if (!a) return a.error();
      msgs.push_back({{"role", "assistant"}, {"content", a->text.empty() ? "OK." : a->text}});
      msgs.push_back({{"role", "user"}, {"content", "Now name one word from it."}});
      auto b = gen(request(msgs, 8, false), fmt::format("prefix-cache run {} follow-up", i + 1));
      if (!b) return b.error();
      cold.push_back(a->ttft);
      warm.push_back(b->ttft);
      if (b->cached_tokens >= 0 && b->prompt_tokens > 0)
        hit.push_back(static_cast<double>(b->cached_tokens) / b->prompt_tokens);
      else
        reported = false;
    }
    json j = {{"prefix_tokens", o_.prefix_tokens},
              {"cold_ttft_s", stats(cold)},
              {"followup_ttft_s", stats(warm)}};
    if (reported) {
      j["hit_rate"] = stats(hit);
    } else {
      j["hit_rate"] = nullptr;
      j["note"] =
          "the server reports no usage.prompt_tokens_details.cached_tokens: the hit rate is "
          "unknown; compare the TTFTs";
    }
    return j;
  }

  Result<json> short_during_long() {
    if (!fits(o_.long_tokens + 64, 1))
      return json{{"skipped", fmt::format("a {}-token prompt is over max_model_len {}",
                                          o_.long_tokens, max_len_)}};
    std::vector<double> shorts, longs;
    int blocked = 0, inconclusive = 0;
    for (int i = 0; i < o_.runs; ++i) {
      std::optional<Result<Generation>> lg;
      std::string text = salted(words_for(o_.long_tokens)) + kReplyOneWord;
      std::thread th([&] {
        lg = gen(request(user(text), 1, false), fmt::format("long prefill run {}", i + 1));
      });
      // Give the long request a head start so that its prefill is under way.
      std::this_thread::sleep_for(milliseconds(100));
      auto s = gen(request(user(salted(4) + " Say yes."), 4, false),
                   fmt::format("short request run {}", i + 1));
      th.join();
      if (!s) return s.error();
      if (!lg->ok()) return lg->error();
      shorts.push_back(s->ttft);
      longs.push_back((*lg)->ttft);
      // Blocked: the short one (sent 100 ms after the long one) got its first token only
      // when the long prefill was (nearly) done, i.e. it waited behind it.
      // Inconclusive: the long prefill was over before the short one was sent.
      if ((*lg)->ttft <= 0.15)
        ++inconclusive;
      else if (0.1 + s->ttft >= 0.9 * (*lg)->ttft)
        ++blocked;
    }
    return json{{"long_tokens", o_.long_tokens},     {"short_ttft_s", stats(shorts)},
                {"long_ttft_s", stats(longs)},       {"blocked_runs", blocked},
                {"inconclusive_runs", inconclusive}, {"runs", o_.runs}};
  }

  Result<json> known_answers() {
    std::string path = o_.known_answers;
    auto set = load_known(path);
    if (!set) return set.error();
    json modes = json::object();
    bool pass = true;
    for (bool think : {false, true}) {
      const char* mode = think ? "thinking_on" : "thinking_off";
      if (!kwargs_ && think) {
        modes[mode] = {{"skipped", "the server refused chat_template_kwargs"}};
        continue;
      }
      int right = 0;
      json wrong = json::array();
      for (const auto& k : *set) {
        json b =
            request(user(k.prompt),
                    think ? std::max(k.max_tokens, o_.thinking_max_tokens) : k.max_tokens, false);
        if (kwargs_) b["chat_template_kwargs"] = {{"enable_thinking", think}};
        auto g = gen(b, fmt::format("known answer {} ({})", k.id, mode));
        if (!g) return g.error();
        std::string ans = lower(strip_thinking(g->text));
        bool ok = std::any_of(k.expect.begin(), k.expect.end(), [&](const std::string& e) {
          return ans.find(lower(e)) != std::string::npos;
        });
        if (ok)
          ++right;
        else
          wrong.push_back({{"id", k.id}, {"expected", k.expect}, {"got", snippet(g->text)}});
      }
      pass = pass && right == static_cast<int>(set->size());
      modes[mode] = {{"right", right}, {"total", set->size()}, {"wrong", wrong}};
    }
    return json{{"pass", pass}, {"set", path}, {"modes", modes}};
  }

  Result<json> count() {
    const int n = o_.count_to;
    std::string prompt = fmt::format(
        "Count from 1 to {}, one number after another separated by single spaces. Output only "
        "the numbers.",
        n);
    json runs = json::array();
    std::vector<std::string> texts;
    bool pass = true;
    for (int i = 0; i < 3; ++i) {
      auto g = gen(request(user(prompt), n * 4 + 16, false), fmt::format("count run {}", i + 1));
      if (!g) return g.error();
      std::string t = strip_thinking(g->text);
      texts.push_back(t);
      std::vector<int> got;
      static const std::regex num("[0-9]+");
      for (auto it = std::sregex_iterator(t.begin(), t.end(), num); it != std::sregex_iterator();
           ++it)
        if (it->str().size() < 9) got.push_back(std::stoi(it->str()));
      int wrong_at = 0;
      for (int k = 0; k < n; ++k)
        if (k >= static_cast<int>(got.size()) || got[static_cast<size_t>(k)] != k + 1) {
          wrong_at = k + 1;
          break;
        }
      bool ok = wrong_at == 0 && static_cast<int>(got.size()) == n;
      json r = {{"pass", ok}, {"numbers", got.size()}};
      if (!ok)
        r["problem"] = wrong_at ? fmt::format("number {} is missing or wrong", wrong_at)
                                : fmt::format("{} more numbers after {}",
                                              got.size() - static_cast<size_t>(n), n);
      r["got"] = snippet(t, 80);
      pass = pass && ok;
      runs.push_back(r);
    }
    bool same = texts[0] == texts[1] && texts[1] == texts[2];
    return json{{"pass", pass}, {"to", n}, {"runs", runs}, {"identical", same}};
  }

  Result<json> rare_tokens() {
    static const std::vector<std::pair<const char*, const char*>> probes = {
        {"korean", "다람쥐 헌 쳇바퀴에 타고파. 햇빛이 선명하게 나뭇잎을 비추는 숲속"},
        {"japanese", "いろはにほへと ちりぬるを 鰯の頭も信心から"},
        {"thai", "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน"},
        {"georgian", "ქართული ენა ერთ-ერთი უძველესი ენაა"},
        {"devanagari", "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश"},
        {"emoji", "🦀🧬🪐 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q"}};
    json items = json::array();
    bool pass = true;
    for (const auto& [name, text] : probes) {
      auto g =
          gen(request(user(fmt::format("Repeat exactly, and nothing else: {}", text)), 64, false),
              fmt::format("rare-token probe {}", name));
      json e = {{"script", name}};
      if (!g) {
        if (g.error().code != Errc::integrity) return g.error();
        e["pass"] = false;
        e["problem"] = g.error().message;
        pass = false;
        items.push_back(e);
        continue;
      }
      std::string all = g->reasoning + g->text;
      bool fffd = all.find("\xEF\xBF\xBD") != std::string::npos;
      bool invalid = utf8_invalid_at(all) != std::string::npos;
      e["pass"] = !fffd && !invalid;
      if (fffd) e["problem"] = "U+FFFD (a replacement character) in the reply";
      if (invalid) e["problem"] = "invalid UTF-8 in the reply";
      e["echoed"] = trim(strip_thinking(g->text)) == text;
      e["got"] = snippet(g->text, 80);
      pass = pass && e["pass"].get<bool>();
      items.push_back(e);
    }
    return json{{"pass", pass}, {"probes", items}};
  }

  static json tools_schema() {
    auto fn = [](const char* name, const char* desc, json props, json required) {
      return json{
          {"type", "function"},
          {"function",
           {{"name", name},
            {"description", desc},
            {"parameters", {{"type", "object"}, {"properties", props}, {"required", required}}}}}};
    };
    return json::array(
        {fn("read_file", "Read a file of the workspace.",
            {{"path", {{"type", "string"}, {"description", "path of the file"}}}}, {"path"}),
         fn("write_file", "Write text to a file of the workspace.",
            {{"path", {{"type", "string"}}}, {"content", {{"type", "string"}}}},
            {"path", "content"}),
         fn("run_shell", "Run a shell command and return its output.",
            {{"command", {{"type", "string"}}},
             {"timeout_s", {{"type", "integer"}, {"description", "seconds"}}}},
            {"command"}),
         fn("search_web", "Search the web.",
            {{"query", {{"type", "string"}}}, {"max_results", {{"type", "integer"}}}}, {"query"})});
  }

  Result<json> tool_calls() {
    struct Task {
      const char* tool;
      const char* prompt;
      std::vector<std::string> required;
    };
    static const std::vector<Task> tasks = {
        {"read_file", "Show me what is in src/main.cc.", {"path"}},
        {"run_shell", "List the files of the current directory with ls -la.", {"command"}},
        {"write_file", "Create notes.txt holding the text 'buy milk'.", {"path", "content"}},
        {"search_web", "Search the web for the boiling point of ethanol.", {"query"}},
        {"read_file", "Open the file README.md and show it.", {"path"}},
        {"run_shell", "How much disk space is free? Run df -h.", {"command"}},
        {"write_file", "Save 'hello world' to greeting.txt.", {"path", "content"}},
        {"search_web", "Look up who wrote The Name of the Rose.", {"query"}}};
    json calls = json::array();
    int right = 0;
    for (int i = 0; i < o_.tool_calls; ++i) {
      const auto& t = tasks[static_cast<size_t>(i) % tasks.size()];
      json b = request(json::array({{{"role", "system"},
                                     {"content",
                                      "You are a coding agent. Use exactly one tool call to do "
                                      "what the user asks."}},
                                    {{"role", "user"}, {"content", t.prompt}}}),
                       o_.thinking ? o_.thinking_max_tokens : 256, false);
      b["tools"] = tools_schema();
      b["tool_choice"] = "auto";
      auto g = gen(b, fmt::format("tool call {} ({})", i + 1, t.tool));
      if (!g) return g.error();
      json e = {{"expected", t.tool}};
      std::string problem;
      if (g->tool_calls.empty()) {
        problem = "no tool call (text: " + snippet(g->text, 60) + ")";
      } else {
        const auto& c = g->tool_calls[0];
        std::string name = c.value("name", "");
        e["name"] = name;
        json args = json::parse(c.value("arguments", ""), nullptr, false);
        if (name != t.tool)
          problem = fmt::format("called '{}' instead of '{}'", name, t.tool);
        else if (args.is_discarded() || !args.is_object())
          problem = "the arguments are not a JSON object: " + snippet(c.value("arguments", ""), 60);
        else
          for (const auto& r : t.required)
            if (!args.contains(r)) {
              problem = "the arguments lack '" + r + "'";
              break;
            }
      }
      e["pass"] = problem.empty();
      if (!problem.empty()) e["problem"] = problem;
      if (problem.empty()) ++right;
      calls.push_back(e);
    }
    return json{{"pass", right == o_.tool_calls},
                {"right", right},
                {"total", o_.tool_calls},
                {"calls", calls}};
  }

  Result<json> determinism() {
    auto once = [&](int k) {
      json b = request(user("Write a short poem about the moon."), 32, false);
      b["temperature"] = 0.8;
      b["seed"] = 1234;
      b["logprobs"] = true;
      return gen(b, fmt::format("determinism run {}", k));
    };
    auto a = once(1);
    if (!a) return a.error();
    auto b = once(2);
    if (!b) return b.error();
    json j = {{"seed", 1234}, {"same_text", a->text == b->text}};
    bool pass = a->text == b->text;
    if (!pass)
      j["problem"] = "the same seed gave two texts: '" + snippet(a->text, 60) + "' and '" +
                     snippet(b->text, 60) + "'";
    if (a->logprobs.empty() || b->logprobs.empty()) {
      j["same_logprobs"] = nullptr;
      j["logprobs_note"] = "the server returned no logprobs";
    } else {
      double diff = a->logprobs.size() == b->logprobs.size() ? 0 : INFINITY;
      for (size_t i = 0; i < std::min(a->logprobs.size(), b->logprobs.size()); ++i)
        diff = std::max(diff, std::fabs(a->logprobs[i] - b->logprobs[i]));
      bool same = diff <= 1e-4;
      j["same_logprobs"] = same;
      j["max_logprob_diff"] = std::isfinite(diff) ? json(diff) : json("lengths differ");
      if (!same && pass) j["problem"] = "the same seed gave different logprobs";
      pass = pass && same;
    }
    j["pass"] = pass;
    return j;
  }

  const Options& o_;
  Progress progress_;
  std::atomic<bool> cancel_{false};
  Sampler sampler_;
  uint64_t salt_ = 0, counter_ = 0;
  std::string model_;
  json server_ = json::object(), protocol_ = json::object();
  int max_len_ = 0;
  bool ignore_eos_ = false, kwargs_ = false, gate_now_ = false;
  double overhead_ = 0, per_word_ = 1.3;
};

}  // namespace

void check_inversion(json& sizes) {
  double prev_rate = 0;
  int prev_size = 0;
  for (auto& e : sizes) {
    if (!e.contains("tokens_per_s") || !e["tokens_per_s"].is_object()) continue;
    double med = e["tokens_per_s"]["median"].get<double>();
    if (prev_size > 0 && med > prev_rate) {
      // Prefill per token cannot get cheaper with length: the figure is noise.
      e["noise"] = fmt::format(
          "{:.0f} tok/s is faster than {:.0f} tok/s at {} tokens: a longer prompt cannot "
          "prefill faster, so this figure is noise and not reported (raise --runs)",
          med, prev_rate, prev_size);
      e["discarded_tokens_per_s"] = e["tokens_per_s"];
      e["tokens_per_s"] = nullptr;
    } else {
      prev_rate = med;
      prev_size = e.value("target_tokens", 0);
    }
  }
}

json run(const Options& o, MemorySource& mem, const Progress& progress) {
  Bench b(o, mem, progress);
  return b.run();
}

int result_exit_code(const json& r) {
  if (r.contains("cancelled") && !r["cancelled"].is_null()) return exit_code(Errc::resource);
  auto code_of = [](const json& e) {
    std::string k = e.value("kind", "internal");
    for (int c = 0; c <= static_cast<int>(Errc::internal); ++c)
      if (errc_name(static_cast<Errc>(c)) == k) return exit_code(static_cast<Errc>(c));
    return exit_code(Errc::internal);
  };
  if (r.contains("error")) return code_of(r["error"]);
  for (const char* part : {"sections", "gates"})
    if (r.contains(part))
      for (const auto& [k, v] : r[part].items())
        if (v.contains("error")) return code_of(v["error"]);
  if (r.contains("gates"))
    for (const auto& [k, v] : r["gates"].items())
      if (!v.value("pass", true)) return exit_code(Errc::integrity);
  return 0;
}

}  // namespace spark::cli::bench
