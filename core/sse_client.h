#pragma once
// A streaming HTTP/1.1 POST for OpenAI-style server-sent events, with three deadlines: the
// reply's headers, the silence between two reads (a stalled stream), and the whole request
// (an endless stream). http_client.h reads a whole reply at once; a benchmark needs the time
// of every event as it arrives, so this reads the body piece by piece and hands each SSE
// `data:` payload to a callback. Every error names host:port, the target and how far the
// stream got.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "core/error.h"
#include "core/http_client.h"

namespace spark {

/// Deadlines and limits of one streamed request.
struct StreamLimits {
  std::chrono::milliseconds headers{30000};  // until the status line and headers
  std::chrono::milliseconds idle{30000};     // most silence between two reads
  std::chrono::milliseconds total{300000};   // the whole request
  uint64_t max_bytes = 64ull << 20;          // body bytes at most
  /// Polled every 100 ms, also while nothing arrives (a long prefill): true stops the
  /// request at once (Errc::resource, "stopped").
  std::function<bool()> stop;
};

/// How a streamed request ended. A non-2xx reply is not an error: its status and body are
/// here (the body read whole, within max_bytes).
struct StreamReply {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // non-SSE replies only
  uint64_t events = 0;                         // data payloads seen
  bool done = false;                           // "data: [DONE]" seen
  bool stopped = false;                        // the callback asked to stop
};

/// Called with each event's data (the `data:` lines joined by '\n'), not for [DONE].
/// Returns false to stop reading (the connection is closed).
using SseHandler = std::function<bool(std::string_view data)>;

/// POSTs `call` (its timeout is ignored: `limits` rule) and streams the reply. Errc::timeout
/// when a deadline passes, Errc::network when the peer cannot be reached or closes the
/// connection before the stream ends ([DONE] or the end of the body), Errc::resource past
/// max_bytes.
Result<StreamReply> http_stream(const HttpCall& call, const StreamLimits& limits,
                                const SseHandler& on_event);

/// Splits SSE text into events: feed() bytes as they come; each complete event's data goes
/// to the handler. Comments (":") and fields other than data are skipped; CRLF is accepted.
class SseParser {
 public:
  /// Returns false when the handler asked to stop. Sets *done on "[DONE]".
  bool feed(std::string_view bytes, const SseHandler& on_event, bool* done, uint64_t* events);

 private:
  std::string pending_;  // bytes of an incomplete line
  std::string data_;     // data of the event being read
  bool has_data_ = false;
};

}  // namespace spark
