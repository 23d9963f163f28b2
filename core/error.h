#pragma once
// One closed set of error kinds for the whole toolkit, mapped once to process exit codes
// and once to HTTP status codes. Functions return Status / Result<T>; exceptions are
// used only at boundaries (main, the HTTP route wrapper).
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace spark {

enum class Errc {
  ok = 0,
  usage,            // bad command line
  config,           // invalid cluster file or value
  not_found,        // a named file, node, rank, device does not exist
  io,               // read/write/filesystem failure
  network,          // connect/resolve/transfer failure
  timeout,          // a deadline passed
  auth,             // SSH host key / user key / API key refused
  remote,           // a remote command failed (non-zero exit)
  precondition,     // the machine is not in the state required (preflight failure, memory)
  busy,             // a lock is held by someone else
  unsupported,      // a feature, architecture or platform we do not handle
  integrity,        // checksum/digest/identity mismatch
  resource,         // out of memory, disk full, too many requests
  internal,         // a bug
};

/// Stable lower-case name for an error kind ("config", "timeout", ...), used in JSON.
std::string_view errc_name(Errc e);

/// Process exit code for an error kind; documented in sparkctl(1) and sparkd(8).
int exit_code(Errc e);

/// HTTP status for an error kind (sparkd's routes).
int http_status(Errc e);

/// An error kind plus a message that says what failed, where, and the fix.
struct Error {
  Errc code = Errc::internal;
  std::string message;
};

/// Success, or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error e) : err_(std::move(e)), ok_(false) {}  // NOLINT(google-explicit-constructor)
  static Status Ok() { return {}; }
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return err_; }
  Errc code() const { return ok_ ? Errc::ok : err_.code; }
  const std::string& message() const { return err_.message; }

 private:
  Error err_;
  bool ok_ = true;
};

/// A value, or an Error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T v) : v_(std::move(v)) {}        // NOLINT(google-explicit-constructor)
  Result(Error e) : v_(std::move(e)) {}    // NOLINT(google-explicit-constructor)
  Result(Status s) : v_(s.error()) {}      // NOLINT(google-explicit-constructor); s must not be ok
  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const { return std::get<Error>(v_); }
  Status status() const { return ok() ? Status() : Status(error()); }

 private:
  std::variant<T, Error> v_;
};

/// Builds an Error: make_error(Errc::config, "{}:{}: ...", file, line).
Error make_error(Errc code, std::string message);

}  // namespace spark

/// Returns the Status/Error of `expr` from the enclosing function when it is not ok.
#define SPARK_TRY(expr)                                  \
  do {                                                   \
    auto spark_try_status_ = (expr);                     \
    if (!spark_try_status_.ok()) return spark_try_status_.error(); \
  } while (0)
