#include "daemon/tokenizer/bpe.h"

#include <fmt/format.h>

#include <functional>
#include <queue>

#include "daemon/tokenizer/byte_level.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
uint64_t pair_key(TokenId a, TokenId b) {
  return static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b);
}

struct Symbol {
  TokenId id;
  int prev, next;
  size_t len;  // bytes of the word; 0 = merged away
};

struct QueueItem {
  uint32_t rank;
  size_t pos;
  TokenId new_id;
  // Min-heap on (rank, pos).
  bool operator>(const QueueItem& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};
}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::from_json(const nlohmann::json& m) {
  std::unique_ptr<BpeModel> bpe(new BpeModel());
  if (!m.is_object()) return make_error(Errc::config, "model: expected an object");
  std::string type = m.value("type", std::string("BPE"));
  if (type != "BPE")
    return make_error(Errc::unsupported,
                      fmt::format("model type '{}' is not supported (only BPE)", type));
  if (m.contains("dropout") && m["dropout"].is_number() && m["dropout"].get<double>() > 0)
    return make_error(Errc::unsupported, "model: BPE dropout is not supported at inference");
  if (!m.contains("vocab") || !m["vocab"].is_object())
    return make_error(Errc::config, "model: missing object \"vocab\"");
  TokenId max_id = -1;
  for (const auto& [tok, idj] : m["vocab"].items()) {
    if (!idj.is_number_integer() || idj.get<int64_t>() < 0 || idj.get<int64_t>() > INT32_MAX)
      return make_error(Errc::config, fmt::format("model.vocab['{}']: id is not a non-negative "
                                                  "32-bit integer",
                                                  tok));
    auto id = static_cast<TokenId>(idj.get<int64_t>());
    if (id > 16'000'000)
      return make_error(Errc::config, fmt::format("model.vocab['{}']: id {} is implausibly "
                                                  "large (limit 16000000)",
                                                  tok, id));
    bpe->vocab_[tok] = id;
    max_id = std::max(max_id, id);
  }
  bpe->vocab_r_.assign(static_cast<size_t>(max_id + 1), std::string());
  bpe->has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [tok, id] : bpe->vocab_) {
    bpe->vocab_r_[static_cast<size_t>(id)] = tok;
    bpe->has_id_[static_cast<size_t>(id)] = true;
  }
  auto opt_str = [&](const char* k) -> std::optional<std::string> {
    if (m.contains(k) && m[k].is_string()) return m[k].get<std::string>();
    return std::nullopt;
  };
  bpe->unk_token_ = opt_str("unk_token");
  bpe->prefix_ = opt_str("continuing_subword_prefix").value_or("");
  bpe->suffix_ = opt_str("end_of_word_suffix").value_or("");
  auto flag = [&](const char* k) { return m.contains(k) && m[k].is_boolean() && m[k].get<bool>(); };
  bpe->fuse_unk_ = flag("fuse_unk");
  bpe->byte_fallback_ = flag("byte_fallback");
  bpe->ignore_merges_ = flag("ignore_merges");
  if (bpe->unk_token_ && !bpe->vocab_.count(*bpe->unk_token_))
    return make_error(Errc::config, fmt::format("model.unk_token '{}' is not in the vocabulary",
                                                *bpe->unk_token_));

  if (m.contains("merges") && !m["merges"].is_array())
    return make_error(Errc::config, "model.merges: expected an array");
  uint32_t rank = 0;
  for (const auto& mj : m.value("merges", nlohmann::json::array())) {
    std::string a, b;
    if (mj.is_string()) {
      std::string s = mj.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return make_error(Errc::config,
                          fmt::format("model.merges[{}] '{}' is not two tokens separated by one "
                                      "space",
                                      rank, s));
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      a = mj[0].get<std::string>(), b = mj[1].get<std::string>();
    } else {
      return make_error(Errc::config,
                        fmt::format("model.merges[{}]: expected \"a b\" or [\"a\", \"b\"]", rank));
    }
    auto ia = bpe->vocab_.find(a), ib = bpe->vocab_.find(b);
    std::string joined =
        a +
        (bpe->prefix_.size() && b.starts_with(bpe->prefix_) ? b.substr(bpe->prefix_.size()) : b);
    auto in = bpe->vocab_.find(joined);
    if (ia == bpe->vocab_.end() || ib == bpe->vocab_.end() || in == bpe->vocab_.end())
      return make_error(Errc::config,
                        fmt::format("model.merges[{}] '{} {}': a token of the merge or its "
                                    "result is not in the vocabulary",
                                    rank, a, b));
    bpe->merges_[pair_key(ia->second, ib->second)] = Merge{rank, in->second};
    ++rank;
  }
  for (char32_t c = 0; c < 0x144; ++c) {
    std::string s;
    utf8_append(s, c);
    auto it = bpe->vocab_.find(s);
    bpe->byte_char_id_[c] = it == bpe->vocab_.end() ? -1 : it->second;
  }
  return bpe;
}

std::optional<TokenId> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= vocab_r_.size() || !has_id_[static_cast<size_t>(id)])
    return nullptr;
  return &vocab_r_[static_cast<size_t>(id)];
}

void BpeModel::tokenize(std::string_view word, std::vector<TokenId>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = word.size() < 256;
  Shard& shard = cache_[std::hash<std::string_view>{}(word) % kShards];
  if (cacheable) {
    std::lock_guard lock(shard.mu);
    auto it = shard.map.find(std::string(word));
    if (it != shard.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard lock(shard.mu);
    if (shard.map.size() < kShardCapacity)
      shard.map.emplace(std::string(word), std::vector<TokenId>(out.begin() + before, out.end()));
  }
}

void BpeModel::merge_word(std::string_view w, std::vector<TokenId>& out) const {
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](TokenId id, size_t len) {
    int n = static_cast<int>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back(Symbol{id, n - 1, -1, len});
  };
  // A pending unknown run: id and byte length (has_unk: one is pending). Not a
  // std::optional: GCC's -O2 maybe-uninitialized misreads one here.
  bool has_unk = false;
  std::pair<TokenId, size_t> unk{0, 0};
  bool plain = prefix_.empty() && suffix_.empty();
  for (size_t i = 0; i < w.size();) {
    char32_t cp = 0;
    size_t n = utf8_next(w, i, &cp);
    bool first = i == 0, last = i + n == w.size();
    TokenId id = -1;
    std::string s;
    if (plain && cp < 0x144) {
      id = byte_char_id_[cp];
    } else {
      s = std::string(w.substr(i, n));
      if (!first) s = prefix_ + s;
      if (last) s += suffix_;
      auto it = vocab_.find(s);
      if (it != vocab_.end()) id = it->second;
    }
    if (id >= 0) {
      if (has_unk) add(unk.first, unk.second), has_unk = false;
      add(id, n);
      i += n;
      continue;
    }
    if (s.empty()) s = std::string(w.substr(i, n));
    if (byte_fallback_) {
      std::vector<TokenId> bytes;
      for (unsigned char b : s) {
        auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
        if (it == vocab_.end()) break;
        bytes.push_back(it->second);
      }
      if (bytes.size() == s.size()) {
        for (TokenId b : bytes) add(b, 1);
        i += n;
        continue;
      }
    }
    if (unk_token_) {
      TokenId uid = vocab_.at(*unk_token_);
      if (has_unk && fuse_unk_) {
        unk.second += n;
      } else {
        if (has_unk) add(unk.first, unk.second);
        unk = std::make_pair(uid, n);
        has_unk = true;
      }
    }
    i += n;
  }
  if (has_unk) add(unk.first, unk.second);

  std::priority_queue<QueueItem, std::vector<QueueItem>, std::greater<QueueItem>> q;
  auto lookup = [&](TokenId a, TokenId b) -> const Merge* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i)
    if (const Merge* m = lookup(sym[i].id, sym[i + 1].id)) q.push({m->rank, i, m->new_id});
  while (!q.empty()) {
    QueueItem top = q.top();
    q.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next < 0) continue;
    auto next_pos = static_cast<size_t>(cur.next);
    Symbol right = sym[next_pos];
    const Merge* m = lookup(cur.id, right.id);
    if (!m || m->new_id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = static_cast<int>(top.pos);
    if (cur.prev >= 0) {
      auto p = static_cast<size_t>(cur.prev);
      if (const Merge* pm = lookup(sym[p].id, cur.id)) q.push({pm->rank, p, pm->new_id});
    }
    if (cur.next >= 0) {
      if (const Merge* nm = lookup(cur.id, sym[static_cast<size_t>(cur.next)].id))
        q.push({nm->rank, top.pos, nm->new_id});
    }
  }
  for (const Symbol& s : sym)
    if (s.len != 0) out.push_back(s.id);
}

}  // namespace spark::tok
