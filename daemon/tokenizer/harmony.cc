#include "daemon/tokenizer/harmony.h"

#include <algorithm>
#include <array>
#include <random>

namespace spark::tok {

namespace {
constexpr std::string_view kStart = "<|start|>", kChannel = "<|channel|>", kMessage = "<|message|>",
                           kEnd = "<|end|>", kReturn = "<|return|>", kCall = "<|call|>",
                           kConstrain = "<|constrain|>";
constexpr size_t kMaxHeader = 1024;

std::string random_call_id() {
  static const char* alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += alnum[rng() % 62];
  return id;
}

bool all_space(std::string_view s) {
  return s.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// The first of `markers` in s: its position and which one (npos when none).
std::pair<size_t, std::string_view> first_of(std::string_view s,
                                             std::initializer_list<std::string_view> markers) {
  size_t best = std::string_view::npos;
  std::string_view which;
  for (auto m : markers) {
    size_t p = s.find(m);
    if (p < best) best = p, which = m;
  }
  return {best, which};
}

// Length of the longest suffix of s that is a proper prefix of one of `markers`.
size_t partial_suffix(std::string_view s, std::initializer_list<std::string_view> markers) {
  size_t hold = 0;
  for (auto m : markers)
    for (size_t n = std::min(s.size(), m.size() - 1); n > hold; --n)
      if (s.substr(s.size() - n) == m.substr(0, n)) {
        hold = n;
        break;
      }
  return hold;
}

// A word of the header: from `pos` to the next space or special token.
std::string_view word_at(std::string_view h, size_t pos) {
  size_t e = h.find_first_of(" \t\r\n<", pos);
  return h.substr(pos, (e == std::string_view::npos ? h.size() : e) - pos);
}

struct Header {
  std::string role;  // empty: the prompt's (assistant)
  std::string channel;
  std::string recipient;
};

// Reads "[<|start|>ROLE][ to=RECIPIENT][<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>T| T]]".
Header parse_header(std::string_view h) {
  Header out;
  if (h.starts_with(kStart)) {
    h.remove_prefix(kStart.size());
    out.role = std::string(word_at(h, 0));
  }
  for (size_t p = h.find("to="); p != std::string_view::npos; p = h.find("to=", p + 1)) {
    if (p > 0 && h[p - 1] != ' ' && h[p - 1] != '>' && h[p - 1] != '\t' && h[p - 1] != '\n')
      continue;
    out.recipient = std::string(word_at(h, p + 3));
    break;
  }
  if (size_t c = h.find(kChannel); c != std::string_view::npos) {
    size_t b = h.find_first_not_of(" \t", c + kChannel.size());
    if (b != std::string_view::npos) out.channel = std::string(word_at(h, b));
  }
  return out;
}
}  // namespace

HarmonyParser::HarmonyParser(std::function<std::string()> make_id) : make_id_(std::move(make_id)) {
  if (!make_id_) make_id_ = random_call_id;
}

void HarmonyParser::emit_text(ToolParseDelta& out, std::string_view t, bool final) {
  // Text outside messages: a stretch of whitespace alone (between messages) is dropped.
  if (stray_text_) {
    out.content += t;
    return;
  }
  pending_ws_ += t;
  if (!all_space(pending_ws_)) {
    out.content += pending_ws_;
    pending_ws_.clear();
    stray_text_ = true;
  } else if (final) {
    pending_ws_.clear();
  }
}

void HarmonyParser::append_arguments(ToolParseDelta& out, std::string piece) {
  const size_t index = calls_ - 1;
  if (!out.calls.empty() && out.calls.back().index == index) {
    out.calls.back().arguments += piece;  // the call (or fragment) this delta already holds
    return;
  }
  ParsedToolCall f;
  f.index = index;
  f.fragment = true;
  f.arguments = std::move(piece);
  out.calls.push_back(std::move(f));
}

void HarmonyParser::add_arguments(ToolParseDelta& out, std::string_view t) {
  // Trimmed: leading whitespace skipped, trailing whitespace held until text follows it.
  if (!args_started_) {
    size_t b = t.find_first_not_of(" \t\r\n");
    if (b == std::string_view::npos) return;
    t.remove_prefix(b);
    args_started_ = true;
  }
  size_t e = t.find_last_not_of(" \t\r\n");
  if (e == std::string_view::npos) {
    args_ws_ += t;
    return;
  }
  std::string piece = std::move(args_ws_) + std::string(t.substr(0, e + 1));
  args_ws_ = std::string(t.substr(e + 1));
  append_arguments(out, std::move(piece));
}

void HarmonyParser::open_message(ToolParseDelta& out) {
  Header h = parse_header(header_);
  body_.clear();
  name_.clear();
  pending_ws_.clear();
  if (!h.role.empty() && h.role != "assistant") {
    route_ = Route::raw;
  } else if (!h.recipient.empty()) {
    constexpr std::string_view fn = "functions.";
    if (h.recipient.starts_with(fn) && h.recipient.size() > fn.size()) {
      route_ = Route::call;
      name_ = h.recipient.substr(fn.size());
      ParsedToolCall c;
      c.index = calls_++;
      c.id = make_id_();
      c.name = name_;
      out.calls.push_back(std::move(c));
      args_started_ = false;
      args_ws_.clear();
    } else {
      route_ = Route::raw;
    }
  } else {
    route_ = h.channel == "analysis" ? Route::reasoning : Route::content;
  }
}

void HarmonyParser::close_message(ToolParseDelta& out, std::string_view end_marker) {
  if (route_ == Route::call) {
    if (!args_started_) append_arguments(out, "{}");
    args_started_ = false;
    args_ws_.clear();
  } else if (route_ == Route::raw) {
    out.content += header_ + std::string(kMessage) + body_ + std::string(end_marker);
  }
  header_.clear();
  body_.clear();
  name_.clear();
  mode_ = Mode::text;
}

void HarmonyParser::step(ToolParseDelta& out, bool final) {
  for (;;) {
    switch (mode_) {
      case Mode::start: {  // right after the prompt's "<|start|>assistant"
        static constexpr std::array<std::string_view, 5> openers = {kChannel, kMessage, kConstrain,
                                                                    " to=", "to="};
        if (buf_.empty()) {
          if (final) mode_ = Mode::text;
          if (final) continue;
          return;
        }
        bool maybe = false;
        for (auto o : openers) {
          if (std::string_view(buf_).starts_with(o)) {
            mode_ = Mode::header;
            break;
          }
          if (o.starts_with(buf_)) maybe = true;
        }
        if (mode_ == Mode::header) continue;
        if (maybe && !final) return;
        mode_ = Mode::text;
        continue;
      }
      case Mode::text: {
        auto [p, which] = first_of(buf_, {kStart, kChannel});
        if (p == std::string::npos) {
          size_t hold = final ? 0 : partial_suffix(buf_, {kStart, kChannel});
          emit_text(out, std::string_view(buf_).substr(0, buf_.size() - hold), final);
          buf_.erase(0, buf_.size() - hold);
          return;
        }
        emit_text(out, std::string_view(buf_).substr(0, p), false);
        pending_ws_.clear();
        stray_text_ = false;
        buf_.erase(0, p);
        mode_ = Mode::header;
        continue;
      }
      case Mode::header: {
        auto [p, which] = first_of(buf_, {kMessage, kStart, kEnd, kReturn, kCall});
        // A <|start|> at the very beginning opens this header; look past it.
        if (which == kStart && p == 0 && header_.empty()) {
          header_ = std::string(kStart);
          buf_.erase(0, kStart.size());
          continue;
        }
        // Where the header ends at the earliest: a header longer than kMaxHeader is text, cut
        // at kMaxHeader (the same place however the output is split).
        size_t room = kMaxHeader - std::min(kMaxHeader, header_.size());
        size_t seen =
            p != std::string::npos ? p
            : final                ? buf_.size()
                    : buf_.size() - partial_suffix(buf_, {kMessage, kStart, kEnd, kReturn, kCall});
        if (seen > room) {
          out.content += header_ + buf_.substr(0, room);
          header_.clear();
          buf_.erase(0, room);
          mode_ = Mode::text;
          continue;
        }
        if (p == std::string::npos) {
          if (final) {  // no <|message|> will come: the header is text
            out.content += header_ + buf_;
            header_.clear();
            buf_.clear();
            mode_ = Mode::text;
            return;
          }
          return;
        }
        if (which != kMessage) {  // a header that ends without a message: text
          size_t keep = which == kStart ? p : p + which.size();
          out.content += header_ + buf_.substr(0, keep);
          header_.clear();
          buf_.erase(0, keep);
          mode_ = Mode::text;
          continue;
        }
        header_ += buf_.substr(0, p);
        buf_.erase(0, p + kMessage.size());
        open_message(out);
        mode_ = Mode::body;
        continue;
      }
      case Mode::body: {
        auto [p, which] = first_of(buf_, {kEnd, kReturn, kCall, kStart, kChannel});
        size_t take = p;
        if (p == std::string::npos)
          take = buf_.size() -
                 (final ? 0 : partial_suffix(buf_, {kEnd, kReturn, kCall, kStart, kChannel}));
        std::string_view t = std::string_view(buf_).substr(0, take);
        if (route_ == Route::reasoning)
          out.reasoning += t;
        else if (route_ == Route::content)
          out.content += t;
        else if (route_ == Route::call)
          add_arguments(out, t);
        else
          body_ += t;
        if (p == std::string::npos) {
          buf_.erase(0, take);
          if (final) close_message(out, "");
          return;
        }
        // <|start|> and <|channel|> also open the next header: leave them for text mode.
        bool opens = which == kStart || which == kChannel;
        buf_.erase(0, opens ? p : p + which.size());
        close_message(out, opens ? std::string_view() : which);
        continue;
      }
    }
  }
}

ToolParseDelta HarmonyParser::push(std::string_view delta) {
  ToolParseDelta out;
  buf_ += delta;
  step(out, false);
  return out;
}

ToolParseDelta HarmonyParser::finish() {
  ToolParseDelta out;
  step(out, true);
  pending_ws_.clear();
  return out;
}

ToolParseDelta HarmonyParser::parse(std::string_view text, std::function<std::string()> make_id) {
  HarmonyParser p(std::move(make_id));
  ToolParseDelta a = p.push(text);
  ToolParseDelta b = p.finish();
  a.content += b.content;
  a.reasoning += b.reasoning;
  for (auto& c : b.calls) {
    if (c.fragment && !a.calls.empty() && a.calls.back().index == c.index)
      a.calls.back().arguments += c.arguments;  // the end of a call push() began
    else
      a.calls.push_back(std::move(c));
  }
  return a;
}

}  // namespace spark::tok
