#include "daemon/tokenizer/tokenizer.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/strings.h"
#include "daemon/tokenizer/added_vocab.h"
#include "daemon/tokenizer/byte_level.h"
#include "daemon/tokenizer/decoder.h"
#include "daemon/tokenizer/normalizer.h"
#include "daemon/tokenizer/pre_tokenizer.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

using nlohmann::json;

namespace {
// One element of a TemplateProcessing "single" template.
struct TemplatePiece {
  bool is_sequence = false;
  std::vector<TokenId> ids;  // special token ids when !is_sequence
};

}  // namespace

struct Tokenizer::Impl {
  std::unique_ptr<BpeModel> model;
  std::shared_ptr<const Normalizer> normalizer;
  std::shared_ptr<const PreTokenizer> pre;
  std::unique_ptr<AddedVocab> added;
  std::unordered_map<std::string, TokenId> added_by_content;
  std::unordered_map<TokenId, size_t> added_by_id;  // index into added->tokens()
  std::vector<TemplatePiece> single;                // empty: no post-processing template
  std::shared_ptr<const Decoder> decoder;           // null: tokens joined by spaces
  bool byte_level = false;                          // decoder is plain ByteLevel: fast path
  std::vector<std::string> bytes;                   // per id: what decoding it contributes
  std::vector<bool> special;
  size_t limit = 0;
};

namespace {
Status parse_post_processor(const json& j, Tokenizer::Impl& t, const std::string& where) {
  if (j.is_null()) return Status::Ok();
  std::string type = j.value("type", std::string());
  if (type == "ByteLevel") return Status::Ok();  // offsets only; ids unchanged
  if (type == "Sequence") {
    for (const auto& p : j.value("processors", json::array()))
      SPARK_TRY(parse_post_processor(p, t, where));
    return Status::Ok();
  }
  auto special_ids = [&](const std::string& name) -> Result<std::vector<TokenId>> {
    if (auto it = t.added_by_content.find(name); it != t.added_by_content.end())
      return std::vector<TokenId>{it->second};
    if (auto id = t.model->token_to_id(name)) return std::vector<TokenId>{*id};
    return make_error(Errc::config,
                      fmt::format("{}: post_processor names token '{}' that is not in the "
                                  "vocabulary",
                                  where, name));
  };
  if (type == "TemplateProcessing") {
    const json& specials = j.value("special_tokens", json::object());
    for (const auto& item : j.value("single", json::array())) {
      TemplatePiece p;
      if (item.contains("Sequence")) {
        p.is_sequence = true;
      } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id")) {
        std::string name = item["SpecialToken"]["id"].get<std::string>();
        if (specials.contains(name) && specials[name].contains("ids") &&
            specials[name]["ids"].is_array()) {
          for (const auto& id : specials[name]["ids"]) {
            if (!id.is_number_integer())
              return make_error(Errc::config, fmt::format("{}: post_processor special token "
                                                          "'{}' has a non-integer id",
                                                          where, name));
            p.ids.push_back(id.get<TokenId>());
          }
        } else {
          auto ids = special_ids(name);
          if (!ids) return ids.error();
          p.ids = *ids;
        }
      } else {
        return make_error(Errc::config,
                          fmt::format("{}: post_processor template item {} is neither "
                                      "Sequence nor SpecialToken",
                                      where, item.dump()));
      }
      t.single.push_back(std::move(p));
    }
    return Status::Ok();
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json& cls = j.value("cls", json::array());
    const json& sep = j.value("sep", json::array());
    if (!cls.is_array() || cls.size() != 2 || !sep.is_array() || sep.size() != 2)
      return make_error(Errc::config, fmt::format("{}: {} needs cls and sep", where, type));
    t.single.push_back({false, {cls[1].get<TokenId>()}});
    t.single.push_back({true, {}});
    t.single.push_back({false, {sep[1].get<TokenId>()}});
    return Status::Ok();
  }
  return make_error(Errc::unsupported,
                    fmt::format("{}: post_processor type '{}' is not supported (supported: "
                                "TemplateProcessing, ByteLevel, RobertaProcessing, "
                                "BertProcessing, Sequence)",
                                where, type));
}

}  // namespace

Result<Tokenizer> Tokenizer::from_json(std::string_view text, std::string_view origin) {
  std::string where(origin.empty() ? "tokenizer.json" : origin);
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return make_error(Errc::config, fmt::format("{}: not valid JSON: {}", where, e.what()));
  }
  if (!j.is_object()) return make_error(Errc::config, where + ": top level is not an object");
  auto impl = std::make_shared<Impl>();
  auto wrap = [&](const Error& e) {
    return Error{e.code, fmt::format("{}: {}", where, e.message)};
  };
  try {
    static const json kNull;
    auto mit = j.find("model");  // by reference: the vocabulary and merges are not copied
    auto model = BpeModel::from_json(mit != j.end() ? *mit : kNull);
    if (!model) return wrap(model.error());
    impl->model = std::move(*model);
    auto norm = make_normalizer(j.value("normalizer", json()));
    if (!norm) return wrap(norm.error());
    impl->normalizer = *norm;
    auto pre = make_pre_tokenizer(j.value("pre_tokenizer", json()));
    if (!pre) return wrap(pre.error());
    impl->pre = *pre;

    std::vector<AddedToken> added;
    static const json kNone = json::array();
    auto ajit = j.find("added_tokens");
    const json& aj = ajit != j.end() && !ajit->is_null() ? *ajit : kNone;  // no copy
    if (!aj.is_array()) return make_error(Errc::config, where + ": added_tokens is not an array");
    if (aj.size() > kMaxAddedTokens)
      return make_error(Errc::config,
                        fmt::format("{}: added_tokens holds {} entries, more than the {} sparkd "
                                    "accepts (real tokenizers have a few thousand at most)",
                                    where, aj.size(), kMaxAddedTokens));
    added.reserve(aj.size());
    for (const auto& a : aj) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string() || a["id"].get<int64_t>() < 0 ||
          a["id"].get<int64_t>() > 16'000'000)
        return make_error(Errc::config, fmt::format("{}: added_tokens entry {} needs an integer id "
                                                    "(0..16000000) and a string content",
                                                    where, a.dump()));
      AddedToken t;
      t.id = a["id"].get<TokenId>();
      t.content = a["content"].get<std::string>();
      if (!utf8_valid(t.content) || t.content.empty()) continue;
      auto b = [&](const char* k, bool def) {
        return a.contains(k) && a[k].is_boolean() ? a[k].get<bool>() : def;
      };
      t.special = b("special", false);
      t.single_word = b("single_word", false);
      t.lstrip = b("lstrip", false);
      t.rstrip = b("rstrip", false);
      t.normalized = b("normalized", !t.special);
      added.push_back(std::move(t));
    }
    impl->added = std::make_unique<AddedVocab>(std::move(added), impl->normalizer.get());
    const auto& toks = impl->added->tokens();
    for (size_t i = 0; i < toks.size(); ++i) {
      impl->added_by_content.emplace(toks[i].content, toks[i].id);
      impl->added_by_id.emplace(toks[i].id, i);
    }
    SPARK_TRY(parse_post_processor(j.value("post_processor", json()), *impl, where));
    auto dec = make_decoder(j.value("decoder", json()), &impl->byte_level);
    if (!dec) return wrap(dec.error());
    impl->decoder = *dec;
  } catch (const json::exception& e) {
    return make_error(Errc::config, fmt::format("{}: malformed field: {}", where, e.what()));
  }

  size_t limit = impl->model->id_limit();
  for (const auto& t : impl->added->tokens())
    limit = std::max(limit, static_cast<size_t>(t.id) + 1);
  impl->limit = limit;
  impl->bytes.assign(limit, std::string());
  impl->special.assign(limit, false);
  for (size_t id = 0; id < limit; ++id) {
    const std::string* s = nullptr;
    std::string normalized;
    if (auto it = impl->added_by_id.find(static_cast<TokenId>(id)); it != impl->added_by_id.end()) {
      const AddedToken& t = impl->added->tokens()[it->second];
      s = &t.content;
      // Hugging Face decodes a normalized added token as its normalized content.
      if (t.normalized && impl->normalizer) {
        normalized = t.content;
        impl->normalizer->apply(normalized);
        s = &normalized;
      }
      impl->special[id] = t.special;
    } else {
      s = impl->model->id_to_token(static_cast<TokenId>(id));
    }
    if (!s) continue;
    impl->bytes[id] = impl->byte_level ? byte_level_to_bytes(*s) : *s;
  }
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

Result<Tokenizer> Tokenizer::from_file(const std::string& path) {
  auto text = read_file(path);
  if (!text)
    return make_error(Errc::not_found,
                      fmt::format("{}: cannot read the tokenizer file; check the model directory "
                                  "contains tokenizer.json",
                                  path));
  return from_json(*text, path);
}

std::vector<TokenId> Tokenizer::encode(std::string_view text_in, bool add_special_tokens) const {
  std::string clean;
  std::string_view text = text_in;
  if (!utf8_valid(text)) {
    clean = utf8_lossy(text);
    text = clean;
  }
  const Impl& t = *impl_;
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<std::string> pieces;
  for (auto& seg : t.added->split(text, t.normalizer.get())) {
    if (seg.token) {
      ids.push_back(*seg.token);
      continue;
    }
    // Marks of escape_special() kept the special token from matching; the text itself is
    // tokenized without them.
    if (seg.text.find(kLiteralMark) != std::string::npos) {
      std::string plain;
      plain.reserve(seg.text.size());
      std::string_view rest = seg.text;
      for (size_t at; (at = rest.find(kLiteralMark)) != std::string_view::npos;) {
        plain.append(rest.substr(0, at));
        rest.remove_prefix(at + kLiteralMark.size());
      }
      plain.append(rest);
      seg.text = std::move(plain);
      if (seg.text.empty()) continue;
    }
    pieces.clear();
    pieces.push_back(std::move(seg.text));
    if (t.pre) t.pre->split(pieces, seg.at_start);
    for (const auto& p : pieces) t.model->tokenize(p, ids);
  }
  if (!add_special_tokens || t.single.empty()) return ids;
  std::vector<TokenId> out;
  out.reserve(ids.size() + 4);
  for (const auto& p : t.single) {
    if (p.is_sequence)
      out.insert(out.end(), ids.begin(), ids.end());
    else
      out.insert(out.end(), p.ids.begin(), p.ids.end());
  }
  return out;
}

std::string Tokenizer::escape_special(std::string_view text) const {
  const auto& toks = impl_->added->tokens();
  bool first[256] = {};
  for (const auto& t : toks)
    if (t.special && !t.content.empty()) first[static_cast<unsigned char>(t.content[0])] = true;
  first[static_cast<unsigned char>(kLiteralMark[0])] = true;
  std::string out;
  out.reserve(text.size() + 16);
  size_t i = 0;
  while (i < text.size()) {
    if (!first[static_cast<unsigned char>(text[i])]) {
      out += text[i++];
      continue;
    }
    if (text.substr(i, kLiteralMark.size()) == kLiteralMark) {
      out += "\xEF\xBF\xBD";  // U+FFFD: the client's own mark is not ours
      i += kLiteralMark.size();
      continue;
    }
    bool hit = false;
    for (const auto& t : toks)
      if (t.special && !t.content.empty() && text.substr(i, t.content.size()) == t.content) {
        hit = true;
        break;
      }
    // The mark goes after the first character, so that no special token matches here.
    size_t n = 1;
    if (hit)
      while (i + n < text.size() && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
    out.append(text.substr(i, n));
    if (hit) out += kLiteralMark;
    i += n;
  }
  return out;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  if (t.byte_level) {
    std::string out;
    for (TokenId id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= t.limit) continue;
      if (skip_special_tokens && t.special[static_cast<size_t>(id)]) continue;
      out += t.bytes[static_cast<size_t>(id)];
    }
    return utf8_lossy(out);
  }
  std::vector<std::string> tokens;
  for (TokenId id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= t.limit) continue;
    if (skip_special_tokens && t.special[static_cast<size_t>(id)]) continue;
    if (!id_to_token(id)) continue;
    tokens.push_back(t.bytes[static_cast<size_t>(id)]);
  }
  if (!t.decoder) return join(tokens, " ");
  t.decoder->decode_chain(tokens);
  std::string out;
  for (const auto& x : tokens) out += x;
  return out;
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token));
      it != impl_->added_by_content.end())
    return it->second;
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(TokenId id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return impl_->added->tokens()[it->second].content;
  if (const std::string* s = impl_->model->id_to_token(id)) return *s;
  return std::nullopt;
}

size_t Tokenizer::vocab_size() const {
  return impl_->limit;
}

bool Tokenizer::is_special(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->limit &&
         impl_->special[static_cast<size_t>(id)];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added->tokens();
}

std::string_view Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->limit) return {};
  return impl_->bytes[static_cast<size_t>(id)];
}

bool Tokenizer::byte_level_decoder() const {
  return impl_->byte_level;
}

namespace {
// First code point boundary at or after byte i of valid UTF-8 s.
size_t char_boundary(const std::string& s, size_t i) {
  while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
  return i;
}
}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special_tokens)
    : tok_(&tok), skip_special_(skip_special_tokens) {}

std::string StreamDecoder::push(TokenId id) {
  if (!tok_->byte_level_decoder()) {
    // Hugging Face's DecodeStream: decode a short window of ids, emit what it adds to the
    // window's previous text once that does not end in U+FFFD, then slide the window.
    ids_.push_back(id);
    std::string text = tok_->decode(ids_, skip_special_);
    // (Hugging Face fails when the text no longer starts with the window's old text, which
    // byte-fallback groups can cause on invalid UTF-8; we go on with what is new.)
    if (text.size() <= prefix_.size() || ends_with(text, "\xEF\xBF\xBD")) return {};
    std::string out = text.substr(char_boundary(text, prefix_.size()));
    size_t new_prefix_index = ids_.size() - prefix_index_;
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_index_));
    prefix_ = tok_->decode(ids_, skip_special_);
    prefix_index_ = new_prefix_index;
    return out;
  }
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_bytes(id);
  size_t hold = utf8_incomplete_tail(pending_);
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StreamDecoder::finish() {
  if (!tok_->byte_level_decoder()) {
    std::string text = tok_->decode(ids_, skip_special_);
    std::string out =
        text.size() > prefix_.size() ? text.substr(char_boundary(text, prefix_.size())) : "";
    ids_.clear();
    prefix_.clear();
    prefix_index_ = 0;
    return out;
  }
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace spark::tok
