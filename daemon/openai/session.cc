#include "daemon/openai/session.h"

#include <algorithm>
#include <ctime>

namespace spark::openai {

bool exceeds_context(const tok::Tokenizer& tok, const std::vector<std::string_view>& texts,
                     int max_context, int64_t* counted) {
  constexpr size_t kPiece = 4096;
  constexpr int64_t kSlackPerCut = 4;
  size_t bytes = 0;
  for (auto t : texts) bytes += t.size();
  *counted = 0;
  // A token covers at least one byte of text: shorter text always fits.
  if (bytes <= static_cast<size_t>(std::max(max_context, 0))) return false;
  int64_t tokens = 0, cuts = 0;
  for (auto t : texts) {
    ++cuts;  // the template puts something between two texts; count it as a cut too
    while (!t.empty()) {
      size_t n = std::min(kPiece, t.size());
      while (n < t.size() && n > 0 && (static_cast<unsigned char>(t[n]) & 0xC0) == 0x80) --n;
      if (n == 0) n = std::min(kPiece, t.size());
      tokens += static_cast<int64_t>(tok.encode(t.substr(0, n), false).size());
      t.remove_prefix(n);
      if (!t.empty()) ++cuts;
      *counted = std::max<int64_t>(0, tokens - kSlackPerCut * cuts);
      if (*counted > max_context) return true;
    }
  }
  return false;
}

ApiError context_exceeded(int max_context, int64_t counted, size_t bytes, const char* param,
                          const char* what) {
  return invalid_request("This model's maximum context length is " + std::to_string(max_context) +
                             " tokens. However, the " + what + " alone hold more than " +
                             std::to_string(counted) + " tokens (" + std::to_string(bytes) +
                             " bytes; counting stopped at the limit). " +
                             "Please reduce the length of the " + param + ".",
                         param, "context_length_exceeded");
}

ApiResult<PreparedPrompt> prepare_chat(const ChatRequest& req, const tok::Tokenizer& tok,
                                       const tok::ChatFormat& fmt, int max_context,
                                       const std::function<bool()>& stop) {
  ApiResult<PreparedPrompt> r;
  Json tools = req.tool_choice.kind == ToolChoice::Kind::none ? Json::array() : req.tools;
  auto text = tok::render_chat(fmt, req.messages, tools, req.add_generation_prompt,
                               req.chat_template_kwargs, stop);
  if (!text) {
    r.error = from_error(text.error(), "messages");
    return r;
  }
  PreparedPrompt p;
  p.text = std::move(*text);
  // What the template made of the messages can be far longer than they are: count it against
  // the context before tokenizing all of it.
  int64_t counted = 0;
  if (exceeds_context(tok, {p.text}, max_context, &counted)) {
    r.error =
        context_exceeded(max_context, counted, p.text.size(), "messages", "rendered chat template");
    return r;
  }
  p.ids = tok.encode(p.text, false);  // the format already holds BOS
  auto budget =
      resolve_max_tokens(req.sampling, static_cast<int>(p.ids.size()), max_context, "messages");
  if (!budget.ok()) {
    r.error = budget.error;
    return r;
  }
  p.max_tokens = *budget.value;
  r.value = std::move(p);
  return r;
}

ApiResult<PreparedPrompt> prepare_completion(const CompletionRequest& req,
                                             const tok::Tokenizer& tok, int max_context) {
  ApiResult<PreparedPrompt> r;
  PreparedPrompt p;
  if (const auto* s = std::get_if<std::string>(&req.prompt)) {
    p.text = *s;
    p.ids = tok.encode(*s, true);
  } else {
    p.ids = std::get<std::vector<int32_t>>(req.prompt);
    for (auto id : p.ids)
      if (static_cast<size_t>(id) >= tok.vocab_size()) {
        r.error = invalid_request("'prompt' holds token id " + std::to_string(id) +
                                      ", outside the vocabulary of " +
                                      std::to_string(tok.vocab_size()) + " tokens.",
                                  "prompt");
        return r;
      }
    p.text = tok.decode(p.ids, false);
  }
  auto budget =
      resolve_max_tokens(req.sampling, static_cast<int>(p.ids.size()), max_context, "prompt");
  if (!budget.ok()) {
    r.error = budget.error;
    return r;
  }
  p.max_tokens = *budget.value;
  r.value = std::move(p);
  return r;
}

CompletionWriter::CompletionWriter(const ChatRequest& req, const tok::Tokenizer& tok,
                                   const tok::ChatFormat& fmt, std::string model, int prompt_tokens,
                                   std::set<int32_t> stop_token_ids)
    : tok_(&tok),
      chat_(true),
      stream_(req.stream),
      include_usage_(req.include_usage),
      want_logprobs_(req.sampling.logprobs),
      stop_ids_(std::move(stop_token_ids)) {
  meta_ = {make_response_id("chatcmpl-"), static_cast<int64_t>(std::time(nullptr)),
           std::move(model)};
  usage_.prompt_tokens = prompt_tokens;
  bool tools = req.tool_choice.kind != ToolChoice::Kind::none && !req.tools.empty();
  for (int i = 0; i < req.sampling.n; ++i) {
    ChoiceStreamOptions o;
    o.stop = req.sampling.stop;
    o.skip_special_tokens = req.sampling.skip_special_tokens;
    o.parse_tool_calls = tools;
    o.family = fmt.family;
    ChoiceState c;
    c.stream = std::make_unique<ChoiceStream>(tok, o);
    c.result.index = i;
    choices_.push_back(std::move(c));
  }
}

CompletionWriter::CompletionWriter(const CompletionRequest& req, const tok::Tokenizer& tok,
                                   std::string model, int prompt_tokens,
                                   std::set<int32_t> stop_token_ids, std::string prompt_text)
    : tok_(&tok),
      chat_(false),
      stream_(req.stream),
      include_usage_(req.include_usage),
      want_logprobs_(req.sampling.logprobs),
      stop_ids_(std::move(stop_token_ids)) {
  meta_ = {make_response_id("cmpl-"), static_cast<int64_t>(std::time(nullptr)), std::move(model)};
  usage_.prompt_tokens = prompt_tokens;
  if (req.echo) echo_ = std::move(prompt_text);
  prompt_logprobs_ = req.echo && req.sampling.prompt_logprobs >= 0;
  for (int i = 0; i < req.sampling.n; ++i) {
    ChoiceStreamOptions o;
    o.stop = req.sampling.stop;
    o.skip_special_tokens = req.sampling.skip_special_tokens;
    ChoiceState c;
    c.stream = std::make_unique<ChoiceStream>(tok, o);
    c.result.index = i;
    c.result.text = echo_;
    c.text_offset = utf8_chars(echo_);
    choices_.push_back(std::move(c));
  }
}

const char* CompletionWriter::content_type() const {
  return stream_ ? "text/event-stream" : "application/json";
}

std::string CompletionWriter::start() {
  if (!stream_) return {};
  std::string out;
  for (auto& c : choices_) {
    if (chat_) {
      ChatDelta d;
      d.index = c.result.index;
      d.role = true;
      d.content = "";
      out += sse_event(chat_chunk(meta_, d, include_usage_, *tok_));
      c.role_sent = true;
    } else if (!echo_.empty() && !prompt_logprobs_) {  // else with its logprobs
      out += sse_event(completion_chunk(meta_, c.result.index, echo_, std::nullopt, include_usage_,
                                        std::nullopt, 0, *tok_));
    }
  }
  return out;
}

std::string CompletionWriter::emit(int choice, const ChoiceStream::Step& s,
                                   std::optional<std::vector<TokenLogprobs>> lp) {
  ChoiceState& c = choices_[static_cast<size_t>(choice)];
  c.result.text += s.content;
  c.result.reasoning += s.reasoning;
  for (const auto& call : s.calls) {
    auto it = std::find_if(c.result.tool_calls.rbegin(), c.result.tool_calls.rend(),
                           [&](const tok::ParsedToolCall& t) { return t.index == call.index; });
    if (call.fragment && it != c.result.tool_calls.rend())
      it->arguments += call.arguments;
    else
      c.result.tool_calls.push_back(call);
  }
  if (!stream_ || (s.content.empty() && s.reasoning.empty() && s.calls.empty() && !lp)) return {};
  if (chat_) {
    ChatDelta d;
    d.index = c.result.index;
    if (!s.content.empty()) d.content = s.content;
    if (!s.reasoning.empty()) d.reasoning = s.reasoning;
    d.tool_calls = s.calls;
    d.logprobs = std::move(lp);
    return sse_event(chat_chunk(meta_, d, include_usage_, *tok_));
  }
  return sse_event(completion_chunk(meta_, c.result.index, s.content, std::nullopt, include_usage_,
                                    lp, c.text_offset, *tok_));
}

std::string CompletionWriter::prompt_logprobs(int choice, const std::vector<int32_t>& prompt,
                                              const std::vector<TokenLogprobs>& scored) {
  if (!prompt_logprobs_ || choice < 0 || static_cast<size_t>(choice) >= choices_.size() ||
      prompt.empty())
    return {};
  ChoiceState& c = choices_[static_cast<size_t>(choice)];
  // Each token's offset in the echoed text: where its bytes are found next; a token whose
  // bytes are not there (BOS and other special tokens the text does not spell) takes no room.
  std::vector<TokenLogprobs> lps;
  size_t pos = 0, chars = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    TokenLogprobs t;
    if (i == 0) {
      t.token = prompt[0];
      t.unscored = true;
    } else if (i - 1 < scored.size()) {
      t = scored[i - 1];
    } else {
      t.token = prompt[i];
      t.unscored = true;  // not scored (the engine gave fewer scores than prompt tokens)
    }
    t.text_offset = static_cast<int64_t>(chars);
    const std::string_view b = tok_->token_bytes(prompt[i]);
    const bool here = !b.empty() && echo_.compare(pos, b.size(), b) == 0;
    if (here || !tok_->is_special(prompt[i])) {
      const size_t n = std::min(b.size(), echo_.size() - pos);
      chars += utf8_chars(std::string_view(echo_).substr(pos, n));
      pos += n;
    }
    lps.push_back(std::move(t));
  }
  c.lps.insert(c.lps.begin(), lps.begin(), lps.end());
  if (!stream_) return {};
  return sse_event(
      completion_chunk(meta_, c.result.index, echo_, std::nullopt, include_usage_, lps, 0, *tok_));
}

std::string CompletionWriter::token(int choice, int32_t id, std::optional<TokenLogprobs> lp) {
  if (choice < 0 || static_cast<size_t>(choice) >= choices_.size()) return {};
  ChoiceState& c = choices_[static_cast<size_t>(choice)];
  if (c.ended) return {};
  ++usage_.completion_tokens;
  if (stop_ids_.count(id)) return end_choice(choice, "stop", c.stream->finish());
  std::optional<std::vector<TokenLogprobs>> one;
  if (want_logprobs_ && lp) {
    if (!chat_) {
      lp->text_offset = static_cast<int64_t>(c.text_offset);
      c.text_offset += utf8_chars(tok_->token_bytes(id));
    }
    c.lps.push_back(*lp);
    one = std::vector<TokenLogprobs>{*lp};
  }
  ChoiceStream::Step s = c.stream->push(id);
  if (s.stopped) {
    std::string out = emit(choice, s, one);
    return out + end_choice(choice, "stop", {});
  }
  return emit(choice, s, one);
}

std::string CompletionWriter::end_choice(int choice, const std::string& reason,
                                         ChoiceStream::Step tail) {
  ChoiceState& c = choices_[static_cast<size_t>(choice)];
  std::string out = emit(choice, tail, std::nullopt);
  c.ended = true;
  c.result.finish_reason = chat_ ? c.stream->finish_reason(reason) : reason;
  if (want_logprobs_) c.result.logprobs = c.lps;
  if (!stream_) return out;
  if (chat_) {
    ChatDelta d;
    d.index = c.result.index;
    d.finish_reason = c.result.finish_reason;
    out += sse_event(chat_chunk(meta_, d, include_usage_, *tok_));
  } else {
    out += sse_event(completion_chunk(meta_, c.result.index, "", c.result.finish_reason,
                                      include_usage_, std::nullopt, c.text_offset, *tok_));
  }
  return out;
}

bool CompletionWriter::finished(int choice) const {
  return choice >= 0 && static_cast<size_t>(choice) < choices_.size() &&
         choices_[static_cast<size_t>(choice)].ended;
}

std::string CompletionWriter::finish(int choice, const std::string& reason) {
  if (choice < 0 || static_cast<size_t>(choice) >= choices_.size()) return {};
  ChoiceState& c = choices_[static_cast<size_t>(choice)];
  if (c.ended) return {};
  ChoiceStream::Step tail = c.stream->finish();
  return end_choice(choice, tail.stopped ? "stop" : reason, std::move(tail));
}

std::string CompletionWriter::done() {
  std::string out;
  for (size_t i = 0; i < choices_.size(); ++i)
    if (!choices_[i].ended) out += finish(static_cast<int>(i), "stop");
  if (stream_) {
    if (include_usage_)
      out += sse_event(
          usage_chunk(meta_, chat_ ? "chat.completion.chunk" : "text_completion", usage_));
    out += sse_done();
    return out;
  }
  std::vector<Choice> res;
  for (const auto& c : choices_) res.push_back(c.result);
  return (chat_ ? chat_completion(meta_, res, usage_, *tok_)
                : text_completion(meta_, res, usage_, *tok_))
      .dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace spark::openai
