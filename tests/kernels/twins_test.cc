// The CPU twins of the engine's kernels (these run everywhere): the Philox generator
// against the published known-answer vectors, the sampler's definition, and the small
// ops' contracts (rounding points, out-of-range ids, skipped slots, argument checks).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "kernels/embedding.h"
#include "kernels/matmul.h"
#include "kernels/paged_attention.h"
#include "kernels/philox.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/sampler_core.h"
#include "support/gpu.h"
#include "support/sampler_cases.h"

using namespace spark;
using namespace spark::kernels;
using spark::test::kSampleMixCount;
using spark::test::kSampleRowKindCount;
using spark::test::kSampleRowKinds;
using spark::test::sample_mix;
using spark::test::sample_row;

TEST_CASE("philox4x32-10 matches the Random123 known-answer vectors") {
  auto check = [](Philox4 ctr, uint32_t k0, uint32_t k1, Philox4 want) {
    Philox4 got = philox4x32_10(ctr, k0, k1);
    for (int i = 0; i < 4; ++i) CHECK(got.v[i] == want.v[i]);
  };
  check({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  check({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
        {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  check({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
        {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST_CASE("philox_uniform is inside (0, 1), depends on every key part, and is uniform") {
  double sum = 0;
  for (uint32_t i = 0; i < 20000; ++i) {
    const double u = philox_uniform(42, 7, 3, i);
    REQUIRE(u > 0);
    REQUIRE(u < 1);
    sum += u;
  }
  CHECK(sum / 20000 == doctest::Approx(0.5).epsilon(0.02));
  const double base = philox_uniform(1, 2, 3, 4);
  CHECK(philox_uniform(2, 2, 3, 4) != base);
  CHECK(philox_uniform(1, 3, 3, 4) != base);
  CHECK(philox_uniform(1, 2, 4, 4) != base);
  CHECK(philox_uniform(1, 2, 3, 5) != base);
  CHECK(philox_uniform(1, 2ull << 32, 3, 4) != philox_uniform(1, 2, 3, 4));  // request's high half
}

TEST_CASE("sample_ref: greedy, top-k ties, top-p floor, min-p, and the Gumbel draw's frequencies") {
  SampleParams p;
  p.temperature = 0;
  std::vector<float> l = {0.5f, 3.f, 3.f, -1.f};
  CHECK(sample_ref(l.data(), 4, p, nullptr, nullptr).token == 1);  // lowest id of the max
  // top_k = 1 with a tie at the floor keeps both tied tokens (all values >= the k-th).
  p.temperature = 1;
  p.top_k = 1;
  std::map<int, int> seen;
  for (uint32_t step = 0; step < 400; ++step) {
    p.step = step;
    ++seen[sample_ref(l.data(), 4, p, nullptr, nullptr).token];
  }
  CHECK(seen.size() == 2);
  CHECK(seen[1] > 150);
  CHECK(seen[2] > 150);
  // Frequencies follow the softmax: probabilities 0.5, 0.3, 0.2.
  std::vector<float> m = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  p = {};
  std::map<int, int> h;
  const int n = 30000;
  for (uint32_t step = 0; step < n; ++step) {
    p.step = step;
    ++h[sample_ref(m.data(), 3, p, nullptr, nullptr).token];
  }
  CHECK(h[0] / double(n) == doctest::Approx(0.5).epsilon(0.03));
  CHECK(h[1] / double(n) == doctest::Approx(0.3).epsilon(0.04));
  CHECK(h[2] / double(n) == doctest::Approx(0.2).epsilon(0.05));
  // top_p 0.75: 0.5 < 0.75 <= 0.8, so tokens 0 and 1.
  p.top_p = 0.75f;
  h.clear();
  for (uint32_t step = 0; step < 2000; ++step) {
    p.step = step;
    ++h[sample_ref(m.data(), 3, p, nullptr, nullptr).token];
  }
  CHECK(h.size() == 2);
  CHECK(h.count(2) == 0);
  // min_p 0.5: p >= 0.25 (0.5 and 0.3).
  p.top_p = 1, p.min_p = 0.5f;
  h.clear();
  for (uint32_t step = 0; step < 2000; ++step) {
    p.step = step;
    ++h[sample_ref(m.data(), 3, p, nullptr, nullptr).token];
  }
  CHECK(h.size() == 2);
}

TEST_CASE("sample_ref: penalties, logprobs and top alternatives") {
  std::vector<float> l = {2.f, 1.9f, -3.f};
  std::vector<uint8_t> seen = {1, 0, 0};
  std::vector<int32_t> counts = {0, 2, 0};
  SampleParams p;
  p.temperature = 0;
  p.repetition_penalty = 1.1f;  // 2 / 1.1 = 1.82 < 1.9
  CHECK(sample_ref(l.data(), 3, p, seen.data(), counts.data()).token == 1);
  p.frequency_penalty = 0.1f;  // 1.9 - 0.2 = 1.7 < 1.82
  CHECK(sample_ref(l.data(), 3, p, seen.data(), counts.data()).token == 0);
  p = {};
  p.temperature = 0;
  p.top_logprobs = 2;
  auto r = sample_ref(l.data(), 3, p, nullptr, nullptr);
  const double lse = std::log(std::exp(2.0) + std::exp(1.9) + std::exp(-3.0));
  CHECK(r.logprob == doctest::Approx(2.0 - lse).epsilon(1e-6));
  REQUIRE(r.n_top == 2);
  CHECK(r.top_ids[0] == 0);
  CHECK(r.top_ids[1] == 1);
  CHECK(r.top_logprobs[1] == doctest::Approx(1.9 - lse).epsilon(1e-5));
  sample_state_update_ref(seen.data(), counts.data(), 2);
  CHECK(seen[2] == 1);
  CHECK(counts[2] == 1);
  CHECK(sample_check_params(p, 3).ok());
  p.top_logprobs = 21;
  CHECK(sample_check_params(p, 3).message().find("top_logprobs") != std::string::npos);
}

TEST_CASE("sample_ref: integer masses are floor(2^32 exp(d)), exact at the top, 0 far below") {
  CHECK(sample_mass_q(3.f, 3.f) == kSampleMassOne);
  CHECK(sample_mass_q(INFINITY, INFINITY) == kSampleMassOne);
  CHECK(sample_mass_q(-INFINITY, -INFINITY) == kSampleMassOne);
  CHECK(sample_mass_q(-INFINITY, 0.f) == 0);
  CHECK(sample_mass_q(NAN, 0.f) == 0);
  CHECK(sample_mass_q(-23.5f, 0.f) == 0);
  uint64_t prev = kSampleMassOne;
  int off = 0;
  for (int i = 1; i < 230000; ++i) {
    const float d = -static_cast<float>(i) * 1e-4f;
    const uint64_t m = sample_mass_q(d, 0.f);
    const long double want = std::floor(std::ldexp(std::exp(static_cast<long double>(d)), 32));
    const long double diff = static_cast<long double>(m) - want;
    off += diff != 0;
    REQUIRE(std::fabs(static_cast<double>(diff)) <= 1);
    REQUIRE(m <= prev);  // non-increasing as z falls, on this sweep
    prev = m;
  }
  MESSAGE(off << " of 229999 masses differ from floor(2^32 exp(d)) in long double by one");
  // Bins: 16 per nat, the top value alone decides bin 0, far and -inf in the last.
  CHECK(sample_bin(5.f, 5.f) == 0);
  CHECK(sample_bin(5.f - 1.f / 32, 5.f) == 0);
  CHECK(sample_bin(4.f, 5.f) == 16);
  CHECK(sample_bin(-INFINITY, 5.f) == kSampleBins - 1);
  CHECK(sample_bin(-40.f, 5.f) == kSampleBins - 1);
  CHECK(sample_bin(INFINITY, INFINITY) == 0);
  CHECK(sample_bin(1.f, INFINITY) == kSampleBins - 1);
}

TEST_CASE("sample_ref: sample_log is log to a few ulps, also for u next to 1") {
  std::mt19937_64 rng(5);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    // Uniforms as the sampler draws them, their -log, and a wide log-uniform sweep.
    const double u = (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53;
    const double xs[] = {
        u, -std::log(u),
        std::exp(static_cast<double>(static_cast<int64_t>(rng() % 1400)) / 10 - 70), 1 - u * 1e-12};
    for (double x : xs) {
      const double want = std::log(x), got = sample_log(x);
      const double err = std::fabs(got - want) / std::max(std::fabs(want), 1e-300);
      worst = std::max(worst, want == 0 ? std::fabs(got) : err);
    }
  }
  MESSAGE("sample_log: worst relative error against libm " << worst);
  CHECK(worst < 1e-15);
  CHECK(sample_log(1.0) == 0.0);
  CHECK(sample_log(2.0) == doctest::Approx(std::log(2.0)).epsilon(1e-16));
}

TEST_CASE("sample_ref: top-p on integer masses, summed in any order") {
  // Two tokens of exactly half the mass each: top_p 0.5 keeps the first alone, and the
  // decision holds whichever way the masses are added.
  std::vector<float> l = {0.f, 0.f, -30.f};
  SampleParams p;
  p.top_p = 0.5f;
  std::map<int, int> h;
  for (uint32_t step = 0; step < 400; ++step) {
    p.step = step;
    ++h[sample_ref(l.data(), 3, p, nullptr, nullptr).token];
  }
  // Both tied values are >= the floor 0: ties at the floor are kept, never token 2.
  CHECK(h.size() == 2);
  CHECK(h.count(2) == 0);
  // min-p against the integer mass: exp(-1) = 0.3679 < 0.37 drops token 1, 0.36 keeps it.
  std::vector<float> m = {1.f, 0.f};
  p = {};
  p.min_p = 0.37f;
  h.clear();
  for (uint32_t step = 0; step < 400; ++step)
    p.step = step, ++h[sample_ref(m.data(), 2, p, nullptr, nullptr).token];
  CHECK(h.size() == 1);
  p.min_p = 0.36f;
  h.clear();
  for (uint32_t step = 0; step < 400; ++step)
    p.step = step, ++h[sample_ref(m.data(), 2, p, nullptr, nullptr).token];
  CHECK(h.size() == 2);
}

TEST_CASE("sample_prefilter: the device's staged decomposition gives the definition's draw") {
  // Every row kind, vocabularies that are multiples of nothing, every parameter mix; the
  // staged path (histogram plan, candidates, floors over the sorted candidates) must give
  // sample_ref's token and alternatives. The coverage counters make sure each branch of
  // the plan ran: candidate sets past the device's sort capacity (its radix fallback),
  // tokens kept whole above the top-p bin, and rows where the filter cut the row down.
  std::mt19937 rng(test::fresh_seed("sample_prefilter"));
  size_t over_cap = 0, sure_rows = 0, filtered = 0, rows = 0, raw_filtered = 0;
  for (int V : {1, 2, 7, 1000, 4099, 9973}) {
    for (int kind = 0; kind < kSampleRowKindCount; ++kind) {
      auto l = sample_row(rng, V, kind);
      std::vector<uint8_t> seen(static_cast<size_t>(V), 0);
      std::vector<int32_t> counts(static_cast<size_t>(V), 0);
      std::uniform_int_distribution<int> tok(0, V - 1);
      for (int i = 0; i < 12; ++i) {
        const auto t = static_cast<size_t>(tok(rng));
        seen[t] = 1;
        counts[t] += i % 3;
      }
      const int mixes = V > 4000 ? 30 : 90;
      for (int mi = 0; mi < mixes; ++mi) {
        const int i =
            static_cast<int>((static_cast<unsigned>(mi) * 97u + static_cast<unsigned>(kind)) %
                             static_cast<unsigned>(kSampleMixCount));
        const SampleParams p = sample_mix(i, V, rng());
        CAPTURE(V);
        CAPTURE(kSampleRowKinds[kind]);
        CAPTURE(i);
        SamplePrefilterStats st;
        const auto want = sample_ref(l.data(), V, p, seen.data(), counts.data());
        const auto got = sample_prefilter_ref(l.data(), V, p, seen.data(), counts.data(), &st);
        ++rows;
        REQUIRE(got.token == want.token);
        REQUIRE(got.n_top == want.n_top);
        for (int t = 0; t < want.n_top; ++t) REQUIRE(got.top_ids[t] == want.top_ids[t]);
        if (p.temperature > 0 && (sample_has_k(p, V) || sample_has_p(p))) {
          over_cap += st.candidates > 2048;
          sure_rows += st.sure > 0 && st.candidates > 0;
          filtered += st.candidates + st.sure < static_cast<size_t>(V) / 2;
        }
        raw_filtered += p.top_logprobs > 0 && st.raw_candidates < static_cast<size_t>(V) / 2;
      }
    }
  }
  MESSAGE(rows << " rows; candidates past 2048: " << over_cap << ", sure bins and candidates: "
               << sure_rows << ", filtered to < half: " << filtered
               << ", top alternatives filtered: " << raw_filtered);
  CHECK(over_cap > 0);
  CHECK(sure_rows > 0);
  CHECK(filtered > rows / 10);
  CHECK(raw_filtered > 0);
}

TEST_CASE("sample_ref state: built from a token list, as the host sampler records it") {
  // The state a sequence's list gives at once equals the prompt marked seen, then each
  // output token recorded in turn (sample_state_update_ref), for every split point.
  const int V = 50;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(-3, V + 2);  // some ids outside the vocabulary
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int32_t> list(static_cast<size_t>(trial % 17 + 1));
    for (auto& t : list) t = tok(rng);
    for (int out_start = 0; out_start <= static_cast<int>(list.size()); ++out_start) {
      std::vector<uint8_t> seen(V, 7), seen_ref(V, 0);
      std::vector<int32_t> counts(V, 7), counts_ref(V, 0);
      sample_state_build_ref(seen.data(), counts.data(), V, list.data(),
                             static_cast<int>(list.size()), out_start);
      for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        const int32_t t = list[static_cast<size_t>(i)];
        if (t < 0 || t >= V) continue;
        if (i < out_start)
          seen_ref[static_cast<size_t>(t)] = 1;
        else
          sample_state_update_ref(seen_ref.data(), counts_ref.data(), t);
      }
      CHECK(seen == seen_ref);
      CHECK(counts == counts_ref);
    }
  }
}

TEST_CASE("twins: embedding zeros for bad ids, add_rmsnorm rounds the sum, KV slots < 0 skipped") {
  std::vector<float> table = {1, 2, 3, 4, 5, 6};
  std::vector<int32_t> ids = {2, -1, 0, 3};
  std::vector<float> out(8, 9.f);
  embedding_ref(table.data(), 3, 2, ids.data(), 4, out.data());
  CHECK(out == std::vector<float>{5, 6, 0, 0, 1, 2, 0, 0});
  CHECK(embedding_check_args(table.data(), 3, 0, ids.data(), 1, out.data()).code() == Errc::usage);

  // bf16: 1 + 2^-9 rounds back to 1 before the norm.
  std::vector<float> h = {1.f, 1.f}, d = {0x1p-9f, 0.f}, w = {1.f, 1.f}, y(2);
  add_rmsnorm_ref(h.data(), d.data(), w.data(), y.data(), 1, 2, 0.f, DType::bf16);
  CHECK(h[0] == 1.f);
  CHECK(y[0] == 1.f);
  h = {1.f, 1.f};
  add_rmsnorm_ref(h.data(), d.data(), w.data(), y.data(), 1, 2, 0.f, DType::f32);
  CHECK(h[0] == 1.f + 0x1p-9f);

  std::vector<float> kp(2 * 2 * 2, -1.f), vp(kp.size(), -1.f);  // 2 blocks of 2 slots, row 2
  PagedKVLayer L{kp.data(), vp.data(), 2, 1, 2};
  std::vector<int32_t> slots = {3, -1};
  std::vector<float> k = {1.f, 2.f, 9.f, 9.f}, v = {3.f, 4.f, 9.f, 9.f};
  paged_kv_write_slots_ref(L, slots.data(), 2, k.data(), 2, v.data(), 2, DType::f32);
  CHECK(kp == std::vector<float>{-1, -1, -1, -1, -1, -1, 1, 2});
  CHECK(vp[6] == 3.f);
}

// The automatic backend's rule is the shape's alone, the same in every build (a build
// without CUDA reports it too): the own kernel at 1-2 rows, and up to 4096 x 14336 up to 8
// rows; cuBLASLt elsewhere.
TEST_CASE("matmul: the automatic backend as measured: own at 1-2 rows, up to 64 Mi weights at 8") {
  CHECK(Matmul::choose(1, 4096, 4096) == MatmulBackend::own);
  CHECK(Matmul::choose(8, 4096, 4096) == MatmulBackend::own);
  CHECK(Matmul::choose(8, 1024, 4096) == MatmulBackend::own);
  CHECK(Matmul::choose(8, 4096, 14336) == MatmulBackend::own);
  CHECK(Matmul::choose(9, 4096, 14336) == MatmulBackend::cublaslt);
  CHECK(Matmul::choose(8, 128256, 4096) == MatmulBackend::cublaslt);
  CHECK(Matmul::choose(32, 4096, 4096) == MatmulBackend::cublaslt);
  CHECK(Matmul::choose(1, 28672, 4096) == MatmulBackend::own);
  CHECK(Matmul::choose(4, 28672, 4096) == MatmulBackend::cublaslt);
  CHECK(Matmul::choose(1024, 4096, 4096) == MatmulBackend::cublaslt);
}

TEST_CASE("twins: attention and matmul argument checks name what is wrong") {
  AttentionBatch b;
  b.kv.head_dim = 20;
  b.kv.n_kv_heads = 1;
  b.n_heads = 2;
  b.n_seqs = 1;
  CHECK(attention_check_args(b, true).message().find("head_dim 20") != std::string::npos);
  b.kv.head_dim = 128;
  b.n_heads = 3;
  b.kv.n_kv_heads = 2;
  CHECK(attention_check_args(b, false).message().find("multiple of n_kv_heads") !=
        std::string::npos);
  CHECK(attention_decode_splits(1) == 1);
  CHECK(attention_decode_splits(kDecodePartition + 1) == 2);
  CHECK(attention_decode_partitioned_workspace_bytes(2, 4, 128, kDecodePartition) == 0);
  CHECK(attention_decode_partitioned_workspace_bytes(2, 4, 128, 3 * kDecodePartition) ==
        2 * 4 * 3 * 130 * 4);
  // Split-K: 64 counters (rounded up), then 2 x 4 (sequence, head) pairs x 3 slots (a
  // 3 x 64-position bound) x (128 + 2) floats.
  CHECK(attention_decode_workspace_bytes(2, 4, 128, 3 * kDecodeMinChunk) ==
        64 * 4 + 2 * 4 * 3 * 130 * 4);
  b.n_heads = 4;
  b.max_seq_len = 100, b.max_blocks_per_seq = 7, b.kv.block_size = 16, b.scale = 1;
  b.q = b.out = b.kv.k = b.kv.v = &b;
  b.block_tables = b.seq_lens = &b.kv.block_size;
  b.q_stride = b.out_stride = 4 * 128;
  CHECK(attention_check_args(b, true).message().find("workspace of 0 bytes") != std::string::npos);
  CHECK(attention_check_args(b, true, 0).ok());  // a kernel that needs none

  MatmulArgs a;
  a.m = 1, a.n = 4, a.k = 8, a.lda = 4;
  int dummy = 0;
  a.a = &dummy, a.w = &dummy, a.out = &dummy, a.ldw = 8, a.ldo = 4;
  CHECK(matmul_check_args(a).message().find("lda 4") != std::string::npos);
  std::vector<float> x = {1, 2}, wt = {3, 4, 5, 6}, o = {10, 20}, bias = {1, -1};
  matmul_ref(x.data(), wt.data(), o.data(), 1, 2, 2, bias.data(), true, DType::f32);
  CHECK(o == std::vector<float>{10 + 11 + 1, 20 + 17 - 1});
  // The product over a normalised row: rows [3, 4] (rms 3.5355) and [0, 2] (rms sqrt 2),
  // norm weights [2, 0.5], eps 0: the inputs [1.697, 0.566] and [0, 0.707].
  std::vector<float> xr = {3, 4, 0, 2}, nw = {2, 0.5f}, on(4, 0.f);
  matmul_norm_ref(xr.data(), nw.data(), 0.f, wt.data(), on.data(), 2, 2, 2, nullptr, false,
                  DType::f32);
  const double r0 = 1 / std::sqrt(12.5), r1 = 1 / std::sqrt(2.0);
  CHECK(on[0] == doctest::Approx(3 * 2 * r0 * 3 + 4 * 0.5 * r0 * 4).epsilon(1e-6));
  CHECK(on[1] == doctest::Approx(3 * 2 * r0 * 5 + 4 * 0.5 * r0 * 6).epsilon(1e-6));
  CHECK(on[2] == doctest::Approx(2 * 0.5 * r1 * 4).epsilon(1e-6));
  CHECK(on[3] == doctest::Approx(2 * 0.5 * r1 * 6).epsilon(1e-6));
  a.lda = 8, a.norm_w = &dummy, a.m = 5;
  CHECK(matmul_check_args(a).message().find("at most 4 rows") != std::string::npos);
  a.m = 1, a.norm_eps = NAN;
  CHECK(matmul_check_args(a).message().find("norm eps") != std::string::npos);
  // Folding a norm's weight into the product's: each weight times its column's norm weight,
  // rounded to bf16 once (1.5 * 1.25 = 1.875 exactly; 1.0078125 * 3 = 3.0234375, halfway
  // between 3.015625 and 3.03125: to the even one).
  std::vector<bf16_bits> fw = {float_to_bf16(1.5f), float_to_bf16(1.0078125f), float_to_bf16(-2.0f),
                               float_to_bf16(0.5f)},
                         fg = {float_to_bf16(1.25f), float_to_bf16(3.0f)};
  rmsnorm_fold_weight_ref(fw.data(), 2, 2, fg.data());
  CHECK(bf16_to_float(fw[0]) == 1.875f);
  CHECK(bf16_to_float(fw[1]) == 3.03125f);
  CHECK(bf16_to_float(fw[2]) == -2.5f);
  CHECK(bf16_to_float(fw[3]) == 1.5f);
  a.norm_eps = 1e-5f, a.norm_unit = true;  // a weight and "folded" at once
  CHECK(matmul_check_args(a).message().find("norm_w with norm_unit") != std::string::npos);
  a.norm_w = nullptr, a.m = 8;  // folded: up to 8 rows (the tensor-core form too)
  CHECK(matmul_check_args(a).ok());
  a.m = 9;
  CHECK(matmul_check_args(a).message().find("folded norm in the product takes at most 8 rows, "
                                            "not 9") != std::string::npos);
  a.m = 1;
  CHECK(matmul_check_args(a).ok());

  RopeArgs r;
  r.head_dim = 7;
  CHECK(rope_check_args(r).message().find("head_dim 7") != std::string::npos);
}

TEST_CASE("sample masks: excluded ids are never drawn; the staged decomposition agrees") {
  // Structured outputs' masks (one allowed id, a few, half the row) under every parameter
  // mix: the draw is an allowed id, and the device's decomposition (sample_prefilter_ref)
  // draws the same one. top_k at or above the allowed count is turned off first, as the
  // host sampler does.
  std::mt19937 rng(test::fresh_seed("sample_masks"));
  size_t rows = 0, changed = 0;
  for (int V : {7, 1000, 4099}) {
    for (int density : {0, 1, 50}) {
      std::vector<uint32_t> mask((static_cast<size_t>(V) + 31) / 32, 0u);
      int allowed = 0;
      for (int i = 0; i < V; ++i)
        if (density == 0 ? i == V / 2 : static_cast<int>(rng() % 100) < density)
          mask[static_cast<size_t>(i) >> 5] |= 1u << (i & 31), ++allowed;
      if (allowed == 0) mask[0] |= 1u, allowed = 1;
      for (int kind = 0; kind < kSampleRowKindCount; ++kind) {
        auto l = sample_row(rng, V, kind);
        for (int mi = 0; mi < 24; ++mi) {
          SampleParams p = sample_mix(mi % kSampleMixCount, V, rng());
          if (p.top_k >= allowed) p.top_k = 0;
          CAPTURE(V);
          CAPTURE(density);
          CAPTURE(kSampleRowKinds[kind]);
          CAPTURE(mi);
          const auto want = sample_ref(l.data(), V, p, nullptr, nullptr, mask.data());
          const auto free = sample_ref(l.data(), V, p, nullptr, nullptr);
          SamplePrefilterStats st;
          const auto got = sample_prefilter_ref(l.data(), V, p, nullptr, nullptr, &st, mask.data());
          REQUIRE(sample_allowed(mask.data(), want.token));
          REQUIRE(got.token == want.token);
          changed += free.token != want.token;
          ++rows;
        }
      }
    }
  }
  MESSAGE(rows << " masked rows; " << changed << " drew otherwise without the mask");
  CHECK(changed > rows / 4);
}
