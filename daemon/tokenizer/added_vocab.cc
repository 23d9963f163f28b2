#include "daemon/tokenizer/added_vocab.h"

#include <unicode/uchar.h>

#include <algorithm>

#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
// Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation,
// Join_Control.
bool is_word_char(char32_t c) {
  auto u = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL))
    return true;
  return (U_GET_GC_MASK(u) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}
bool is_space(char32_t c) {
  return u_isUWhiteSpace(static_cast<UChar32>(c));
}

// Code point that ends at byte `end` (end > 0) of valid UTF-8.
char32_t cp_before(std::string_view s, size_t end, size_t* start) {
  size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  char32_t cp = 0;
  utf8_next(s, b, &cp);
  *start = b;
  return cp;
}
}  // namespace

void TokenMatcher::add(std::string_view pattern, size_t index) {
  if (pattern.empty()) return;
  entries_.push_back({std::string(pattern), index});
  first_[static_cast<unsigned char>(pattern[0])] = true;
}

void TokenMatcher::finish() {
  // Stable: of equal patterns the first added stays first, and wins.
  std::stable_sort(entries_.begin(), entries_.end(),
                   [](const Entry& a, const Entry& b) { return a.pattern < b.pattern; });
  entries_.shrink_to_fit();
}

std::pair<size_t, size_t> TokenMatcher::longest_at(std::string_view text, size_t pos) const {
  std::pair<size_t, size_t> best{static_cast<size_t>(-1), 0};
  // [lo, hi): the patterns whose first `depth` bytes are text[pos, pos + depth). Sorted, so
  // those with byte b at `depth` are a sub-range, and one that ends at `depth` comes first.
  auto lo = entries_.begin(), hi = entries_.end();
  for (size_t depth = 0; pos + depth < text.size() && lo != hi; ++depth) {
    const unsigned char b = static_cast<unsigned char>(text[pos + depth]);
    auto byte_at = [depth](const Entry& e) {
      return depth < e.pattern.size()
                 ? static_cast<int>(static_cast<unsigned char>(e.pattern[depth]))
                 : -1;
    };
    lo = std::partition_point(lo, hi, [&](const Entry& e) { return byte_at(e) < b; });
    hi = std::partition_point(lo, hi, [&](const Entry& e) { return byte_at(e) <= b; });
    if (lo != hi && lo->pattern.size() == depth + 1) best = {lo->index, depth + 1};
  }
  return best;
}

AddedVocab::AddedVocab(std::vector<AddedToken> tokens, const Normalizer* normalizer)
    : tokens_(std::move(tokens)) {
  // Hugging Face builds its matchers from special tokens first, then the others.
  std::vector<size_t> order(tokens_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&](size_t i) { return tokens_[i].special; });
  for (size_t i : order) {
    const AddedToken& t = tokens_[i];
    if (!t.normalized) {
      raw_.add(t.content, i);
    } else {
      std::string c = t.content;
      if (normalizer) normalizer->apply(c);
      normalized_.add(c, i);
    }
  }
  raw_.finish();
  normalized_.finish();
}

void AddedVocab::split_with(std::string_view s, const TokenMatcher& m, bool at_start,
                            std::vector<Segment>& out) const {
  if (m.empty()) {
    if (!s.empty()) out.push_back({std::string(s), std::nullopt, at_start});
    return;
  }
  size_t emitted = 0;  // end of the last emitted piece
  size_t pos = 0;
  while (pos < s.size()) {
    if (!m.may_start(static_cast<unsigned char>(s[pos]))) {
      ++pos;
      continue;
    }
    auto [idx, len] = m.longest_at(s, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;  // the scan resumes after this match whether it is kept or not
    const AddedToken& t = tokens_[idx];
    if (t.single_word) {
      size_t dummy = 0;
      bool start_ok = start == 0 || !is_word_char(cp_before(s, start, &dummy));
      char32_t next = 0;
      if (stop < s.size()) utf8_next(s, stop, &next);
      bool stop_ok = stop == s.size() || !is_word_char(next);
      if (!start_ok || !stop_ok) continue;
    }
    if (t.lstrip) {
      size_t ns = start;
      while (ns > 0) {
        size_t b = 0;
        if (!is_space(cp_before(s, ns, &b))) break;
        ns = b;
      }
      start = std::max(ns, emitted);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        char32_t cp = 0;
        size_t n = utf8_next(s, stop, &cp);
        if (!is_space(cp)) break;
        stop += n;
      }
      pos = std::max(pos, stop);
    }
    if (emitted < start)
      out.push_back({std::string(s.substr(emitted, start - emitted)), std::nullopt,
                     at_start && emitted == 0});
    out.push_back({std::string(s.substr(start, stop - start)), t.id, at_start && start == 0});
    emitted = stop;
  }
  if (emitted < s.size())
    out.push_back({std::string(s.substr(emitted)), std::nullopt, at_start && emitted == 0});
}

std::vector<Segment> AddedVocab::split(std::string_view text, const Normalizer* normalizer) const {
  std::vector<Segment> first;
  split_with(text, raw_, true, first);
  std::vector<Segment> out;
  for (auto& seg : first) {
    if (seg.token) {
      out.push_back(std::move(seg));
      continue;
    }
    if (normalizer) normalizer->apply(seg.text);
    split_with(seg.text, normalized_, seg.at_start, out);
  }
  return out;
}

}  // namespace spark::tok
