#include "daemon/tokenizer/tool_calls.h"

#include <random>

#include "daemon/tokenizer/py_json.h"

namespace spark::tok {

namespace {
constexpr std::string_view kQwenOpen = "<tool_call>", kQwenClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>", kMistralCalls = "[TOOL_CALLS]";
// DeepSeek-V3:
// <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS
// \n```<｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>; V3.1 drops the type and the fence
// (<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>).
constexpr std::string_view kDsOpen = "<｜tool▁calls▁begin｜>", kDsClose = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCall = "<｜tool▁call▁begin｜>", kDsSep = "<｜tool▁sep｜>",
                           kDsCallEnd = "<｜tool▁call▁end｜>";

std::string random_id(size_t n, std::string_view prefix) {
  static const char* alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id(prefix);
  for (size_t i = 0; i < n; ++i) id += alnum[rng() % 62];
  return id;
}

bool all_space(std::string_view s) {
  return s.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// Length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t partial_suffix(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(s.size(), marker.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  return 0;
}
}  // namespace

size_t json_value_end(std::string_view s, size_t pos) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (size_t i = pos; i < s.size(); ++i) {
    char c = s[i];
    if (in_str) {
      if (esc)
        esc = false;
      else if (c == '\\')
        esc = true;
      else if (c == '"')
        in_str = false;
      continue;
    }
    if (c == '"') {
      in_str = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

ToolCallParser::ToolCallParser(ChatFamily family, std::function<std::string()> make_id)
    : family_(family), make_id_(std::move(make_id)) {
  if (!make_id_) {
    if (family_ == ChatFamily::mistral)
      make_id_ = [] { return random_id(9, ""); };
    else
      make_id_ = [] { return random_id(24, "call_"); };
  }
  if (family_ != ChatFamily::llama3) mode_ = Mode::text;
}

void ToolCallParser::emit_text(ToolParseDelta& out, std::string_view t) {
  if (t.empty()) return;
  if (!after_call_) {
    out.content += t;
    return;
  }
  // Whitespace right after a call is held: dropped if only whitespace or another call
  // follows, sent with the text if text follows.
  pending_ws_ += t;
  if (!all_space(pending_ws_)) {
    out.content += pending_ws_;
    pending_ws_.clear();
    after_call_ = false;
  }
}

bool ToolCallParser::add_call(ToolParseDelta& out, const std::string& text, bool array) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception&) {
    return false;
  }
  Json items = array ? j : Json::array({j});
  if (!items.is_array() || items.empty()) return false;
  std::vector<ParsedToolCall> calls;
  for (const auto& o : items) {
    if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) return false;
    const char* key = o.contains("arguments") ? "arguments" : "parameters";
    // Llama 3's bare JSON must look like a call, not like an answer that is JSON.
    if (family_ == ChatFamily::llama3 && !o.contains(key)) return false;
    ParsedToolCall c;
    c.name = o["name"].get<std::string>();
    if (!o.contains(key) || o[key].is_null()) {
      c.arguments = "{}";
    } else if (o[key].is_string()) {
      c.arguments = o[key].get<std::string>();
    } else if (o[key].is_object()) {
      c.arguments = py_dumps(o[key]);
    } else {
      return false;
    }
    c.id = o.contains("id") && o["id"].is_string() ? o["id"].get<std::string>() : make_id_();
    calls.push_back(std::move(c));
  }
  pending_ws_.clear();
  after_call_ = true;
  for (auto& c : calls) {
    c.index = calls_++;
    out.calls.push_back(std::move(c));
  }
  return true;
}

bool ToolCallParser::add_deepseek_calls(ToolParseDelta& out, std::string_view body) {
  Json calls = Json::array();
  size_t i = 0;
  for (;;) {
    size_t b = body.find(kDsCall, i);
    if (b == std::string_view::npos) break;
    if (!all_space(body.substr(i, b - i))) return false;
    size_t sep = body.find(kDsSep, b);
    size_t end = body.find(kDsCallEnd, b);
    if (sep == std::string_view::npos || end == std::string_view::npos || sep > end) return false;
    std::string_view head = body.substr(b + kDsCall.size(), sep - b - kDsCall.size());
    std::string_view rest = body.substr(sep + kDsSep.size(), end - sep - kDsSep.size());
    std::string name, args;
    size_t nl = rest.find('\n');
    if (nl != std::string_view::npos && rest.substr(nl + 1).starts_with("```json\n")) {
      name = std::string(rest.substr(0, nl));
      std::string_view a = rest.substr(nl + 1 + 8);
      size_t fence = a.rfind("```");
      if (fence == std::string_view::npos) return false;
      a = a.substr(0, fence);
      while (!a.empty() && a.back() == '\n') a.remove_suffix(1);
      args = std::string(a);
    } else {
      name = std::string(head);
      args = std::string(rest);
    }
    Json o = Json::object();
    o["name"] = name;
    Json parsed = Json::parse(args, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) return false;
    o["arguments"] = parsed;
    calls.push_back(o);
    i = end + kDsCallEnd.size();
  }
  if (calls.empty() || !all_space(body.substr(i))) return false;
  return add_call(out, calls.dump(), true);
}

void ToolCallParser::step(ToolParseDelta& out, bool final) {
  for (;;) {
    switch (mode_) {
      case Mode::done_text:
        emit_text(out, buf_);
        buf_.clear();
        return;
      case Mode::start: {  // Llama 3: decide from the first non-space characters
        size_t p = buf_.find_first_not_of(" \t\r\n");
        if (p == std::string::npos) {
          if (final) mode_ = Mode::done_text;
          if (final) continue;
          return;
        }
        std::string_view rest = std::string_view(buf_).substr(p);
        if (rest.starts_with(kPythonTag)) {
          json_raw_ = buf_.substr(0, p + kPythonTag.size());
          buf_.erase(0, p + kPythonTag.size());
          mode_ = Mode::json;
        } else if (rest[0] == '{') {
          json_raw_ = buf_.substr(0, p);
          buf_.erase(0, p);
          mode_ = Mode::json;
        } else if (!final && kPythonTag.starts_with(rest)) {
          return;  // maybe the tag, wait
        } else {
          mode_ = Mode::done_text;
        }
        continue;
      }
      case Mode::text: {
        std::string_view marker = family_ == ChatFamily::mistral    ? kMistralCalls
                                  : family_ == ChatFamily::deepseek ? kDsOpen
                                                                    : kQwenOpen;
        size_t p = buf_.find(marker);
        if (p == std::string::npos) {
          size_t hold = final ? 0 : partial_suffix(buf_, marker);
          emit_text(out, std::string_view(buf_).substr(0, buf_.size() - hold));
          buf_.erase(0, buf_.size() - hold);
          if (final) pending_ws_.clear();  // whitespace after the last call is dropped
          return;
        }
        emit_text(out, std::string_view(buf_).substr(0, p));
        buf_.erase(0, p + marker.size());
        json_raw_ = std::string(marker);
        mode_ = family_ == ChatFamily::mistral ? Mode::json : Mode::block;
        continue;
      }
      case Mode::block: {  // Qwen: inside <tool_call> ... </tool_call>
        if (family_ == ChatFamily::deepseek) {
          size_t p = buf_.find(kDsClose);
          if (p == std::string::npos && !final) return;
          std::string body = buf_.substr(0, p);
          if (!add_deepseek_calls(out, body))
            emit_text(out,
                      json_raw_ + body + (p == std::string::npos ? "" : std::string(kDsClose)));
          buf_.erase(0, p == std::string::npos ? buf_.size() : p + kDsClose.size());
          mode_ = Mode::text;
          continue;
        }
        size_t p = buf_.find(kQwenClose);
        if (p == std::string::npos) {
          if (!final) return;
          // Unterminated at the end: accept a complete JSON body, else return it as text.
          if (!add_call(out, buf_, false)) emit_text(out, json_raw_ + buf_);
          buf_.clear();
          mode_ = Mode::text;
          continue;
        }
        std::string body = buf_.substr(0, p);
        if (!add_call(out, body, false)) emit_text(out, json_raw_ + body + std::string(kQwenClose));
        buf_.erase(0, p + kQwenClose.size());
        mode_ = Mode::text;
        continue;
      }
      case Mode::json: {  // Llama 3 objects (';'-separated) or Mistral's array
        size_t p = buf_.find_first_not_of(family_ == ChatFamily::llama3 ? " \t\r\n;" : " \t\r\n");
        if (p == std::string::npos) {
          if (final) {
            if (calls_ == 0) emit_text(out, json_raw_ + buf_);
            buf_.clear();
            return;
          }
          return;
        }
        char open = buf_[p];
        bool want_array = family_ == ChatFamily::mistral;
        if ((want_array && open != '[') || (!want_array && open != '{')) {
          // Not (or no longer) a call.
          if (family_ == ChatFamily::mistral) {
            // "[TOOL_CALLS]" followed by junk: the marker is text; keep scanning the rest.
            emit_text(out, json_raw_);
            json_raw_.clear();
            mode_ = Mode::text;
            continue;
          }
          if (calls_ == 0) buf_.insert(0, json_raw_);  // Llama 3: the rest is text
          json_raw_.clear();
          mode_ = Mode::done_text;
          continue;
        }
        size_t end = json_value_end(buf_, p);
        if (end == std::string::npos) {
          if (!final) return;
          emit_text(out, json_raw_ + buf_);
          buf_.clear();
          json_raw_.clear();
          mode_ = Mode::done_text;
          continue;
        }
        std::string value = buf_.substr(p, end - p);
        if (add_call(out, value, want_array)) {
          json_raw_.clear();
          buf_.erase(0, end);
          if (family_ == ChatFamily::mistral) mode_ = Mode::text;
        } else {
          emit_text(out, json_raw_ + buf_.substr(0, end));
          json_raw_.clear();
          buf_.erase(0, end);
          mode_ = family_ == ChatFamily::mistral ? Mode::text : Mode::done_text;
        }
        continue;
      }
    }
  }
}

ToolParseDelta ToolCallParser::push(std::string_view delta) {
  ToolParseDelta out;
  buf_ += delta;
  step(out, false);
  return out;
}

ToolParseDelta ToolCallParser::finish() {
  ToolParseDelta out;
  step(out, true);
  pending_ws_.clear();
  return out;
}

ToolParseDelta ToolCallParser::parse(ChatFamily family, std::string_view text,
                                     std::function<std::string()> make_id) {
  ToolCallParser p(family, std::move(make_id));
  ToolParseDelta a = p.push(text);
  ToolParseDelta b = p.finish();
  a.content += b.content;
  for (auto& c : b.calls) a.calls.push_back(std::move(c));
  return a;
}

}  // namespace spark::tok
