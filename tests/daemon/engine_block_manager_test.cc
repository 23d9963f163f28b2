// Block manager: allocation all-or-nothing, refcounts, prefix registration and reuse, LRU
// eviction of unreferenced cached blocks.
#include <doctest/doctest.h>

#include "daemon/engine/block_manager.h"

using namespace spark::engine;

TEST_CASE("block manager: allocate is all or nothing; release returns blocks") {
  BlockManager bm(4, 2, true);
  std::vector<int32_t> a, b;
  REQUIRE(bm.allocate(3, &a));
  CHECK(bm.available() == 1);
  CHECK_FALSE(bm.allocate(2, &b));
  CHECK(b.empty());
  CHECK(bm.available() == 1);
  bm.release(a);
  CHECK(bm.available() == 4);
  CHECK(bm.in_use() == 0);
}

TEST_CASE("block manager: registered blocks are reused by matching prefixes and evicted LRU") {
  BlockManager bm(3, 2, true);
  const std::vector<int32_t> toks = {5, 6, 7, 8, 9};
  std::vector<int32_t> blocks;
  REQUIRE(bm.allocate(3, &blocks));
  uint64_t h0 = bm.block_hash(toks, 0, 0), h1 = bm.block_hash(toks, 1, h0);
  bm.register_block(blocks[0], h0, toks, 0);
  bm.register_block(blocks[1], h1, toks, 1);
  bm.release(blocks);  // cached, unreferenced: still available for allocation
  CHECK(bm.available() == 3);

  std::vector<int32_t> got;
  std::vector<uint64_t> hashes;
  CHECK(bm.match_prefix(toks, 2, &got, &hashes) == 2);
  CHECK(got == std::vector<int32_t>{blocks[0], blocks[1]});
  CHECK(bm.available() == 1);  // referenced again
  // A different second block matches only the first.
  std::vector<int32_t> other = {5, 6, 1, 2};
  std::vector<int32_t> got2;
  std::vector<uint64_t> h2;
  CHECK(bm.match_prefix(other, 2, &got2, &h2) == 1);
  bm.release(got2);
  bm.release(got);
  // Allocating everything evicts the cached blocks; afterwards nothing matches.
  std::vector<int32_t> all;
  REQUIRE(bm.allocate(3, &all));
  bm.release(all);
  std::vector<int32_t> none;
  std::vector<uint64_t> h3;
  CHECK(bm.match_prefix(toks, 2, &none, &h3) == 0);
}

TEST_CASE("block manager: a hash collision with different tokens is not served") {
  BlockManager bm(2, 2, true);
  std::vector<int32_t> blocks;
  REQUIRE(bm.allocate(1, &blocks));
  const std::vector<int32_t> a = {1, 2};
  // Register block 0 as holding {1, 2} but under the hash of {3, 4}: a forced collision.
  const std::vector<int32_t> b = {3, 4};
  bm.register_block(blocks[0], bm.block_hash(b, 0, 0), a, 0);
  std::vector<int32_t> got;
  std::vector<uint64_t> h;
  CHECK(bm.match_prefix(b, 1, &got, &h) == 0);
}
