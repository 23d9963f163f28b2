#pragma once
// A Jinja interpreter for Hugging Face chat templates: the subset those templates use,
// with the semantics of Python Jinja2 as transformers configures it (trim_blocks and
// lstrip_blocks on, loop controls, the sandbox's immutable lists and dicts, transformers'
// `tojson`, `raise_exception` and `strftime_now`). A template is parsed whole at load:
// every filter, test, method and function it names is checked then, so a template that
// uses something we do not implement fails at load with the construct and its line,
// never at a request.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "core/error.h"
#include "daemon/tokenizer/py_json.h"

namespace spark::tok::jinja {

struct Node;

/// The work one render may do. A template is data from a model repository, so every render
/// runs on a budget: `max_steps` counts evaluated nodes, loop iterations, list items built
/// or copied and every 32 bytes of text built; `timeout` is wall time (0: none); `stop`
/// is polled (with the clock, every few thousand steps) and ends the render when it
/// returns true (the client went away, the daemon is stopping). Besides, no string may
/// pass kMaxText bytes, no list kMaxItems items, no value nest deeper than kMaxNest.
struct RenderLimits {
  uint64_t max_steps = 10'000'000;
  std::chrono::milliseconds timeout{5000};
  std::function<bool()> stop;
};
inline constexpr size_t kMaxText = 64u << 20;
inline constexpr size_t kMaxItems = 1'000'000;
inline constexpr int kMaxNest = 256;

/// A parsed template; cheap to copy (the tree is shared and immutable).
class Template {
 public:
  /// Parses `source`; `name` prefixes error messages ("chat_template line 12: ...").
  /// Errc::config for syntax errors, Errc::unsupported for constructs we do not implement.
  static Result<Template> parse(std::string_view source, std::string name = "template");

  /// Renders with `context` (an object: its keys become template variables). A template's
  /// raise_exception() and type errors are Errc::usage naming the line. Passing a limit of
  /// `limits` (steps, time, sizes, nesting) or running out of memory is Errc::unsupported
  /// naming the line and the limit; a render ended by `limits.stop` is Errc::busy.
  Result<std::string> render(const Json& context, const RenderLimits& limits = {}) const;

 private:
  std::shared_ptr<const Node> root_;
  std::string name_;
};

}  // namespace spark::tok::jinja
