#pragma once
// One API request from parsed body to response bytes, engine-agnostic: prepare_* turns the
// request into prompt ids and a completion budget; a CompletionWriter takes each choice's
// generated tokens as the engine produces them and returns what to write (SSE text while
// streaming, the JSON body at the end otherwise). The HTTP layer owns sockets, the engine
// owns sampling; this owns the OpenAI semantics in between.
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/openai/requests.h"
#include "daemon/openai/responses.h"
#include "daemon/openai/stream.h"
#include "daemon/tokenizer/chat.h"
#include "daemon/tokenizer/tokenizer.h"

namespace spark::openai {

/// What the engine needs for a request.
struct PreparedPrompt {
  std::string text;          // rendered prompt (chat) or the prompt (completions)
  std::vector<int32_t> ids;  // prompt token ids
  int max_tokens = 0;        // completion budget per choice
};

/// True when `texts` cannot fit `max_context` tokens, decided without tokenizing more than
/// about max_context tokens of them: pieces of 4 KiB are counted until a lower bound of
/// the whole passes the limit (a cut can move a token boundary, hence the slack per cut).
/// *counted: that lower bound.
bool exceeds_context(const tok::Tokenizer& tok, const std::vector<std::string_view>& texts,
                     int max_context, int64_t* counted);
/// The 400 context_length_exceeded for `what` (e.g. "messages") of `bytes` bytes that hold
/// more than `counted` tokens; `param` names the request field.
ApiError context_exceeded(int max_context, int64_t counted, size_t bytes, const char* param,
                          const char* what);

/// Renders the chat (tools unless tool_choice is none), checks the rendered text against the
/// context before tokenizing it whole, encodes it and checks the budget. `stop` (polled
/// during a template render) ends the render (a 503).
ApiResult<PreparedPrompt> prepare_chat(const ChatRequest& req, const tok::Tokenizer& tok,
                                       const tok::ChatFormat& fmt, int max_context,
                                       const std::function<bool()>& stop = {});
/// Encodes the prompt (with the tokenizer's BOS template) or takes the given ids.
ApiResult<PreparedPrompt> prepare_completion(const CompletionRequest& req,
                                             const tok::Tokenizer& tok, int max_context);

/// Turns engine output for one request (n choices) into API bytes.
class CompletionWriter {
 public:
  /// Chat request. `stop_token_ids`: end-of-turn/EOS ids; they end a choice and are never
  /// shown as text.
  CompletionWriter(const ChatRequest& req, const tok::Tokenizer& tok, const tok::ChatFormat& fmt,
                   std::string model, int prompt_tokens, std::set<int32_t> stop_token_ids);
  /// Completions request (`prompt_text` is echoed first when echo is set).
  CompletionWriter(const CompletionRequest& req, const tok::Tokenizer& tok, std::string model,
                   int prompt_tokens, std::set<int32_t> stop_token_ids, std::string prompt_text);

  bool streaming() const { return stream_; }
  /// "text/event-stream" or "application/json".
  const char* content_type() const;
  /// Streaming: the first bytes (chat: each choice's role delta). Empty otherwise.
  std::string start();
  /// Echo with logprobs: the prompt's tokens (`prompt`) and the engine's scores of tokens
  /// 1.. (`scored`), which lead `choice`'s logprobs (the first token's logprob null).
  /// Streaming, the echoed prompt goes out here with them. Returns bytes to write now.
  std::string prompt_logprobs(int choice, const std::vector<int32_t>& prompt,
                              const std::vector<TokenLogprobs>& scored);
  /// One generated token of `choice`. Returns bytes to write now (streaming) or "".
  std::string token(int choice, int32_t id, std::optional<TokenLogprobs> lp = std::nullopt);
  /// True once `choice` has ended (stop string or stop token): the engine can drop it.
  bool finished(int choice) const;
  /// The engine ended `choice` with "stop" (EOS) or "length". Returns bytes to write.
  std::string finish(int choice, const std::string& reason);
  /// Prompt tokens the prefix cache served (choice 0's), for usage.
  void cached_tokens(int n) { usage_.cached_tokens = n; }
  /// After every choice finished: streaming -> usage chunk (if asked) + [DONE]; otherwise
  /// the whole JSON body.
  std::string done();

 private:
  struct ChoiceState {
    std::unique_ptr<ChoiceStream> stream;
    Choice result;
    bool role_sent = false;
    bool ended = false;
    std::vector<TokenLogprobs> lps;
    size_t text_offset = 0;  // completions logprobs: the next token's, in characters
  };
  std::string end_choice(int choice, const std::string& reason, ChoiceStream::Step tail);
  std::string emit(int choice, const ChoiceStream::Step& s,
                   std::optional<std::vector<TokenLogprobs>> lp);

  const tok::Tokenizer* tok_;
  bool chat_, stream_, include_usage_, want_logprobs_;
  bool prompt_logprobs_ = false;  // echo with logprobs
  std::set<int32_t> stop_ids_;
  ResponseMeta meta_;
  Usage usage_;
  std::string echo_;
  std::vector<ChoiceState> choices_;
};

}  // namespace spark::openai
