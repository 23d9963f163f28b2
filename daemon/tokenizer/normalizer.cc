#include "daemon/tokenizer/normalizer.h"

#include <fmt/format.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include <vector>

#include "daemon/tokenizer/regex.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
using Ptr = std::shared_ptr<const Normalizer>;

enum class Form { nfc, nfd, nfkc, nfkd };

class UnicodeForm final : public Normalizer {
 public:
  explicit UnicodeForm(const icu::Normalizer2* n) : n_(n) {}
  void apply(std::string& text) const override {
    UErrorCode st = U_ZERO_ERROR;
    if (n_->isNormalizedUTF8(text, st) && U_SUCCESS(st)) return;
    std::string out;
    icu::StringByteSink<std::string> sink(&out);
    st = U_ZERO_ERROR;
    n_->normalizeUTF8(0, text, sink, nullptr, st);
    if (U_SUCCESS(st)) text = std::move(out);
  }

 private:
  const icu::Normalizer2* n_;
};

class Lowercase final : public Normalizer {
 public:
  // Hugging Face lower-cases character by character (full mappings, no context rules).
  void apply(std::string& text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      char32_t cp = 0;
      i += utf8_next(text, i, &cp);
      UChar src[2];
      int32_t n = 0;
      U16_APPEND_UNSAFE(src, n, cp);
      UChar dst[8];
      UErrorCode st = U_ZERO_ERROR;
      int32_t m = u_strToLower(dst, 8, src, n, "", &st);
      if (U_FAILURE(st)) {
        utf8_append(out, cp);
        continue;
      }
      for (int32_t k = 0; k < m;) {
        UChar32 c;
        U16_NEXT_UNSAFE(dst, k, c);
        utf8_append(out, static_cast<char32_t>(c));
      }
    }
    text = std::move(out);
  }
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void apply(std::string& text) const override {
    std::vector<std::pair<size_t, char32_t>> cps;
    for (size_t i = 0; i < text.size();) {
      char32_t cp = 0;
      size_t n = utf8_next(text, i, &cp);
      cps.emplace_back(i, cp);
      i += n;
    }
    size_t b = 0, e = cps.size();
    if (left_)
      while (b < e && u_isUWhiteSpace(static_cast<UChar32>(cps[b].second))) ++b;
    if (right_)
      while (e > b && u_isUWhiteSpace(static_cast<UChar32>(cps[e - 1].second))) --e;
    size_t bb = b < cps.size() ? cps[b].first : text.size();
    size_t eb = e < cps.size() ? cps[e].first : text.size();
    text = text.substr(bb, eb - bb);
  }

 private:
  bool left_, right_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string p) : p_(std::move(p)) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, p_);
  }

 private:
  std::string p_;
};

class Replace final : public Normalizer {
 public:
  Replace(Regex re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void apply(std::string& text) const override {
    auto m = re_.find_all(text);
    if (m.empty()) return;
    std::string out;
    size_t prev = 0;
    for (auto [b, e] : m) {
      out.append(text, prev, b - prev);
      out += content_;
      prev = e;
    }
    out.append(text, prev);
    text = std::move(out);
  }

 private:
  Regex re_;
  std::string content_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<Ptr> steps) : steps_(std::move(steps)) {}
  void apply(std::string& text) const override {
    for (const auto& s : steps_) s->apply(text);
  }

 private:
  std::vector<Ptr> steps_;
};

Result<const icu::Normalizer2*> icu_form(Form f) {
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (f) {
    case Form::nfc:
      n = icu::Normalizer2::getNFCInstance(st);
      break;
    case Form::nfd:
      n = icu::Normalizer2::getNFDInstance(st);
      break;
    case Form::nfkc:
      n = icu::Normalizer2::getNFKCInstance(st);
      break;
    case Form::nfkd:
      n = icu::Normalizer2::getNFKDInstance(st);
      break;
  }
  if (U_FAILURE(st) || !n)
    return make_error(Errc::internal,
                      fmt::format("ICU normalizer unavailable: {}", u_errorName(st)));
  return n;
}
}  // namespace

Result<Ptr> make_normalizer(const nlohmann::json& j) {
  if (j.is_null()) return Ptr{};
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    return make_error(Errc::config, "normalizer: expected an object with a string \"type\"");
  std::string type = j["type"].get<std::string>();
  auto form = [&](Form f) -> Result<Ptr> {
    auto n = icu_form(f);
    if (!n) return n.error();
    return Ptr(std::make_shared<UnicodeForm>(*n));
  };
  if (type == "NFC") return form(Form::nfc);
  if (type == "NFD") return form(Form::nfd);
  if (type == "NFKC") return form(Form::nfkc);
  if (type == "NFKD") return form(Form::nfkd);
  if (type == "Lowercase") return Ptr(std::make_shared<Lowercase>());
  if (type == "Strip")
    return Ptr(std::make_shared<Strip>(j.value("strip_left", true), j.value("strip_right", true)));
  if (type == "Prepend") {
    if (!j.contains("prepend") || !j["prepend"].is_string())
      return make_error(Errc::config, "normalizer Prepend: missing string \"prepend\"");
    return Ptr(std::make_shared<Prepend>(j["prepend"].get<std::string>()));
  }
  if (type == "Replace") {
    const auto& pat = j.value("pattern", nlohmann::json());
    if (!j.contains("content") || !j["content"].is_string() || !pat.is_object())
      return make_error(Errc::config, "normalizer Replace: needs \"pattern\" and \"content\"");
    std::string src;
    if (pat.contains("String") && pat["String"].is_string())
      src = regex_escape(pat["String"].get<std::string>());
    else if (pat.contains("Regex") && pat["Regex"].is_string())
      src = pat["Regex"].get<std::string>();
    else
      return make_error(Errc::config, "normalizer Replace: pattern needs String or Regex");
    auto re = Regex::compile(src);
    if (!re) return re.error();
    return Ptr(std::make_shared<Replace>(std::move(*re), j["content"].get<std::string>()));
  }
  if (type == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array())
      return make_error(Errc::config, "normalizer Sequence: missing array \"normalizers\"");
    std::vector<Ptr> steps;
    for (const auto& s : j["normalizers"]) {
      auto n = make_normalizer(s);
      if (!n) return n.error();
      if (*n) steps.push_back(*n);
    }
    return Ptr(std::make_shared<Sequence>(std::move(steps)));
  }
  return make_error(Errc::unsupported,
                    fmt::format("normalizer type '{}' is not supported (supported: NFC, NFD, "
                                "NFKC, NFKD, Lowercase, Strip, Prepend, Replace, Sequence)",
                                type));
}

}  // namespace spark::tok
