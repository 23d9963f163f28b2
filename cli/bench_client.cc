// The bench's client: one streamed chat request, measured, with every reply checked
// against the protocol (status, SSE, JSON chunks, usage).
#include <fmt/format.h>

#include "cli/bench.h"
#include "core/http_client.h"
#include "core/sse_client.h"
#include "core/strings.h"

namespace spark::cli::bench {

using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

HttpCall base_call(const Endpoint& ep, const std::string& method, const std::string& target) {
  HttpCall c;
  c.method = method;
  c.host = ep.host;
  c.port = ep.port;
  c.target = target;
  if (!ep.api_key.empty()) c.headers.emplace_back("Authorization", "Bearer " + ep.api_key);
  return c;
}

// The server's error message from an error body, or the body's start.
std::string error_text(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error")) {
    const auto& e = j["error"];
    if (e.is_object() && e.contains("message") && e["message"].is_string())
      return e["message"].get<std::string>();
    if (e.is_string()) return e.get<std::string>();
  }
  std::string s(trim(body.substr(0, 300)));
  if (utf8_invalid_at(s) != std::string::npos) s = "(a body that is not UTF-8)";
  return s.empty() ? "(empty body)" : s;
}

}  // namespace

Result<Endpoint> parse_base(const std::string& url) {
  auto u = parse_url(url);
  if (!u) return u.error();
  Endpoint ep;
  ep.host = u->host;
  ep.port = u->port;
  std::string path = u->target;
  while (!path.empty() && path.back() == '/') path.pop_back();
  ep.prefix = path.empty() ? "/v1" : path;
  ep.base = url;
  return ep;
}

double Generation::decode_rate() const {
  double span = last_token - ttft;
  if (tokens <= 1 || span <= 0) return 0;
  return (tokens - 1) / span;
}

Result<json> get_json(const Endpoint& ep, const std::string& target,
                      std::chrono::milliseconds timeout) {
  HttpCall c = base_call(ep, "GET", target);
  c.timeout = timeout;
  auto r = http_call(c);
  if (!r) return r.error();
  if (r->status != 200)
    return make_error(r->status == 401 || r->status == 403 ? Errc::auth : Errc::remote,
                      fmt::format("GET http://{}:{}{}: HTTP {}: {}", ep.host, ep.port, target,
                                  r->status, error_text(r->body)));
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded())
    return make_error(Errc::remote, fmt::format("GET http://{}:{}{}: the reply is not JSON: {}",
                                                ep.host, ep.port, target, error_text(r->body)));
  return j;
}

Result<Generation> generate(const Endpoint& ep, json body, const Deadlines& dl,
                            const std::string& what, const std::atomic<bool>* cancel) {
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpCall c = base_call(ep, "POST", ep.prefix + "/chat/completions");
  c.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  StreamLimits lim;
  lim.headers = dl.headers;
  lim.idle = dl.idle;
  lim.total = dl.total;
  if (cancel) lim.stop = [cancel] { return cancel->load(); };
  Generation g;
  std::optional<Error> bad;
  bool cancelled = false;
  uint64_t chunk_no = 0;
  const auto t0 = Clock::now();
  auto on_event = [&](std::string_view data) {
    ++chunk_no;
    if (cancel && cancel->load()) {
      cancelled = true;
      return false;
    }
    std::string raw(data);
    size_t badat = utf8_invalid_at(raw);
    json j = json::parse(raw, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      if (badat != std::string::npos)
        bad = make_error(Errc::integrity, fmt::format("{}: chunk {} holds invalid UTF-8 at byte {}",
                                                      what, chunk_no, badat));
      else
        bad = make_error(Errc::remote, fmt::format("{}: chunk {} is not a JSON object: {}", what,
                                                   chunk_no, raw.substr(0, 120)));
      return false;
    }
    if (j.contains("error")) {
      bad = make_error(Errc::remote, fmt::format("{}: the server failed mid-stream (chunk {}): {}",
                                                 what, chunk_no, error_text(raw)));
      return false;
    }
    if (j.contains("model") && j["model"].is_string()) g.model = j["model"].get<std::string>();
    if (j.contains("usage") && j["usage"].is_object()) {
      const auto& u = j["usage"];
      g.usage_seen = true;
      if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
        g.tokens = u["completion_tokens"].get<int>();
      if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
        g.prompt_tokens = u["prompt_tokens"].get<int>();
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
          u["prompt_tokens_details"].contains("cached_tokens") &&
          u["prompt_tokens_details"]["cached_tokens"].is_number_integer())
        g.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].get<int>();
    }
    if (!j.contains("choices")) return true;
    if (!j["choices"].is_array()) {
      bad = make_error(Errc::remote, fmt::format("{}: chunk {} has 'choices' that is not an array",
                                                 what, chunk_no));
      return false;
    }
    for (const auto& ch : j["choices"]) {
      if (!ch.is_object() || ch.value("index", 0) != 0) continue;
      if (ch.contains("finish_reason") && ch["finish_reason"].is_string())
        g.finish_reason = ch["finish_reason"].get<std::string>();
      if (ch.contains("logprobs") && ch["logprobs"].is_object() &&
          ch["logprobs"].contains("content") && ch["logprobs"]["content"].is_array())
        for (const auto& t : ch["logprobs"]["content"])
          if (t.is_object() && t.contains("logprob") && t["logprob"].is_number())
            g.logprobs.push_back(t["logprob"].get<double>());
      if (!ch.contains("delta") || !ch["delta"].is_object()) continue;
      const auto& d = ch["delta"];
      bool produced = false;
      for (const char* k : {"reasoning_content", "reasoning"})
        if (d.contains(k) && d[k].is_string() && !d[k].get<std::string>().empty()) {
          g.reasoning += d[k].get<std::string>();
          produced = true;
        }
      if (d.contains("content") && d["content"].is_string() &&
          !d["content"].get<std::string>().empty()) {
        g.text += d["content"].get<std::string>();
        produced = true;
      }
      if (d.contains("tool_calls") && d["tool_calls"].is_array()) {
        for (const auto& tc : d["tool_calls"]) {
          if (!tc.is_object()) continue;
          size_t i = tc.contains("index") && tc["index"].is_number_unsigned()
                         ? tc["index"].get<size_t>()
                     : g.tool_calls.size() ? g.tool_calls.size() - 1
                                           : 0;
          if (i > 64) continue;
          while (g.tool_calls.size() <= i)
            g.tool_calls.push_back({{"name", ""}, {"arguments", ""}});
          if (tc.contains("function") && tc["function"].is_object()) {
            const auto& f = tc["function"];
            if (f.contains("name") && f["name"].is_string())
              g.tool_calls[i]["name"] =
                  g.tool_calls[i]["name"].get<std::string>() + f["name"].get<std::string>();
            if (f.contains("arguments") && f["arguments"].is_string())
              g.tool_calls[i]["arguments"] = g.tool_calls[i]["arguments"].get<std::string>() +
                                             f["arguments"].get<std::string>();
          }
          produced = true;
        }
      }
      if (produced) {
        double t = since(t0);
        if (g.chunks == 0) g.ttft = t;
        g.last_token = t;
        ++g.chunks;
      }
    }
    return true;
  };
  auto r = http_stream(c, lim, on_event);
  g.total = since(t0);
  if (cancelled || (cancel && cancel->load() && !r.ok()))
    return make_error(Errc::resource, fmt::format("{}: cancelled (the memory guard)", what));
  if (bad) return *bad;
  if (!r) return make_error(r.error().code, fmt::format("{}: {}", what, r.error().message));
  if (r->status / 100 != 2)
    return make_error(r->status == 401 || r->status == 403 ? Errc::auth : Errc::remote,
                      fmt::format("{}: HTTP {}: {}", what, r->status, error_text(r->body)));
  if (r->headers["content-type"].find("text/event-stream") == std::string::npos)
    return make_error(Errc::remote,
                      fmt::format("{}: asked for a stream, got '{}' instead of text/event-stream",
                                  what, r->headers["content-type"]));
  if (!r->done)
    return make_error(
        Errc::network,
        fmt::format("{}: the stream ended after {} chunks without data: [DONE]", what, r->events));
  if (!g.usage_seen) g.tokens = g.chunks;
  if (g.finish_reason.empty())
    return make_error(Errc::remote,
                      fmt::format("{}: the stream ended without a finish_reason", what));
  return g;
}

}  // namespace spark::cli::bench
