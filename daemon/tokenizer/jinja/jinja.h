#pragma once
// A Jinja interpreter for Hugging Face chat templates: the subset those templates use,
// with the semantics of Python Jinja2 as transformers configures it (trim_blocks and
// lstrip_blocks on, loop controls, the sandbox's immutable lists and dicts, transformers'
// `tojson`, `raise_exception` and `strftime_now`). A template is parsed whole at load:
// every filter, test, method and function it names is checked then, so a template that
// uses something we do not implement fails at load with the construct and its line,
// never at a request.
#include <memory>
#include <string>
#include <string_view>

#include "core/error.h"
#include "daemon/tokenizer/py_json.h"

namespace spark::tok::jinja {

struct Node;

/// A parsed template; cheap to copy (the tree is shared and immutable).
class Template {
 public:
  /// Parses `source`; `name` prefixes error messages ("chat_template line 12: ...").
  /// Errc::config for syntax errors, Errc::unsupported for constructs we do not implement.
  static Result<Template> parse(std::string_view source, std::string name = "template");

  /// Renders with `context` (an object: its keys become template variables). A template's
  /// raise_exception() and type errors are Errc::usage naming the line.
  Result<std::string> render(const Json& context) const;

 private:
  std::shared_ptr<const Node> root_;
  std::string name_;
};

}  // namespace spark::tok::jinja
