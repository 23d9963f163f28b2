#include "daemon/tokenizer/pre_tokenizer.h"

#include <fmt/format.h>
#include <unicode/uchar.h>

#include <algorithm>

#include "daemon/tokenizer/byte_level.h"
#include "daemon/tokenizer/regex.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
using Ptr = std::shared_ptr<const PreTokenizer>;
using Span = std::pair<size_t, size_t>;

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// Turns a list of match spans into the (offsets, is_match) cover of the whole string.
std::vector<std::pair<Span, bool>> cover(const std::vector<Span>& matches, size_t len) {
  std::vector<std::pair<Span, bool>> out;
  size_t prev = 0;
  for (auto m : matches) {
    if (prev != m.first) out.push_back({{prev, m.first}, false});
    out.push_back({m, true});
    prev = m.second;
  }
  if (prev != len) out.push_back({{prev, len}, false});
  return out;
}

// Applies a split behavior to a (span, is_match) cover; returns the spans to keep.
std::vector<Span> apply_behavior(std::vector<std::pair<Span, bool>> m, Behavior b) {
  std::vector<Span> out;
  switch (b) {
    case Behavior::isolated:
      for (auto& [s, is] : m) out.push_back(s);
      break;
    case Behavior::removed:
      for (auto& [s, is] : m)
        if (!is) out.push_back(s);
      break;
    case Behavior::contiguous: {
      bool prev = false;
      for (auto& [s, is] : m) {
        if (is == prev && !out.empty())
          out.back().second = s.second;
        else
          out.push_back(s);
        prev = is;
      }
      break;
    }
    case Behavior::merged_with_previous: {
      bool prev = false;
      for (auto& [s, is] : m) {
        if (is && !prev && !out.empty())
          out.back().second = s.second;
        else
          out.push_back(s);
        prev = is;
      }
      break;
    }
    case Behavior::merged_with_next: {
      bool prev = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->second && !prev && !out.empty())
          out.back().first = it->first.first;
        else
          out.push_back(it->first);
        prev = it->second;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

void emit(const std::string& s, const std::vector<Span>& spans, std::vector<std::string>& out) {
  for (auto [b, e] : spans)
    if (e > b) out.emplace_back(s, b, e - b);
}

class Split final : public PreTokenizer {
 public:
  Split(Regex re, Behavior b, bool invert) : re_(std::move(re)), b_(b), invert_(invert) {}
  void split(std::vector<std::string>& pieces, bool /*at_start*/) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size() * 4);
    for (const auto& p : pieces) {
      auto c = cover(re_.find_all(p), p.size());
      if (invert_)
        for (auto& x : c) x.second = !x.second;
      emit(p, apply_behavior(std::move(c), b_), out);
    }
    pieces = std::move(out);
  }

 private:
  Regex re_;
  Behavior b_;
  bool invert_;
};

const Regex& gpt2_regex() {
  static const Regex re = *Regex::compile(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return re;
}

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void split(std::vector<std::string>& pieces, bool /*at_start*/) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size() * (use_regex_ ? 4 : 1));
    for (auto& p : pieces) {
      if (p.empty()) continue;
      if (add_prefix_space_ && p[0] != ' ') p.insert(0, " ");
      if (use_regex_) {
        for (auto [b, e] : gpt2_regex().find_all(p))
          out.push_back(bytes_to_byte_level(std::string_view(p).substr(b, e - b)));
      } else {
        out.push_back(bytes_to_byte_level(p));
      }
    }
    pieces = std::move(out);
  }

 private:
  bool add_prefix_space_, use_regex_;
};

class Digits final : public PreTokenizer {
 public:
  explicit Digits(bool individual) : individual_(individual) {}
  void split(std::vector<std::string>& pieces, bool /*at_start*/) const override {
    std::vector<std::string> out;
    for (const auto& p : pieces) {
      std::vector<Span> matches;
      for (size_t i = 0; i < p.size();) {
        char32_t cp = 0;
        size_t n = utf8_next(p, i, &cp);
        if (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_N_MASK)  // Rust char::is_numeric
          matches.push_back({i, i + n});
        i += n;
      }
      emit(p,
           apply_behavior(cover(matches, p.size()),
                          individual_ ? Behavior::isolated : Behavior::contiguous),
           out);
    }
    pieces = std::move(out);
  }

 private:
  bool individual_;
};

class Metaspace final : public PreTokenizer {
 public:
  enum class Prepend { always, first, never };
  Metaspace(std::string replacement, Prepend prepend, bool split)
      : rep_(std::move(replacement)), prepend_(prepend), split_(split) {}
  void split(std::vector<std::string>& pieces, bool at_start) const override {
    std::vector<std::string> out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string p;
      for (char c : pieces[i]) {
        if (c == ' ')
          p += rep_;
        else
          p += c;
      }
      bool prepend =
          prepend_ == Prepend::always || (prepend_ == Prepend::first && at_start && i == 0);
      if (prepend && !p.starts_with(rep_)) p.insert(0, rep_);
      if (!split_) {
        if (!p.empty()) out.push_back(std::move(p));
        continue;
      }
      // Split before every replacement character (MergedWithNext).
      size_t b = 0;
      for (size_t k = p.find(rep_, 1); k != std::string::npos; k = p.find(rep_, k + 1)) {
        if (k > b) out.push_back(p.substr(b, k - b));
        b = k;
      }
      if (b < p.size()) out.push_back(p.substr(b));
    }
    pieces = std::move(out);
  }

 private:
  std::string rep_;
  Prepend prepend_;
  bool split_;
};

class Sequence final : public PreTokenizer {
 public:
  explicit Sequence(std::vector<Ptr> steps) : steps_(std::move(steps)) {}
  void split(std::vector<std::string>& pieces, bool at_start) const override {
    for (const auto& s : steps_) s->split(pieces, at_start);
  }

 private:
  std::vector<Ptr> steps_;
};

Result<Behavior> parse_behavior(const nlohmann::json& j) {
  std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Removed") return Behavior::removed;
  if (b == "Isolated") return Behavior::isolated;
  if (b == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (b == "MergedWithNext") return Behavior::merged_with_next;
  if (b == "Contiguous") return Behavior::contiguous;
  return make_error(Errc::config, fmt::format("pre_tokenizer Split: unknown behavior '{}'", b));
}
}  // namespace

Result<Ptr> make_pre_tokenizer(const nlohmann::json& j) {
  if (j.is_null()) return Ptr{};
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    return make_error(Errc::config, "pre_tokenizer: expected an object with a string \"type\"");
  std::string type = j["type"].get<std::string>();
  if (type == "Split") {
    const auto& pat = j.value("pattern", nlohmann::json());
    std::string src;
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string())
      src = pat["Regex"].get<std::string>();
    else if (pat.is_object() && pat.contains("String") && pat["String"].is_string())
      src = regex_escape(pat["String"].get<std::string>());
    else
      return make_error(Errc::config, "pre_tokenizer Split: pattern needs String or Regex");
    auto re = Regex::compile(src);
    if (!re) return re.error();
    auto b = parse_behavior(j.value("behavior", nlohmann::json()));
    if (!b) return b.error();
    bool invert = j.contains("invert") && j["invert"].is_boolean() && j["invert"].get<bool>();
    return Ptr(std::make_shared<Split>(std::move(*re), *b, invert));
  }
  auto flag = [&](const char* k, bool def) {
    return j.contains(k) && j[k].is_boolean() ? j[k].get<bool>() : def;
  };
  if (type == "ByteLevel")
    return Ptr(
        std::make_shared<ByteLevel>(flag("add_prefix_space", true), flag("use_regex", true)));
  if (type == "Metaspace") {
    std::string rep = j.contains("replacement") && j["replacement"].is_string()
                          ? j["replacement"].get<std::string>()
                          : "\xE2\x96\x81";
    // One character, as in HF tokenizers (a `char` there): a longer string would multiply
    // every space into many tokens.
    char32_t first = 0;
    if (rep.empty() || !utf8_valid(rep) || utf8_next(rep, 0, &first) != rep.size())
      return make_error(Errc::config,
                        "pre_tokenizer Metaspace: 'replacement' must be one character");
    auto prepend = Metaspace::Prepend::always;
    if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string()) {
      std::string ps = j["prepend_scheme"].get<std::string>();
      if (ps == "first")
        prepend = Metaspace::Prepend::first;
      else if (ps == "never")
        prepend = Metaspace::Prepend::never;
      else if (ps != "always")
        return make_error(Errc::config,
                          fmt::format("pre_tokenizer Metaspace: unknown prepend_scheme '{}'", ps));
    } else if (!flag("add_prefix_space", true)) {
      prepend = Metaspace::Prepend::never;
    }
    return Ptr(std::make_shared<Metaspace>(rep, prepend, flag("split", true)));
  }
  if (type == "Digits") return Ptr(std::make_shared<Digits>(flag("individual_digits", false)));
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      return make_error(Errc::config, "pre_tokenizer Sequence: missing array \"pretokenizers\"");
    std::vector<Ptr> steps;
    for (const auto& s : j["pretokenizers"]) {
      auto p = make_pre_tokenizer(s);
      if (!p) return p.error();
      if (*p) steps.push_back(*p);
    }
    return Ptr(std::make_shared<Sequence>(std::move(steps)));
  }
  return make_error(Errc::unsupported,
                    fmt::format("pre_tokenizer type '{}' is not supported (supported: Split, "
                                "ByteLevel, Digits, Sequence)",
                                type));
}

}  // namespace spark::tok
