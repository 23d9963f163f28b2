#include "daemon/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

struct Regex::Code {
  pcre2_code* re = nullptr;
  ~Code() { pcre2_code_free(re); }
};

namespace {
// Per-thread match scratch: one ovector pair is enough (only the whole match is used) and a
// JIT stack large enough for long whitespace runs.
struct Scratch {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* mc = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* js = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  Scratch() { pcre2_jit_stack_assign(mc, nullptr, js); }
  ~Scratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(js);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}
}  // namespace

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  int class_depth = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      ++i;
      bool in = class_depth > 0;
      if (e == 'w') {
        out += in ? "\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}"
                  : "[\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]";
      } else if (e == 'W' && !in) {
        out += "[^\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[') {
      // "[:alpha:]" inside a class is a POSIX class, not a nested class.
      if (class_depth > 0 && i + 1 < p.size() && p[i + 1] == ':') {
        size_t close = p.find(":]", i + 2);
        if (close != std::string_view::npos) {
          out.append(p.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
      }
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

std::string regex_escape(std::string_view lit) {
  std::string out;
  for (char c : lit) {
    if (std::string_view("\\^$.|?*+()[]{}-#&~ ").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

Result<Regex> Regex::compile(std::string_view pattern) {
  std::string pcre = onig_to_pcre2(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre.data()), pcre.size(),
                                 PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return make_error(Errc::config, fmt::format("regex '{}' does not compile at offset {}: {}",
                                                pattern, off, reinterpret_cast<char*>(msg)));
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT fails
  auto code = std::make_shared<Code>();
  code->re = re;
  Regex r;
  r.code_ = std::move(code);
  return r;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  Scratch& s = scratch();
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    int rc = pcre2_match(code_->re, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, s.md, s.mc);
    if (rc < 0) break;  // no match (or a resource limit: the rest stays unmatched)
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.md);
    size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      pos = e;
    } else {  // empty match: step over one character
      if (b >= text.size()) break;
      pos = b + utf8_seq_len(static_cast<unsigned char>(text[b]));
    }
  }
  return out;
}

}  // namespace spark::tok
