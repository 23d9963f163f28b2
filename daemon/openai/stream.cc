#include "daemon/openai/stream.h"

#include <algorithm>

namespace spark::openai {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
  for (const auto& s : stops_) max_len_ = std::max(max_len_, s.size());
}

StopMatcher::Out StopMatcher::push(std::string_view delta) {
  Out out;
  if (stopped_) return out;
  held_ += delta;
  if (stops_.empty()) {
    out.text = std::move(held_);
    held_.clear();
    return out;
  }
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    out.text = held_.substr(0, first);
    out.stopped = stopped_ = true;
    held_.clear();
    return out;
  }
  // Hold the longest tail that is a prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_)
    for (size_t n = std::min(held_.size(), s.size() - 1); n > hold; --n)
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
  out.text = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::finish() {
  std::string out = stopped_ ? std::string() : std::move(held_);
  held_.clear();
  return out;
}

ChoiceStream::ChoiceStream(const tok::Tokenizer& tok, ChoiceStreamOptions opt)
    : dec_(tok, opt.skip_special_tokens && opt.family != tok::ChatFamily::harmony &&
                    !(opt.parse_tool_calls && (opt.family == tok::ChatFamily::mistral ||
                                               opt.family == tok::ChatFamily::deepseek))),
      stop_(std::move(opt.stop)) {
  // "other" families have no tool-call syntax we know: their output stays content.
  if (opt.family == tok::ChatFamily::harmony)
    harmony_ = std::make_unique<tok::HarmonyParser>();
  else if (opt.parse_tool_calls && opt.family != tok::ChatFamily::other)
    parser_ = std::make_unique<tok::ToolCallParser>(opt.family);
}

ChoiceStream::Step ChoiceStream::through_parser(std::string text, bool final) {
  Step s;
  if (!parser_ && !harmony_) {
    s.content = std::move(text);
    return s;
  }
  tok::ToolParseDelta d = parser_ ? parser_->push(text) : harmony_->push(text);
  if (final) {
    tok::ToolParseDelta f = parser_ ? parser_->finish() : harmony_->finish();
    d.content += f.content;
    d.reasoning += f.reasoning;
    for (auto& c : f.calls) d.calls.push_back(std::move(c));
  }
  s.content = std::move(d.content);
  s.reasoning = std::move(d.reasoning);
  s.calls = std::move(d.calls);
  return s;
}

ChoiceStream::Step ChoiceStream::push(int32_t token) {
  if (done_) return {};
  StopMatcher::Out o = stop_.push(dec_.push(token));
  if (o.stopped) {
    done_ = true;
    Step s = through_parser(std::move(o.text), true);
    s.stopped = true;
    return s;
  }
  return through_parser(std::move(o.text), false);
}

ChoiceStream::Step ChoiceStream::finish() {
  if (done_) return {};
  done_ = true;
  StopMatcher::Out o = stop_.push(dec_.finish());
  std::string text = std::move(o.text);
  if (!o.stopped) text += stop_.finish();
  Step s = through_parser(std::move(text), true);
  s.stopped = o.stopped;
  return s;
}

std::string ChoiceStream::finish_reason(const std::string& reason) const {
  if (tool_calls() > 0 && reason == "stop") return "tool_calls";
  return reason;
}

}  // namespace spark::openai
