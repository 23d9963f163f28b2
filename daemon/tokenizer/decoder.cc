#include "daemon/tokenizer/decoder.h"

#include <fmt/format.h>

#include "daemon/tokenizer/byte_level.h"
#include "daemon/tokenizer/regex.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
using Ptr = std::shared_ptr<const Decoder>;

std::vector<char32_t> code_points(const std::string& s) {
  std::vector<char32_t> out;
  for (size_t i = 0; i < s.size();) {
    char32_t c = 0;
    i += utf8_next(s, i, &c);
    out.push_back(c);
  }
  return out;
}
std::string from_code_points(const std::vector<char32_t>& cps, size_t b, size_t e) {
  std::string out;
  for (size_t i = b; i < e; ++i) utf8_append(out, cps[i]);
  return out;
}

class ByteLevelDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& t : tokens) bytes += byte_level_to_bytes(t);
    tokens = {utf8_lossy(bytes)};
  }
};

class ReplaceDec final : public Decoder {
 public:
  ReplaceDec(Regex re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      auto m = re_.find_all(t);
      if (m.empty()) continue;
      std::string out;
      size_t prev = 0;
      for (auto [b, e] : m) {
        out.append(t, prev, b - prev);
        out += content_;
        prev = e;
      }
      out.append(t, prev);
      t = std::move(out);
    }
  }

 private:
  Regex re_;
  std::string content_;
};

class ByteFallbackDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    size_t pending_n = 0;
    auto flush = [&] {
      if (!pending_n) return;
      if (utf8_valid(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending_n; ++i) out.push_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_n = 0;
    };
    for (auto& t : tokens) {
      int b = byte_token(t);
      if (b >= 0) {
        pending += static_cast<char>(b);
        ++pending_n;
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int byte_token(const std::string& t) {  // "<0xAB>"
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    int h = hex(t[3]), l = hex(t[4]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class FuseDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens = {std::move(all)};
  }
};

class StripDec final : public Decoder {
 public:
  StripDec(char32_t content, size_t start, size_t stop) : c_(content), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      auto cps = code_points(t);
      size_t b = 0;
      while (b < cps.size() && b < start_ && cps[b] == c_) ++b;
      size_t e = cps.size(), cut = 0;
      while (e > b && cut < stop_ && cps[e - 1] == c_) --e, ++cut;
      t = from_code_points(cps, b, e);
    }
  }

 private:
  char32_t c_;
  size_t start_, stop_;
};

class MetaspaceDec final : public Decoder {
 public:
  MetaspaceDec(char32_t replacement, bool prepend) : r_(replacement), prepend_(prepend) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size();) {
        char32_t c = 0;
        k += utf8_next(t, k, &c);
        if (c == r_) {
          if (i == 0 && prepend_) continue;  // Hugging Face drops it in the first token
          out += ' ';
        } else {
          utf8_append(out, c);
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  char32_t r_;
  bool prepend_;
};

class SequenceDec final : public Decoder {
 public:
  explicit SequenceDec(std::vector<Ptr> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& s : steps_) s->decode_chain(tokens);
  }

 private:
  std::vector<Ptr> steps_;
};

Result<char32_t> single_char(const nlohmann::json& j, const char* key, const char* def) {
  std::string s = j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : def;
  if (s.empty() || !utf8_valid(s))
    return make_error(Errc::config, fmt::format("decoder: '{}' must be one character", key));
  char32_t c = 0;
  if (utf8_next(s, 0, &c) != s.size())
    return make_error(Errc::config, fmt::format("decoder: '{}' must be one character", key));
  return c;
}
}  // namespace

Result<Ptr> make_decoder(const nlohmann::json& j, bool* byte_level_only) {
  *byte_level_only = false;
  if (j.is_null()) return Ptr{};
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    return make_error(Errc::config, "decoder: expected an object with a string \"type\"");
  std::string type = j["type"].get<std::string>();
  if (type == "ByteLevel") {
    *byte_level_only = true;
    return Ptr(std::make_shared<ByteLevelDec>());
  }
  if (type == "ByteFallback") return Ptr(std::make_shared<ByteFallbackDec>());
  if (type == "Fuse") return Ptr(std::make_shared<FuseDec>());
  if (type == "Strip") {
    auto c = single_char(j, "content", " ");
    if (!c) return c.error();
    auto num = [&](const char* k) {
      return j.contains(k) && j[k].is_number_unsigned() ? j[k].get<size_t>() : size_t{0};
    };
    return Ptr(std::make_shared<StripDec>(*c, num("start"), num("stop")));
  }
  if (type == "Metaspace") {
    auto c = single_char(j, "replacement", "\xE2\x96\x81");
    if (!c) return c.error();
    bool prepend = true;
    if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string())
      prepend = j["prepend_scheme"].get<std::string>() != "never";
    else if (j.contains("add_prefix_space") && j["add_prefix_space"].is_boolean())
      prepend = j["add_prefix_space"].get<bool>();
    return Ptr(std::make_shared<MetaspaceDec>(*c, prepend));
  }
  if (type == "Replace") {
    const auto& pat = j.value("pattern", nlohmann::json());
    std::string src;
    if (pat.is_object() && pat.contains("String") && pat["String"].is_string())
      src = regex_escape(pat["String"].get<std::string>());
    else if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string())
      src = pat["Regex"].get<std::string>();
    else
      return make_error(Errc::config, "decoder Replace: pattern needs String or Regex");
    if (!j.contains("content") || !j["content"].is_string())
      return make_error(Errc::config, "decoder Replace: missing string \"content\"");
    auto re = Regex::compile(src);
    if (!re) return re.error();
    return Ptr(std::make_shared<ReplaceDec>(std::move(*re), j["content"].get<std::string>()));
  }
  if (type == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array())
      return make_error(Errc::config, "decoder Sequence: missing array \"decoders\"");
    std::vector<Ptr> steps;
    bool only_byte_level = j["decoders"].size() == 1;
    for (const auto& d : j["decoders"]) {
      bool bl = false;
      auto p = make_decoder(d, &bl);
      if (!p) return p.error();
      only_byte_level = only_byte_level && bl;
      if (*p) steps.push_back(*p);
    }
    *byte_level_only = only_byte_level;
    return Ptr(std::make_shared<SequenceDec>(std::move(steps)));
  }
  return make_error(Errc::unsupported,
                    fmt::format("decoder '{}' is not supported (supported: ByteLevel, Metaspace, "
                                "Replace, ByteFallback, Fuse, Strip, Sequence)",
                                type));
}

}  // namespace spark::tok
