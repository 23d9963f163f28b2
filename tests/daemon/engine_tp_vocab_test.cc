// Tensor parallel with a vocab-parallel lm_head on the CPU: W ranks as threads over Gloo
// give TP=1's logits at every position, for steps with several logit rows (the gather's
// reordering), tied and untied embeddings, and a vocabulary W does not divide (lm_head then
// stays replicated). The same recipe runs on CUDA in tests/hw/tp_cuda_test.cc.
#include <doctest/doctest.h>

#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/shard_plan.h"
#include "support/tempdir.h"
#include "support/tp_threads.h"

using namespace spark;
using namespace spark::engine;

namespace {

std::vector<test::TpSeq> two_seqs() {
  return {{{1, 17, 99, 250, 3, 77, 410, 12, 5, 300, 301, 17}, 7},
          {{1, 9, 8, 7, 6, 5, 4, 3, 2, 100, 200}, 4}};
}

Result<std::shared_ptr<Device>> cpu(int) {
  return make_cpu_device();
}

}  // namespace

TEST_CASE(
    "engine TP: the lm_head is split by vocabulary rows; a vocabulary W does not divide "
    "stays replicated") {
  auto c = small_config(Family::llama, 512, 64, 2);
  for (int r = 0; r < 2; ++r) {
    auto p = make_shard_plan(c, r, 2, "test");
    REQUIRE(p.ok());
    CHECK(p->vocab_parallel);
    CHECK(p->vocab == 256);
    CHECK(p->vocab0 == 256 * r);
    bool found = false;
    for (const auto& rd : p->reads)
      if (rd.tensor == "lm_head.weight") {
        found = true;
        CHECK(rd.slice.row0 == 256 * r);
        CHECK(rd.rows == 256);
      }
    CHECK(found);
    for (const auto& d : p->dests)
      if (d.role == WeightRole::lm_head) CHECK(d.numel == 256u * 64u);
  }
  c.vocab_size = 511;
  auto odd = make_shard_plan(c, 1, 2, "test");
  REQUIRE(odd.ok());
  CHECK_FALSE(odd->vocab_parallel);
  CHECK(odd->vocab == 511);
  auto one = make_shard_plan(c, 0, 1, "test");
  REQUIRE(one.ok());
  CHECK_FALSE(one->vocab_parallel);
}

TEST_CASE(
    "engine TP: W ranks over Gloo give TP=1's logits at every position (vocab-parallel "
    "lm_head, two sequences per step)") {
  struct Case {
    const char* name;
    Family family;
    int vocab;
    bool tied;
  };
  for (const Case& k :
       {Case{"llama untied", Family::llama, 512, false},
        Case{"qwen2 tied", Family::qwen2, 512, true},
        Case{"mistral, vocab 511 (replicated lm_head)", Family::mistral, 511, false}}) {
    const std::string name = k.name;
    CAPTURE(name);
    test::TempDir dir;
    auto cfg = small_config(k.family, k.vocab, 64, 2);
    cfg.tie_word_embeddings = k.tied;
    REQUIRE(write_random_checkpoint(dir / "m", {cfg, DType::bf16, 5, 2}).ok());
    auto one = test::run_tp_threads(dir / "m", 1, two_seqs(), cpu);
    REQUIRE_MESSAGE(one.error.empty(), one.error);
    auto two = test::run_tp_threads(dir / "m", 2, two_seqs(), cpu);
    REQUIRE_MESSAGE(two.error.empty(), two.error);
    REQUIRE(one.logits.size() == 8);  // the prefill and seven decode steps (the longer one)
    CHECK(one.logits[0].size() == 2u * static_cast<size_t>(k.vocab));
    const double d = test::max_logit_diff(one, two);
    MESSAGE(std::string(k.name) << ": TP=2 vs TP=1 max |logit diff| " << d);
    // fp32 throughout; only the order of the partial sums differs.
    CHECK(d < 1e-4);
    // Each rank read less than the whole model (its slices, lm_head included when split).
    CHECK(two.bytes_read_rank0 < one.bytes_read_rank0);
  }
}
