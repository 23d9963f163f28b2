// The tensor-parallel shard plan: over all ranks, every element of every sliced tensor is
// read exactly once, replicated tensors are read whole by every rank, and each
// destination is filled completely by its reads.
#include <doctest/doctest.h>

#include <map>
#include <vector>

#include "daemon/engine/shard_plan.h"

using namespace spark::engine;

namespace {

ModelConfig cfg_for_plan() {
  ModelConfig c;
  c.architecture = "Qwen2ForCausalLM";
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.qkv_bias = true;
  c.mlp_bias = true;
  c.qk_norm = QkNorm::per_head;
  return c;
}

}  // namespace

TEST_CASE("shard plan: ranks cover each split tensor exactly once and fill their buffers") {
  const auto c = cfg_for_plan();
  for (int world : {1, 2}) {
    CAPTURE(world);
    std::map<std::string, std::vector<int>> hits;  // tensor -> per-element read count
    for (int rank = 0; rank < world; ++rank) {
      auto p = make_shard_plan(c, rank, world, "test");
      REQUIRE(p.ok());
      CHECK(p->heads == c.num_heads / world);
      std::map<std::pair<int, int>, size_t> filled;
      for (const auto& r : p->reads) {
        const int64_t R = r.shape[0];
        int64_t C = 1;
        for (size_t i = 1; i < r.shape.size(); ++i) C *= r.shape[i];
        auto& h = hits[r.tensor];
        h.resize(static_cast<size_t>(R * C));
        for (int64_t i = 0; i < r.rows; ++i)
          for (int64_t j = 0; j < r.cols; ++j)
            ++h[static_cast<size_t>((r.slice.row0 + i) * C + r.slice.col0 + j)];
        filled[{r.layer, static_cast<int>(r.role)}] += static_cast<size_t>(r.rows * r.cols);
      }
      for (const auto& d : p->dests) {
        CAPTURE(static_cast<int>(d.role));
        CHECK(filled[{d.layer, static_cast<int>(d.role)}] == d.numel);
      }
    }
    for (const auto& hit : hits) {
      const auto& name = hit.first;
      const auto& h = hit.second;
      CAPTURE(name);
      const bool replicated = name.find("norm") != std::string::npos ||
                              name.find("embed") != std::string::npos ||
                              name.find("down_proj.bias") != std::string::npos;
      const int want = replicated ? world : 1;  // lm_head: split by vocabulary rows
      int bad = 0;
      for (int n : h) bad += n != want;
      CHECK(bad == 0);
    }
    CHECK(hits.count("lm_head.weight") == 1);
    CHECK(hits.count("model.layers.1.mlp.up_proj.weight") == 1);
  }
  auto bad = make_shard_plan(c, 0, 3, "dir");
  REQUIRE(!bad.ok());
  CHECK(bad.error().message.find("must divide") != std::string::npos);
}
