#pragma once
// Constrained decoding for structured outputs: a JSON Schema (the subset OpenAI's strict
// structured outputs take) compiled into a byte-level pushdown automaton, and per decoding
// step the set of vocabulary tokens whose bytes the automaton accepts from its state.
//
// The automaton is nondeterministic: its state is a set of stacks of frames (a frame is where
// the output is inside one schema node: an object between its keys, a string after a
// backslash, a number after its exponent sign, ...), so anyOf alternatives that begin alike
// run side by side until a byte tells them apart. Accepted JSON: no whitespace before the
// value, at most kMaxWhitespace bytes of it between tokens, object properties in the
// schema's order (a property not in `required` may be left out), numbers of at most
// kMaxDigits digits in the integer and fraction parts and 2 in the exponent, strings of valid UTF-8
// with escapes whose \u surrogates pair.
//
// The mask of one step walks a trie of the vocabulary's token bytes (built once per
// tokenizer, TokenTrie) with the automaton: a subtree is cut at the first byte no stack
// takes, and inside a string a subtree whose tokens are all plain text (valid UTF-8, no quote,
// backslash or control character) is taken whole without walking it, so a step costs about the
// number of distinct token prefixes the grammar allows up to its first structural byte, not vocab x
// token length.
//
// End of output: end-of-sequence ids are allowed exactly when some stack has completed the
// value (a number may still go on; anything else completed allows end-of-sequence alone).
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark::grammar {

using Json = nlohmann::ordered_json;  // property order is the output's order

inline constexpr int kMaxWhitespace = 16;  // whitespace bytes between two tokens of JSON
inline constexpr int kMaxDigits = 16;      // digits of an integer or fraction part

/// A compiled grammar (immutable, shared by the sequences that use it).
class Grammar {
 public:
  /// The value `schema` describes. Keywords outside the subset are refused: Errc::usage
  /// naming the keyword and where it is ("'pattern' at $.properties.id is not supported").
  static Result<std::shared_ptr<const Grammar>> from_schema(const Json& schema,
                                                            const std::string& where = "$");
  /// Any JSON object (response_format json_object).
  static std::shared_ptr<const Grammar> any_object();
  /// One of several values, each between a literal text before and one after (tool-call
  /// formats: the call's markers around its JSON). `where` prefixes error messages.
  struct Wrapped {
    std::string before;
    Json schema;
    std::string after;
    std::string where;
  };
  static Result<std::shared_ptr<const Grammar>> one_of(const std::vector<Wrapped>& alternatives);

  struct Impl;
  explicit Grammar(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const Impl& impl() const { return *impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

/// The vocabulary as the mask sees it: every id's bytes in a trie. Ids with no bytes
/// (special tokens, unused ids) are never allowed except the end ids.
class TokenTrie {
 public:
  /// bytes[id]: what the token adds to the text; end_ids: the ids that end the output.
  TokenTrie(const std::vector<std::string>& bytes, std::vector<int32_t> end_ids);
  int vocab() const { return vocab_; }
  const std::vector<int32_t>& end_ids() const { return end_ids_; }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

  struct Node {
    uint8_t byte = 0;
    // Every id below has, from this node's byte on, text a JSON string takes whole (valid
    // UTF-8, no quote, backslash or control character).
    bool text = false;
    int32_t lo = 0, own = 0, hi = 0;  // sorted ids: [lo, own) end here, [lo, hi) below
    int32_t kids = 0;                 // its entry in the child lists
  };
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<int32_t>& children(int32_t node) const {
    return child_lists_[static_cast<size_t>(nodes_[static_cast<size_t>(node)].kids)];
  }
  const std::vector<int32_t>& sorted() const { return sorted_; }

 private:
  int32_t build(int32_t lo, int32_t hi, size_t depth);
  int vocab_ = 0;
  std::vector<std::string> bytes_;
  std::vector<int32_t> end_ids_;
  std::vector<int32_t> sorted_;  // ids with bytes, by their bytes
  std::vector<Node> nodes_;      // [0] is the root
  std::vector<std::vector<int32_t>> child_lists_;
};

/// Grammar and vocabulary together: what a request hands to its sequences.
struct Constraint {
  std::shared_ptr<const Grammar> grammar;
  std::shared_ptr<const TokenTrie> trie;
  /// Delayed start: the grammar applies once the output's bytes (the trie's) end with these;
  /// until then every token but the end ids is allowed (a reasoning model's free thinking
  /// before the constrained answer: gpt-oss's analysis channel). Empty: from the first token.
  std::string gate = {};
  /// Ids that end generation whatever the grammar says (the model's stop ids): never allowed
  /// before the gate, so the output cannot end before its constrained part.
  std::vector<int32_t> stops = {};
  /// With a gate: the free part is optional and opens with these bytes. The output either
  /// starts with the grammar or with `opening`, free text and the gate, then the grammar
  /// (gpt-oss may reason before a forced call). Empty: free from the first token.
  std::string opening = {};
};

/// One sequence's position in its grammar.
class Matcher {
 public:
  explicit Matcher(Constraint c);
  ~Matcher();
  Matcher(Matcher&&) noexcept;
  Matcher& operator=(Matcher&&) noexcept;

  /// The tokens the grammar allows next, as a bitset of (vocab + 31) / 32 words (bit i of
  /// word i / 32 is id i). Returns how many ids are allowed. When the grammar is stuck
  /// (no token of this vocabulary continues it) only the end ids are allowed. Before the
  /// gate (Constraint::gate) has passed: every id but the end ids.
  int fill_mask(uint32_t* words) const;
  /// Advances by a token (an end id: accepted when the value is complete). False, and the
  /// state unchanged, when the grammar does not allow it.
  bool accept(int32_t token);
  /// Advances by raw bytes (tests); false when they are not allowed (state unchanged).
  bool accept_bytes(std::string_view bytes);
  /// The value is complete (end-of-sequence allowed).
  bool can_end() const;
  /// Nothing but the end may follow.
  bool must_end() const;
  /// The matcher has ended (an end id was accepted).
  bool ended() const { return ended_; }
  /// The gate has not passed yet: the output is still free.
  bool gated() const;

  struct State;

 private:
  Constraint c_;
  std::unique_ptr<State> st_;
  bool ended_ = false;
};

}  // namespace spark::grammar
