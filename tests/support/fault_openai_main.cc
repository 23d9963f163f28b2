// fault_inject_openai: a TEST DOUBLE of an OpenAI-compatible server for sparkctl bench's
// fault tests. It streams chat completions (SSE) that echo the prompt's last user message
// (a "Count from 1 to N" prompt gets the count, a request with tools gets the tool the
// prompt names), and misbehaves as --mode says on every request whose max_tokens is at
// least --min-max-tokens (so that the bench's short set-up requests go through):
//   good          no fault
//   fffd          every non-ASCII character comes back as U+FFFD
//   bad-utf8      every non-ASCII character comes back as a lone 0xC3 byte (invalid UTF-8)
//   bad-tool-json tool-call arguments are cut short (not JSON)
//   varying       every reply ends with a number that counts the requests
//   stall         one chunk, then silence
//   error-mid     two chunks, then an error event and the end, without [DONE]
//   endless       chunks every 10 ms, never [DONE]
//   bad-json      a chunk that is not JSON
//   http-500      500 with an error body
//   no-ignore-eos 400 for any request with ignore_eos (and no other fault)
//   serial-prefill one prefill at a time (a short request waits behind a long one)
// --prefill-us-per-byte N: the "prefill" time per prompt byte (default 2).
// GET /v1/models names "fault-model"; GET /health has "version".
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "daemon/http_server.h"

using namespace spark;
using namespace spark::daemon;
using nlohmann::json;

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_requests{0};
int g_prefill_us = 2;
std::mutex g_prefill;
void on_term(int) {
  g_stop = true;
}

// Non-ASCII code points replaced by `with` (raw bytes).
std::string replace_non_ascii(const std::string& s, const std::string& with) {
  std::string o;
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      o += s[i++];
      continue;
    }
    size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    o += with;
    i += n;
  }
  return o;
}

// Pieces of a reply: one per word (with its leading space).
std::vector<std::string> pieces(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : text) {
    if (c == ' ' && !cur.empty()) {
      out.push_back(cur);
      cur.clear();
    }
    cur += c;
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::string sse(const json& j) {
  return "data: " + j.dump() + "\n\n";
}
// A chunk with raw bytes in its content (dump() would refuse invalid UTF-8).
std::string sse_raw_content(const std::string& raw) {
  return "data: {\"object\":\"chat.completion.chunk\",\"model\":\"fault-model\",\"choices\":[{"
         "\"index\":0,\"delta\":{\"content\":\"" +
         raw + "\"},\"finish_reason\":null}]}\n\n";
}
json chunk(const json& delta, const json& finish = nullptr, const json& logprobs = nullptr) {
  return {
      {"object", "chat.completion.chunk"},
      {"model", "fault-model"},
      {"choices",
       json::array(
           {{{"index", 0}, {"delta", delta}, {"finish_reason", finish}, {"logprobs", logprobs}}})}};
}

void serve(const std::string& mode, int min_max_tokens, json req, Responder r) {
  using std::chrono::milliseconds;
  const int max_tokens = req.value("max_tokens", 16);
  const bool faulty = max_tokens >= min_max_tokens;
  const int no = ++g_requests;
  if (mode == "no-ignore-eos" && req.contains("ignore_eos"))
    return r.send(
        Response::json(400, {{"error",
                              {{"message", "Unrecognized request argument supplied: ignore_eos"},
                               {"type", "invalid_request_error"}}}}));
  if (faulty && mode == "http-500")
    return r.send(Response::json(500, {{"error", {{"message", "injected internal error"}}}}));
  std::string prompt;
  size_t prompt_chars = 0;
  for (const auto& m : req.value("messages", json::array())) {
    if (m.contains("content") && m["content"].is_string()) {
      prompt_chars += m["content"].get<std::string>().size();
      if (m.value("role", "") == "user") prompt = m["content"].get<std::string>();
    }
  }
  std::string text = prompt;
  const std::string repeat = "Repeat exactly, and nothing else: ";
  if (text.rfind(repeat, 0) == 0) text = text.substr(repeat.size());
  if (prompt.rfind("Count from 1 to ", 0) == 0) {
    int n = std::atoi(prompt.c_str() + 16);
    text.clear();
    for (int i = 1; i <= n; ++i) text += (i > 1 ? " " : "") + std::to_string(i);
  }
  if (faulty && mode == "varying") text += " " + std::to_string(no);
  std::string tool;
  if (req.contains("tools")) {
    auto has = [&](const char* w) { return prompt.find(w) != std::string::npos; };
    tool = has("main.cc") || has("README") ? "read_file"
           : has("ls -la") || has("df -h") ? "run_shell"
           : has(".txt")                   ? "write_file"
                                           : "search_web";
  }
  const bool ignore_eos = req.value("ignore_eos", false);
  const bool want_lp = req.value("logprobs", false);
  r.begin_stream(200, "text/event-stream");
  {
    std::unique_lock lk(g_prefill, std::defer_lock);
    if (mode == "serial-prefill") lk.lock();
    std::this_thread::sleep_for(std::chrono::microseconds(g_prefill_us * prompt_chars));
  }
  r.write(sse(chunk({{"role", "assistant"}, {"content", ""}})));
  int sent = 0;
  std::string finish = "stop";
  if (faulty && mode == "endless") {
    while (!r.closed() && !g_stop) {
      r.write(sse(chunk({{"content", " more"}})));
      std::this_thread::sleep_for(milliseconds(10));
    }
    return;
  }
  if (!tool.empty()) {
    json args = tool == "read_file"    ? json{{"path", "src/main.cc"}}
                : tool == "run_shell"  ? json{{"command", "ls -la"}}
                : tool == "write_file" ? json{{"path", "notes.txt"}, {"content", "buy milk"}}
                                       : json{{"query", "ethanol boiling point"}};
    std::string a = args.dump();
    if (faulty && mode == "bad-tool-json") a = a.substr(0, a.size() / 2);
    r.write(sse(chunk(
        {{"tool_calls", json::array({{{"index", 0},
                                      {"id", "call_1"},
                                      {"type", "function"},
                                      {"function", {{"name", tool}, {"arguments", ""}}}}})}})));
    r.write(sse(
        chunk({{"tool_calls", json::array({{{"index", 0}, {"function", {{"arguments", a}}}}})}})));
    sent = 2;
    finish = "tool_calls";
  } else {
    auto ps = pieces(text.empty() ? "ok" : text);
    for (size_t i = 0; sent < max_tokens && (i < ps.size() || ignore_eos); ++i) {
      std::string p = i < ps.size() ? ps[i] : " x";
      if (faulty && mode == "stall" && sent == 1) {
        // Silence: hold the stream open until the client gives up.
        while (!r.closed() && !g_stop) std::this_thread::sleep_for(milliseconds(20));
        return;
      }
      if (faulty && mode == "error-mid" && sent == 2) {
        r.write(
            sse({{"error", {{"message", "injected fault: the engine failed"}, {"code", 500}}}}));
        r.end_stream();
        return;
      }
      if (faulty && mode == "bad-json" && sent == 1) {
        r.write("data: {\"choices\": [{\"delta\": {\"content\": \"tru\n\n");
        r.end_stream();
        return;
      }
      if (faulty && mode == "fffd") p = replace_non_ascii(p, "\xEF\xBF\xBD");
      if (faulty && mode == "bad-utf8" && p != replace_non_ascii(p, "")) {
        r.write(sse_raw_content(replace_non_ascii(p, "\xC3")));
      } else {
        json lp = want_lp ? json{{"content", json::array({{{"token", p},
                                                           {"logprob", -0.5 - 0.01 * sent},
                                                           {"top_logprobs", json::array()}}})}}
                          : json(nullptr);
        r.write(sse(chunk({{"content", p}}, nullptr, lp)));
      }
      ++sent;
      std::this_thread::sleep_for(milliseconds(1));
    }
    if (sent >= max_tokens) finish = "length";
  }
  r.write(sse(chunk(json::object(), finish)));
  int ptoks = static_cast<int>(prompt_chars / 4 + 8);
  r.write(sse({{"object", "chat.completion.chunk"},
               {"model", "fault-model"},
               {"choices", json::array()},
               {"usage",
                {{"prompt_tokens", ptoks},
                 {"completion_tokens", sent},
                 {"total_tokens", ptoks + sent},
                 {"prompt_tokens_details", {{"cached_tokens", 0}}}}}}));
  r.write("data: [DONE]\n\n");
  r.end_stream();
}
}  // namespace

int main(int argc, char** argv) {
  int port = 0;
  std::string mode = "good";
  int min_max_tokens = 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "fault_inject_openai: %s needs a value\n", a.c_str());
      return 2;
    }
    std::string v = argv[++i];
    if (a == "--port")
      port = std::atoi(v.c_str());
    else if (a == "--mode")
      mode = v;
    else if (a == "--min-max-tokens")
      min_max_tokens = std::atoi(v.c_str());
    else if (a == "--prefill-us-per-byte")
      g_prefill_us = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "fault_inject_openai: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  static const char* modes[] = {"good",     "fffd",     "bad-utf8",      "bad-tool-json",
                                "varying",  "stall",    "error-mid",     "endless",
                                "bad-json", "http-500", "no-ignore-eos", "serial-prefill"};
  if (std::find(std::begin(modes), std::end(modes), mode) == std::end(modes)) {
    std::fprintf(stderr, "fault_inject_openai: unknown mode %s\n", mode.c_str());
    return 2;
  }
  ::signal(SIGTERM, on_term);
  ::signal(SIGINT, on_term);
  ::signal(SIGPIPE, SIG_IGN);
  ServerOptions o;
  o.port = static_cast<uint16_t>(port);
  o.server_name = "fault_inject_openai";
  HttpServer s(o);
  s.route("GET", "/v1/models", [](const Request&) {
    return Response::json(200, {{"object", "list"},
                                {"data", json::array({{{"id", "fault-model"},
                                                       {"object", "model"},
                                                       {"owned_by", "fault"},
                                                       {"max_model_len", 200000}}})}});
  });
  s.route("GET", "/health", [&](const Request&) {
    return Response::json(200, {{"ok", true}, {"version", "fault-1"}, {"mode", mode}});
  });
  s.route_async("POST", "/v1/chat/completions", [&](const Request& req, Responder r) {
    json j = json::parse(req.body, nullptr, false);
    if (!j.is_object()) return r.send(Response::json(400, {{"error", {{"message", "not JSON"}}}}));
    std::thread([mode, min_max_tokens, j, r] { serve(mode, min_max_tokens, j, r); }).detach();
  });
  Status st = s.start();
  if (!st.ok()) {
    std::fprintf(stderr, "fault_inject_openai: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("fault_inject_openai: mode %s on port %d\n", mode.c_str(), s.port());
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::_Exit(0);
}
