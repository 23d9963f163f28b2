#include "core/error.h"

namespace spark {

std::string_view errc_name(Errc e) {
  switch (e) {
    case Errc::ok: return "ok";
    case Errc::usage: return "usage";
    case Errc::config: return "config";
    case Errc::not_found: return "not_found";
    case Errc::io: return "io";
    case Errc::network: return "network";
    case Errc::timeout: return "timeout";
    case Errc::auth: return "auth";
    case Errc::remote: return "remote";
    case Errc::precondition: return "precondition";
    case Errc::busy: return "busy";
    case Errc::unsupported: return "unsupported";
    case Errc::integrity: return "integrity";
    case Errc::resource: return "resource";
    case Errc::internal: return "internal";
  }
  return "internal";
}

// Exit codes: 0 ok; 1 is reserved for "checks ran and something failed" (preflight FAIL,
// status not ready), 2 usage, 3 config, then one per kind. Keep man/sparkctl.1 in step.
int exit_code(Errc e) {
  switch (e) {
    case Errc::ok: return 0;
    case Errc::usage: return 2;
    case Errc::config: return 3;
    case Errc::not_found: return 4;
    case Errc::io: return 5;
    case Errc::network: return 6;
    case Errc::timeout: return 7;
    case Errc::auth: return 8;
    case Errc::remote: return 9;
    case Errc::precondition: return 10;
    case Errc::busy: return 11;
    case Errc::unsupported: return 12;
    case Errc::integrity: return 13;
    case Errc::resource: return 14;
    case Errc::internal: return 70;
  }
  return 70;
}

int http_status(Errc e) {
  switch (e) {
    case Errc::ok: return 200;
    case Errc::usage: return 400;
    case Errc::config: return 400;
    case Errc::not_found: return 404;
    case Errc::auth: return 401;
    case Errc::precondition: return 503;
    case Errc::busy: return 503;
    case Errc::unsupported: return 501;
    case Errc::resource: return 429;
    case Errc::timeout: return 504;
    case Errc::network: return 502;
    case Errc::remote: return 502;
    case Errc::integrity: return 500;
    case Errc::io: return 500;
    case Errc::internal: return 500;
  }
  return 500;
}

Error make_error(Errc code, std::string message) { return Error{code, std::move(message)}; }

}  // namespace spark
