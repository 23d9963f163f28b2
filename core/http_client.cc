#include "core/http_client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <optional>

#include "core/strings.h"

namespace spark {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {
template <typename SV>
std::string str(const SV& sv) {
  return std::string(sv.data(), sv.size());
}
}  // namespace

Result<HttpReply> http_call(const HttpCall& call) {
  std::string where = call.host + ":" + std::to_string(call.port);
  net::io_context ioc{1};
  tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buf;
  http::request<http::string_body> req{http::string_to_verb(call.method), call.target, 11};
  req.set(http::field::host, call.host);
  req.set(http::field::user_agent, "sparkd");
  req.set(http::field::connection, "close");
  for (auto& [k, v] : call.headers) req.set(k, v);
  if (!call.body.empty() || call.method == "POST" || call.method == "PUT") {
    req.set(http::field::content_type, call.content_type);
    req.body() = call.body;
    req.prepare_payload();
  }
  http::response_parser<http::string_body> parser;
  parser.body_limit(256ull << 20);

  std::optional<beast::error_code> done;
  std::string stage = "resolving";
  auto finish = [&](beast::error_code ec) { done = ec; };
  stream.expires_after(call.timeout);
  resolver.async_resolve(
      call.host, std::to_string(call.port),
      [&](beast::error_code ec, tcp::resolver::results_type r) {
        if (ec) return finish(ec);
        stage = "connecting";
        stream.async_connect(r, [&](beast::error_code ec2, const tcp::endpoint&) {
          if (ec2) return finish(ec2);
          stage = "sending";
          http::async_write(stream, req, [&](beast::error_code ec3, size_t) {
            if (ec3) return finish(ec3);
            stage = "reading the reply";
            http::async_read(stream, buf, parser,
                             [&](beast::error_code ec4, size_t) { finish(ec4); });
          });
        });
      });
  // The resolver is not covered by the stream's timer; bound the whole run as well.
  ioc.run_for(call.timeout + std::chrono::milliseconds(200));
  if (!done) {
    resolver.cancel();
    beast::error_code ig;
    stream.socket().close(ig);
    return make_error(Errc::timeout, "HTTP " + call.method + " http://" + where + call.target +
                                         ": no answer within " +
                                         std::to_string(call.timeout.count()) + " ms (" + stage +
                                         ")");
  }
  if (*done == beast::error::timeout) {
    return make_error(Errc::timeout, "HTTP " + call.method + " http://" + where + call.target +
                                         ": no answer within " +
                                         std::to_string(call.timeout.count()) + " ms (" + stage +
                                         ")");
  }
  if (*done) {
    return make_error(Errc::network, "HTTP " + call.method + " http://" + where + call.target +
                                         ": " + stage + " failed: " + done->message());
  }
  auto& res = parser.get();
  HttpReply out;
  out.status = static_cast<int>(res.result_int());
  for (auto& f : res) {
    std::string k = str(f.name_string());
    for (auto& c : k) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out.headers[k] = str(f.value());
  }
  out.body = std::move(res.body());
  beast::error_code ig;
  stream.socket().shutdown(tcp::socket::shutdown_both, ig);
  return out;
}

Result<Url> parse_url(const std::string& url) {
  std::string_view s = url;
  if (starts_with(s, "https://"))
    return make_error(Errc::unsupported, "'" + url +
                                             "': https is not supported; use http:// on a "
                                             "local or fabric address");
  if (!starts_with(s, "http://"))
    return make_error(Errc::config, "'" + url + "' is not an http:// URL");
  s.remove_prefix(7);
  Url u;
  auto slash = s.find('/');
  std::string_view hostport = s.substr(0, slash);
  u.target = slash == std::string_view::npos ? "/" : std::string(s.substr(slash));
  auto colon = hostport.rfind(':');
  if (colon != std::string_view::npos) {
    auto p = parse_u64(hostport.substr(colon + 1));
    if (!p || *p == 0 || *p > 65535)
      return make_error(Errc::config, "'" + url + "': bad port '" +
                                          std::string(hostport.substr(colon + 1)) + "'");
    u.port = static_cast<uint16_t>(*p);
    hostport = hostport.substr(0, colon);
  }
  if (hostport.empty()) return make_error(Errc::config, "'" + url + "': no host");
  u.host = std::string(hostport);
  return u;
}

Result<HttpReply> http_get(const std::string& url, std::chrono::milliseconds timeout) {
  auto u = parse_url(url);
  if (!u) return u.error();
  HttpCall c;
  c.host = u->host;
  c.port = u->port;
  c.target = u->target;
  c.timeout = timeout;
  return http_call(c);
}

}  // namespace spark
