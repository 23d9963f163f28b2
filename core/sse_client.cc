#include "core/sse_client.h"

#include <fmt/format.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>

namespace spark {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool SseParser::feed(std::string_view bytes, const SseHandler& on_event, bool* done,
                     uint64_t* events) {
  pending_.append(bytes.data(), bytes.size());
  size_t start = 0;
  for (;;) {
    size_t nl = pending_.find('\n', start);
    if (nl == std::string::npos) break;
    std::string_view line(pending_.data() + start, nl - start);
    start = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {
      // End of an event.
      if (!has_data_) continue;
      std::string data = std::move(data_);
      data_.clear();
      has_data_ = false;
      if (data == "[DONE]") {
        *done = true;
        continue;
      }
      ++*events;
      if (!on_event(data)) {
        pending_.erase(0, start);
        return false;
      }
      continue;
    }
    if (line.front() == ':') continue;  // a comment (keep-alive)
    auto colon = line.find(':');
    std::string_view field = line.substr(0, colon);
    std::string_view value = colon == std::string_view::npos ? "" : line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (field != "data") continue;
    if (has_data_) data_ += '\n';
    data_.append(value.data(), value.size());
    has_data_ = true;
  }
  pending_.erase(0, start);
  return true;
}

Result<StreamReply> http_stream(const HttpCall& call, const StreamLimits& limits,
                                const SseHandler& on_event) {
  const std::string where =
      fmt::format("HTTP {} http://{}:{}{}", call.method, call.host, call.port, call.target);
  net::io_context ioc{1};
  tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buf;
  http::request<http::string_body> req{http::string_to_verb(call.method), call.target, 11};
  req.set(http::field::host, call.host);
  req.set(http::field::user_agent, "sparkctl");
  req.set(http::field::connection, "close");
  req.set(http::field::accept, "text/event-stream, application/json");
  for (auto& [k, v] : call.headers) req.set(k, v);
  req.set(http::field::content_type, call.content_type);
  req.body() = call.body;
  req.prepare_payload();

  http::response_parser<http::buffer_body> parser;
  parser.body_limit(limits.max_bytes);
  const auto t0 = Clock::now();
  const auto end = t0 + limits.total;
  StreamReply out;
  SseParser sse;
  bool sse_mode = false;
  std::optional<Error> failure;
  bool finished = false;
  std::string stage = "resolving";
  char chunk[16384];

  net::steady_timer poll(ioc);
  bool stopped_early = false;
  auto end_now = [&] {
    finished = true;
    poll.cancel();  // else run_for waits for the next poll
  };
  auto fail = [&](Error e) {
    if (!failure) failure = std::move(e);
    end_now();
  };
  auto left = [&] { return std::chrono::duration_cast<milliseconds>(end - Clock::now()); };
  // The next read's deadline: the idle limit, never past the whole request's.
  bool total_armed = false;  // the armed deadline is the whole request's
  auto arm = [&](milliseconds lim) {
    total_armed = left() <= lim;
    stream.expires_after(std::min(lim, std::max(left(), milliseconds(1))));
  };
  auto timeout_error = [&]() -> Error {
    if (total_armed || Clock::now() >= end)
      return make_error(Errc::timeout,
                        fmt::format("{}: the stream ran past its {:.0f} s limit after {} events "
                                    "without ending (an endless stream?)",
                                    where, limits.total.count() / 1000.0, out.events));
    if (stage == "reading the stream")
      return make_error(Errc::timeout,
                        fmt::format("{}: the stream stalled: nothing for {} ms after {} events",
                                    where, limits.idle.count(), out.events));
    return make_error(Errc::timeout, fmt::format("{}: no answer within {} ms ({})", where,
                                                 limits.headers.count(), stage));
  };

  // The stop poll: closing the socket aborts whatever operation is pending.
  std::function<void()> watch = [&] {
    poll.expires_after(milliseconds(100));
    poll.async_wait([&](beast::error_code ec) {
      if (ec || finished) return;
      if (limits.stop()) {
        stopped_early = true;
        beast::error_code ig;
        stream.socket().cancel(ig);
        stream.socket().close(ig);
        return;
      }
      watch();
    });
  };
  if (limits.stop) watch();

  std::function<void()> read_body;
  read_body = [&] {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof chunk;
    arm(limits.idle);
    http::async_read_some(stream, buf, parser, [&](beast::error_code ec, size_t) {
      size_t got = sizeof chunk - parser.get().body().size;
      if (ec == http::error::need_buffer) ec = {};
      if (got > 0) {
        std::string_view bytes(chunk, got);
        if (sse_mode) {
          if (!sse.feed(bytes, on_event, &out.done, &out.events)) {
            out.stopped = true;
            end_now();
            return;
          }
        } else {
          out.body.append(bytes.data(), bytes.size());
        }
      }
      if (ec == beast::error::timeout) return fail(timeout_error());
      if (ec == http::error::body_limit)
        return fail(make_error(
            Errc::resource, fmt::format("{}: the reply passed {} bytes", where, limits.max_bytes)));
      if (ec) {
        if (sse_mode && out.done) {
          end_now();
          return;
        }
        return fail(make_error(
            Errc::network, fmt::format("{}: the connection failed mid-stream after {} events: {}",
                                       where, out.events, ec.message())));
      }
      if (parser.is_done()) {
        end_now();
        return;
      }
      if (Clock::now() >= end) return fail(timeout_error());
      read_body();
    });
  };

  stream.expires_after(limits.headers);
  resolver.async_resolve(
      call.host, std::to_string(call.port),
      [&](beast::error_code ec, tcp::resolver::results_type r) {
        if (ec)
          return fail(make_error(Errc::network, fmt::format("{}: cannot resolve {}: {}", where,
                                                            call.host, ec.message())));
        stage = "connecting";
        stream.async_connect(r, [&](beast::error_code ec2, const tcp::endpoint&) {
          if (ec2 == beast::error::timeout) return fail(timeout_error());
          if (ec2)
            return fail(make_error(Errc::network,
                                   fmt::format("{}: cannot connect: {}", where, ec2.message())));
          stage = "sending";
          http::async_write(stream, req, [&](beast::error_code ec3, size_t) {
            if (ec3 == beast::error::timeout) return fail(timeout_error());
            if (ec3)
              return fail(make_error(Errc::network,
                                     fmt::format("{}: sending failed: {}", where, ec3.message())));
            stage = "waiting for the reply's headers";
            total_armed = left() <= limits.headers;
            stream.expires_after(std::min(limits.headers, left()));
            http::async_read_header(stream, buf, parser, [&](beast::error_code ec4, size_t) {
              if (ec4 == beast::error::timeout) return fail(timeout_error());
              if (ec4)
                return fail(make_error(
                    Errc::network,
                    fmt::format("{}: reading the reply failed: {}", where, ec4.message())));
              auto& res = parser.get();
              out.status = static_cast<int>(res.result_int());
              for (auto& f : res) {
                std::string k(f.name_string());
                for (auto& c : k)
                  c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
                out.headers[k] = std::string(f.value());
              }
              auto ct = out.headers["content-type"];
              sse_mode = out.status / 100 == 2 && ct.find("text/event-stream") != std::string::npos;
              stage = "reading the stream";
              if (parser.is_done()) {
                end_now();
                return;
              }
              read_body();
            });
          });
        });
      });
  // The resolver is not covered by the stream's timer: bound the loop as well.
  ioc.run_for(limits.total + milliseconds(500));
  if (stopped_early)
    return make_error(Errc::resource,
                      fmt::format("{}: stopped after {} events", where, out.events));
  if (!finished) {
    resolver.cancel();
    beast::error_code ig;
    stream.socket().close(ig);
    return timeout_error();
  }
  beast::error_code ig;
  stream.socket().close(ig);
  if (failure) return *failure;
  return out;
}

}  // namespace spark
