#include "daemon/openai/errors.h"

namespace spark::openai {

ApiError invalid_request(std::string message, std::string param, std::string code) {
  ApiError e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

nlohmann::ordered_json error_body(const ApiError& e) {
  nlohmann::ordered_json err;
  err["message"] = e.message;
  err["type"] = e.type;
  err["param"] =
      e.param.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.param);
  err["code"] = e.code.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.code);
  nlohmann::ordered_json body;
  body["error"] = std::move(err);
  return body;
}

ApiError from_error(const Error& err, std::string param) {
  ApiError e;
  e.message = err.message;
  e.param = std::move(param);
  switch (err.code) {
    case Errc::usage:
    case Errc::config:
    case Errc::unsupported:
      e.status = 400;
      break;
    case Errc::not_found:
      e.status = 404;
      e.type = "not_found_error";
      break;
    case Errc::timeout:
      e.status = 504;
      e.type = "timeout_error";
      break;
    case Errc::busy:
      e.status = 503;
      e.type = "service_unavailable_error";
      break;
    case Errc::resource:
      e.status = 429;
      e.type = "rate_limit_error";
      break;
    case Errc::auth:
      e.status = 401;
      e.type = "authentication_error";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
  }
  return e;
}

}  // namespace spark::openai
