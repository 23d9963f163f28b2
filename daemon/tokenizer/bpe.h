#pragma once
// The byte-pair-encoding model of a tokenizer.json: vocabulary, ranked merges and the
// merge loop (lowest rank first, leftmost first among equal ranks, as Hugging Face does).
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace spark::tok {

using TokenId = int32_t;

/// A loaded BPE model; tokenize() is const and thread-safe.
class BpeModel {
 public:
  /// Reads a tokenizer.json "model" object of type BPE: vocab, merges ("a b" strings or
  /// ["a","b"] pairs), unk_token, continuing_subword_prefix, end_of_word_suffix, fuse_unk,
  /// byte_fallback, ignore_merges. Errors name the offending merge or field.
  static Result<std::unique_ptr<BpeModel>> from_json(const nlohmann::json& model);

  /// Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<TokenId>& out) const;
  std::optional<TokenId> token_to_id(std::string_view token) const;
  /// The token string of id, or nullptr when the model has no such id.
  const std::string* id_to_token(TokenId id) const;
  /// Largest id in the vocabulary plus one.
  size_t id_limit() const { return vocab_r_.size(); }

 private:
  BpeModel() = default;
  void merge_word(std::string_view word, std::vector<TokenId>& out) const;

  struct Merge {
    uint32_t rank;
    TokenId new_id;
  };
  std::unordered_map<std::string, TokenId> vocab_;
  std::vector<std::string> vocab_r_;
  std::vector<bool> has_id_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<TokenId, 0x144> byte_char_id_{};  // fast path for single byte-level chars
  std::optional<std::string> unk_token_;
  std::string prefix_, suffix_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;

  // Word cache, like Hugging Face's (bounded, words shorter than 256 bytes).
  static constexpr size_t kShards = 16, kShardCapacity = 1024;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<TokenId>> map;
  };
  mutable std::array<Shard, kShards> cache_;
};

}  // namespace spark::tok
