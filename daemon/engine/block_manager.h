#pragma once
// Ownership of KV cache blocks: a free list, reference counts, and block-aligned prefix
// caching. A full block of tokens is registered under a hash of its tokens chained to its
// predecessor's hash; a later sequence whose prompt starts with the same full blocks reuses
// them (refcount + 1) instead of recomputing. Unreferenced registered blocks stay cached
// until they are needed again, then the least recently used one is evicted.
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace spark::engine {

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool prefix_caching);

  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  /// Blocks an allocate() could hand out now (free + evictable cached ones).
  int available() const;
  /// Blocks held by some sequence.
  int in_use() const;

  /// Hands out `n` blocks (refcount 1) into `out`, or returns false and changes nothing.
  bool allocate(int n, std::vector<int32_t>* out);
  /// Appends to `out` the cached blocks for the leading full blocks of `tokens` (at most
  /// `max_blocks`), taking a reference on each; returns how many. `hashes` receives their
  /// chain hashes.
  int match_prefix(const std::vector<int32_t>& tokens, int max_blocks, std::vector<int32_t>* out,
                   std::vector<uint64_t>* hashes);
  /// Chain hash of block `index` of `tokens` given the previous block's hash (0 for the first).
  uint64_t block_hash(const std::vector<int32_t>& tokens, int index, uint64_t prev) const;
  /// Registers a full block holding `tokens[index*bs, (index+1)*bs)` under `hash`. A block
  /// with that content already cached is left as it is.
  void register_block(int32_t block, uint64_t hash, const std::vector<int32_t>& tokens, int index);
  /// Drops one reference on each block.
  void release(const std::vector<int32_t>& blocks);

  /// Prefix-cache statistics: blocks reused by admitted sequences (the caller reports a
  /// match once it keeps it; a match given back because allocation failed does not count).
  void note_hits(int blocks) { hit_blocks_ += static_cast<uint64_t>(blocks); }
  uint64_t hit_blocks() const { return hit_blocks_; }

 private:
  struct Entry {
    uint64_t hash = 0;
    bool registered = false;
    std::vector<int32_t> tokens;  // content, to rule out hash collisions
  };
  void evict_one();

  int num_blocks_, block_size_;
  bool prefix_caching_;
  std::vector<int> refs_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;  // never registered or evicted
  std::list<int32_t> lru_;     // registered, refcount 0; front = oldest
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  std::vector<bool> in_lru_;
  std::unordered_map<uint64_t, int32_t> cached_;  // hash -> block
  uint64_t hit_blocks_ = 0;
};

}  // namespace spark::engine
