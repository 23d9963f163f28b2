#pragma once
// OpenAI-shaped API errors: {"error": {"message", "type", "param", "code"}} with the HTTP
// status that goes with them.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.h"

namespace spark::openai {

/// One API error. type: invalid_request_error, not_found_error, server_error, ...;
/// param: the request field at fault ("" = null); code: e.g. context_length_exceeded.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};

/// 400 invalid_request_error for `param`.
ApiError invalid_request(std::string message, std::string param = "", std::string code = "");
/// The JSON body of an error response.
nlohmann::ordered_json error_body(const ApiError& e);
/// Maps a toolkit Error to an API error (usage/config -> 400, not_found -> 404, timeout ->
/// 504, busy/resource -> 503/429, unsupported -> 400, everything else -> 500).
ApiError from_error(const Error& e, std::string param = "");

/// Result of parsing/validating a request: a value or an ApiError.
template <typename T>
struct ApiResult {
  std::optional<T> value;
  ApiError error;
  bool ok() const { return value.has_value(); }
};

}  // namespace spark::openai
