#include "daemon/engine/block_manager.h"

#include <xxhash.h>

#include <algorithm>

namespace spark::engine {

BlockManager::BlockManager(int num_blocks, int block_size, bool prefix_caching)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(prefix_caching),
      refs_(static_cast<size_t>(num_blocks), 0),
      entries_(static_cast<size_t>(num_blocks)),
      lru_pos_(static_cast<size_t>(num_blocks)),
      in_lru_(static_cast<size_t>(num_blocks), false) {
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int BlockManager::available() const {
  return static_cast<int>(free_.size() + lru_.size());
}
int BlockManager::in_use() const {
  return num_blocks_ - available();
}

void BlockManager::evict_one() {
  const int32_t b = lru_.front();
  lru_.pop_front();
  in_lru_[static_cast<size_t>(b)] = false;
  auto& e = entries_[static_cast<size_t>(b)];
  auto it = cached_.find(e.hash);
  if (it != cached_.end() && it->second == b) cached_.erase(it);
  e = Entry{};
  free_.push_back(b);
}

bool BlockManager::allocate(int n, std::vector<int32_t>* out) {
  if (n > available()) return false;
  for (int i = 0; i < n; ++i) {
    if (free_.empty()) evict_one();
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(b)] = 1;
    out->push_back(b);
  }
  return true;
}

uint64_t BlockManager::block_hash(const std::vector<int32_t>& tokens, int index,
                                  uint64_t prev) const {
  return XXH64(tokens.data() + static_cast<size_t>(index) * static_cast<size_t>(block_size_),
               static_cast<size_t>(block_size_) * sizeof(int32_t), prev);
}

int BlockManager::match_prefix(const std::vector<int32_t>& tokens, int max_blocks,
                               std::vector<int32_t>* out, std::vector<uint64_t>* hashes) {
  if (!prefix_caching_) return 0;
  const int full = std::min(max_blocks, static_cast<int>(tokens.size()) / block_size_);
  uint64_t prev = 0;
  int matched = 0;
  for (int i = 0; i < full; ++i) {
    const uint64_t h = block_hash(tokens, i, prev);
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    const int32_t b = it->second;
    const auto& e = entries_[static_cast<size_t>(b)];
    if (!std::equal(e.tokens.begin(), e.tokens.end(),
                    tokens.begin() + static_cast<ptrdiff_t>(i) * block_size_))
      break;
    if (refs_[static_cast<size_t>(b)]++ == 0 && in_lru_[static_cast<size_t>(b)]) {
      lru_.erase(lru_pos_[static_cast<size_t>(b)]);
      in_lru_[static_cast<size_t>(b)] = false;
    }
    out->push_back(b);
    hashes->push_back(h);
    prev = h;
    ++matched;
  }
  return matched;
}

void BlockManager::register_block(int32_t block, uint64_t hash, const std::vector<int32_t>& tokens,
                                  int index) {
  if (!prefix_caching_ || cached_.count(hash)) return;
  auto& e = entries_[static_cast<size_t>(block)];
  if (e.registered) return;
  e.hash = hash;
  e.registered = true;
  const auto first = tokens.begin() + static_cast<ptrdiff_t>(index) * block_size_;
  e.tokens.assign(first, first + block_size_);
  cached_[hash] = block;
}

void BlockManager::release(const std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) {
    auto& r = refs_[static_cast<size_t>(b)];
    if (r <= 0) continue;  // defensive: never underflow
    if (--r == 0) {
      if (entries_[static_cast<size_t>(b)].registered) {
        lru_pos_[static_cast<size_t>(b)] = lru_.insert(lru_.end(), b);
        in_lru_[static_cast<size_t>(b)] = true;
      } else {
        free_.push_back(b);
      }
    }
  }
}

}  // namespace spark::engine
