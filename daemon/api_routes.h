#pragma once
// The OpenAI-compatible API on rank 0 (/v1/models, /v1/chat/completions, /v1/completions,
// /tokenize, /detokenize) in front of the native engine. HTTP threads parse, tokenize on a
// small worker pool and submit to the engine's queue; they never run model code. Engine
// events (on the engine thread) go through the openai layer's CompletionWriter and are written to
// the connection; a streaming client that disconnects cancels its request, which frees its
// slot at the next engine step.
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "daemon/engine/engine.h"
#include "daemon/grammar/json_grammar.h"
#include "daemon/openai/requests.h"
#include "daemon/tokenizer/chat.h"
#include "daemon/tokenizer/tokenizer.h"

namespace spark::daemon {

class HttpServer;
class Metrics;

/// What the routes serve once the engine is up. Filled by the native backend after loading;
/// until then the daemon's readiness gate answers 503.
struct ApiModel {
  engine::Engine* engine = nullptr;  // owned by the backend; outlives the routes' use of it
  tok::Tokenizer tokenizer;
  tok::ChatFormat chat_format;
  std::string model;  // the served name (MODEL)
  int max_context = 0;
  std::set<int32_t> stop_token_ids;  // end-of-turn and EOS ids
  /// The vocabulary as structured outputs' masks see it (openai::make_token_trie); null
  /// when the tokenizer's tokens are not byte strings (such requests are then refused).
  std::shared_ptr<const grammar::TokenTrie> token_trie;
  std::shared_ptr<const grammar::TokenTrie> tool_token_trie;  // with the tool-call markers
  openai::Limits limits;
  int64_t created = 0;  // /v1/models "created"
  /// CHAT_SPECIAL_TOKENS=escape: special-token spellings in chat message content are read
  /// as text (Tokenizer::escape_special), never as the tokens themselves.
  bool escape_special = true;
  /// Called before a request is submitted; blocks while memory is short (MemoryGuard) and
  /// fails the request (503) when memory stays short. Null: no guard.
  std::function<Status()> admit;
  /// Request counters and latency histograms (sparkd_request_success_total, TTFT, ...).
  Metrics* metrics = nullptr;
};

/// Shared between the backend (which sets and clears the model) and the routes.
class ApiState {
 public:
  void set(std::shared_ptr<const ApiModel> m);
  std::shared_ptr<const ApiModel> get() const;

  /// Requests in flight, newest last, for the memory guard's cancel hook.
  using Canceller = std::function<bool(const std::string& reason)>;
  uint64_t add_request(Canceller c);
  void remove_request(uint64_t token);
  /// Cancels the newest request in flight (its client gets a 503 naming `reason`); true if
  /// there was one.
  bool cancel_newest(const std::string& reason);

 private:
  mutable std::mutex mu_;
  std::shared_ptr<const ApiModel> model_;
  uint64_t next_token_ = 1;
  std::map<uint64_t, Canceller> requests_;
};

/// Registers the API routes on `server` (before it starts). Replaces the daemon's
/// placeholder /v1/models.
/// Bodies over kLongBody bytes are parsed and tokenized on a worker of their own, so that
/// long prompts never keep short requests waiting.
void add_api_routes(HttpServer& server, std::shared_ptr<ApiState> state);
inline constexpr size_t kLongBody = 64u << 10;

/// True when `texts` cannot fit `max_context` tokens, decided without tokenizing more than
/// about max_context tokens of them: pieces of 4 KiB are counted until a lower bound of
/// the whole passes the limit (a cut can move a token boundary, hence the slack per cut).
/// *counted: that lower bound.
bool exceeds_context(const tok::Tokenizer& tok, const std::vector<std::string_view>& texts,
                     int max_context, int64_t* counted);

}  // namespace spark::daemon
