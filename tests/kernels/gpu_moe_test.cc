// The MoE kernels against their twins (kernels/moe.h) on fresh random inputs: the router over
// each scoring rule and size, and the expert products in both forms (decode and grouped) over
// shapes from the fixtures' to Qwen3-30B-A3B's and GLM-4.5-Air's, with shared experts,
// expert-parallel subsets and the residual add. Skips with a printed reason without a GPU.
//
// Bounds. Routing: the same expert ids wherever the twin's margin between the last chosen and
// the first unchosen expert exceeds 1e-5 (fp32 softmax/sigmoid against the twin's double; a
// row inside that margin is a near-tie, counted and printed, not compared); the weights
// within 2e-6 + 1e-5 relative. Expert products: the kernel sums fp32 products of bf16 values
// and rounds the activation to bf16 as the twin does, so an activation whose fp32 and double
// values fall on either side of a bf16 rounding boundary differs by one bf16 ulp; each output
// is allowed two bf16 ulps of itself plus 1% of the row's mean |output| for those flips.
//
// FP8 experts (e4m3 bytes with block scales of any float value): the decode form against the
// twin over the FP8 weights (widened exactly); the grouped form, whose weights are value x
// scale rounded to bf16 by design, against the twin over those bf16 weights. Same bounds.
//
// MXFP4 experts (e2m1 codes with power-of-two scales per 32 columns): both forms against the
// twin over the packed weights, whose widening is exact in fp32 and in bf16. Same bounds.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/moe.h"
#include "support/gpu.h"
#include "support/gpu_values.h"
#include "support/moe_fp8_weights.h"
#include "support/moe_mxfp4_weights.h"

using namespace spark;
using namespace spark::kernels;
using namespace spark::test::gpu;
using test::DeviceBuf;

TEST_CASE("gpu moe route: softmax and sigmoid, groups, bias and scaling: the twin's experts") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe route"));
  struct Case {
    int E, k;
    bool sigmoid, norm, bias;
    int groups, keep;
    float scale;
    size_t rows;
  } cases[] = {{8, 2, false, true, false, 1, 1, 1.f, 5},       // Mixtral
               {128, 8, false, true, false, 1, 1, 1.f, 300},   // Qwen3-30B-A3B
               {64, 8, false, false, false, 1, 1, 1.f, 17},    // no renormalisation
               {160, 8, true, true, true, 1, 1, 2.5f, 33},     // GLM-4.5-like, no groups
               {256, 8, true, true, true, 8, 4, 2.5f, 129},    // DeepSeek-V3 groups
               {64, 8, true, true, true, 8, 4, 2.5f, 64},      // the GLM fixture's shape
               {256, 8, true, true, true, 1, 1, 1.f, 8},       // MiniMax-M2
               {1024, 32, true, false, true, 16, 3, 1.f, 6}};  // the kernel's limits
  for (const auto& c : cases) {
    CAPTURE(c.E);
    CAPTURE(c.k);
    CAPTURE(c.groups);
    MoeRouteArgs a;
    a.experts = c.E, a.top_k = c.k, a.sigmoid = c.sigmoid, a.norm_topk = c.norm;
    a.n_group = c.groups, a.topk_group = c.keep, a.scaling = c.scale;
    auto lg = randoms(rng, c.rows * static_cast<size_t>(c.E), -4, 4);
    auto bias = randoms(rng, static_cast<size_t>(c.E), -0.2f, 0.2f);
    std::vector<int32_t> ids(c.rows * static_cast<size_t>(c.k));
    std::vector<float> w(ids.size()), margin(2 * c.rows);
    moe_route_ref(lg.data(), c.bias ? bias.data() : nullptr, a, c.rows, ids.data(), w.data(),
                  margin.data());
    auto dlg = DeviceBuf<float>::from(lg);
    auto dbias = DeviceBuf<float>::from(bias);
    auto dids = DeviceBuf<int32_t>::from(std::vector<int32_t>(ids.size(), -7));
    auto dw = DeviceBuf<float>::from(std::vector<float>(ids.size(), NAN));
    auto s = moe_route_cuda_device(dlg.get(), c.bias ? dbias.get() : nullptr, a, c.rows, dids.get(),
                                   dw.get(), nullptr);
    REQUIRE_MESSAGE(s.ok(), s.message());
    REQUIRE(cuda_synchronize().ok());
    auto gids = dids.host();
    auto gw = dw.host();
    size_t ties = 0, bad_ids = 0, bad_w = 0;
    for (size_t r = 0; r < c.rows; ++r) {
      if (margin[2 * r] - margin[2 * r + 1] < 1e-5) {
        ++ties;
        continue;
      }
      for (size_t j = 0; j < static_cast<size_t>(c.k); ++j) {
        const size_t i = r * static_cast<size_t>(c.k) + j;
        bad_ids += gids[i] != ids[i];
        bad_w += !(std::fabs(gw[i] - w[i]) <= 2e-6 + 1e-5 * std::fabs(w[i]));
      }
    }
    MESSAGE("route E " << c.E << " k " << c.k << ": " << ties << " near-tie rows of " << c.rows);
    CHECK(bad_ids == 0);
    CHECK(bad_w == 0);
  }
}

namespace {

struct ExpertsCase {
  int rows, top_k, hidden, inter, experts;
  int expert0, held;  // the rank's experts
  int shared;         // shared experts' intermediate (0: none)
  bool accumulate;
};

// What a run left: the workspace (zeroed before) and the kernels the launch says it ran.
struct Ran {
  std::vector<uint8_t> ws;
  int kernels = 0;
};

// Runs one case through `form` (1 decode, 2 grouped, 3 the tensor-core decode kernels where
// they apply, 0 automatic) and checks it against the twin; `ran`: what it left.
void check_experts(std::mt19937& rng, const ExpertsCase& c, int form, Ran* ran = nullptr) {
  CAPTURE(c.rows);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.experts);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  CAPTURE(form);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  const float ws = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  const float wd = 1.0f / std::sqrt(static_cast<float>(c.inter));
  auto x = as_stored(randoms(rng, R * H, -1, 1), DType::bf16);
  auto gu = as_stored(randoms(rng, E * 2 * I * H, -ws, ws), DType::bf16);
  auto dn = as_stored(randoms(rng, E * H * I, -wd, wd), DType::bf16);
  auto sgu = as_stored(randoms(rng, 2 * S * H, -ws, ws), DType::bf16);
  auto sdn = as_stored(randoms(rng, H * S, -1.f / std::sqrt(std::max<float>(1.f, S)),
                               1.f / std::sqrt(std::max<float>(1.f, S))),
                       DType::bf16);
  auto prior = as_stored(randoms(rng, R * H, -2, 2), DType::bf16);
  // Each row: top_k distinct experts of all `experts`, weights in (0, 1).
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.f);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  std::vector<float> ref = prior;
  MoeExpertsArgs h;
  h.x = x.data(), h.ids = ids.data(), h.weights = w.data(), h.rows = c.rows, h.top_k = c.top_k;
  h.hidden = c.hidden, h.gate_up = gu.data(), h.down = dn.data(), h.expert0 = c.expert0;
  h.experts = c.held, h.inter = c.inter, h.out = ref.data(), h.accumulate = c.accumulate;
  h.shared_inter = c.shared, h.shared_gate_up = sgu.data(), h.shared_down = sdn.data();
  moe_experts_ref(h);

  auto dx = to_dev(x, DType::bf16), dgu = to_dev(gu, DType::bf16), ddn = to_dev(dn, DType::bf16);
  auto dsgu = to_dev(sgu, DType::bf16), dsdn = to_dev(sdn, DType::bf16);
  Dev dout = c.accumulate ? to_dev(prior, DType::bf16) : poisoned(R * H, DType::bf16);
  auto dids = DeviceBuf<int32_t>::from(ids);
  auto dw = DeviceBuf<float>::from(w);
  const size_t ws_bytes =
      moe_experts_workspace_bytes(c.rows, c.top_k, c.hidden, c.inter, c.shared, c.held);
  auto dws = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(ws_bytes, 0));
  MoeExpertsArgs g = h;
  g.x = dx.get(), g.ids = dids.get(), g.weights = dw.get(), g.gate_up = dgu.get();
  g.down = ddn.get(), g.shared_gate_up = S ? dsgu.get() : nullptr;
  g.shared_down = S ? dsdn.get() : nullptr, g.out = dout.get();
  g.workspace = dws.get(), g.workspace_bytes = ws_bytes, g.form = form;
  auto s = moe_experts_cuda_device(g, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  auto got = from_dev(dout);
  if (ran) ran->ws = dws.host(), ran->kernels = moe_experts_kernels(g);
  std::vector<double> row_mean(R, 0.0);
  for (size_t r = 0; r < R; ++r) {
    for (size_t i = 0; i < H; ++i)
      row_mean[r] += std::fabs(ref[r * H + i] - (c.accumulate ? prior[r * H + i] : 0.f));
    row_mean[r] /= static_cast<double>(H);
  }
  double err = 0;
  auto bound = [&](size_t i) { return 2 * bf16_ulp(ref[i]) + 0.01 * row_mean[i / H] + 1e-6; };
  CHECK(outside(got, ref, bound, &err) == 0);
  MESSAGE("experts form " << form << " rows " << c.rows << " H " << c.hidden << " I " << c.inter
                          << " E " << c.held << "/" << c.experts << " shared " << c.shared
                          << ": max err " << err);
}

// Runs case c through the fp32 decode kernels (past 8 rows the grouped form), the
// tensor-core decode kernels (form 3) and the automatic form (0) on the same weights and
// rows. The kernels each form ran are the launch's own answer (moe_experts_kernels); the
// workspaces the kernels leave agree with it: the automatic form's is the tensor-core
// kernels' where `mma`, else the other's (past 8 rows: not the tensor-core kernels', the
// grouped form's atomics may place rows differently run to run). (The fp32 and tensor-core
// kernels may leave the same bf16 act bits, so their workspaces are told apart only where
// `distinct_ws`: MXFP4's, whose tensor-core act is fp16 in the mma's column order.)
// check(rng, c, form, ran) runs one form against the twin.
template <class Case, class Check>
void check_automatic_form(std::mt19937& rng, const Case& c, bool mma, bool distinct_ws,
                          Check check) {
  CAPTURE(c.rows);
  Ran other, tc, automatic;
  const std::mt19937 start = rng;  // the same weights and rows for each form
  std::mt19937 r1 = start, r3 = start, r0 = start;
  const bool decode_rows = c.rows <= kMoeDecodeMaxRows;
  check(r1, c, decode_rows ? 1 : 2, &other);
  check(r3, c, 3, &tc);
  check(r0, c, 0, &automatic);
  rng = r0;
  CHECK(other.kernels == (decode_rows ? 1 : 2));
  CHECK(tc.kernels == 3);
  CHECK(automatic.kernels == (mma ? 3 : decode_rows ? 1 : 2));
  if (distinct_ws) CHECK(other.ws != tc.ws);  // the launches followed those answers
  if (mma)
    CHECK(automatic.ws == tc.ws);
  else if (decode_rows)
    CHECK(automatic.ws == other.ws);
  else
    CHECK(automatic.ws != tc.ws);
}

}  // namespace

// The cases keep the models' widths (hidden, inter, top-k, shared inter) but hold fewer
// experts than the models (12-32 where they have 128): the random weights and the twin run
// on the CPU, several GB of them at the full counts, and the kernels' paths depend on the
// widths, the rows and the distinct experts a step chooses, not on the experts left unchosen.
TEST_CASE("gpu moe experts: the decode form against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe experts decode"));
  const ExpertsCase cases[] = {
      {1, 2, 64, 32, 8, 0, 8, 0, false},          // the fixture's smallest
      {1, 8, 2048, 768, 32, 0, 32, 0, true},      // Qwen3-30B-A3B, batch 1, into the residual
      {8, 8, 2048, 768, 32, 0, 32, 0, false},     // 8 streams
      {3, 4, 128, 64, 16, 4, 8, 64, false},       // half the experts (expert parallel), shared
      {8, 8, 4096, 1408, 12, 0, 12, 1408, true},  // GLM-4.5-Air, a shared expert
      {2, 8, 64, 32, 64, 0, 64, 32, false},       // the GLM fixture: 64 experts, top-8
      {5, 2, 64, 16, 8, 0, 8, 0, false},          // a TP=2 share of the fixture's experts
  };
  for (const auto& c : cases) check_experts(rng, c, 1);
}

// The tensor-core decode kernels over bf16 weights (form 3) from one row up to 32: Qwen3's
// widths and its TP=2 and TP=4 shares (inter 384, 192), a rank's slice of the experts, shared
// experts (GLM's, one more group every row, two passes at 24 rows), one to four column tiles,
// an expert chosen by more rows than a pass stages, a K of 10 blocks (odd halves per warp),
// and an inter of 16 (not whole 32-column blocks: the fp32 kernels run).
TEST_CASE("gpu moe experts: the tensor-core decode kernels over bf16 weights, 1 to 32 rows") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe experts bf16 mma"));
  const ExpertsCase cases[] = {
      {1, 8, 2048, 768, 32, 0, 16, 0, true},      // Qwen3-30B-A3B's widths, batch 1, residual
      {2, 8, 2048, 384, 64, 0, 64, 0, false},     // a TP=2 share, two rows
      {8, 8, 2048, 768, 32, 0, 32, 0, true},      // 8 streams
      {12, 8, 2048, 192, 64, 0, 64, 0, false},    // a TP=4 share, two column tiles
      {17, 4, 256, 96, 16, 4, 8, 0, false},       // three tiles, experts [4, 12) of 16
      {32, 8, 2048, 768, 32, 16, 16, 0, true},    // 32 streams: four tiles, a rank's half
      {32, 4, 512, 256, 8, 0, 8, 0, false},       // ~16 rows an expert: two passes
      {5, 8, 4096, 1408, 32, 8, 8, 1408, true},   // GLM-4.5-Air, a shared expert
      {24, 8, 1024, 256, 64, 0, 64, 512, false},  // shared experts, 24 rows
      {6, 4, 320, 96, 8, 0, 8, 0, false},         // a 10-block K
      {4, 2, 64, 32, 8, 0, 8, 0, false},          // the fixture's widths
      {5, 2, 64, 16, 8, 0, 8, 0, false},          // inter 16: the fp32 kernels
  };
  for (const auto& c : cases) check_experts(rng, c, 3);
}

// The automatic form (0) takes the tensor-core kernels over bf16 weights from 5 rows to 8 and
// the fp32 decode kernels below (up to 4 rows), the grouped form past 8. Which kernels ran is
// the launch's own answer, and the workspaces agree with it. (The fp32 and tensor-core
// kernels' activations, both bf16 by pair, are the same products summed in different orders:
// at one row their 3072 roundings came out all alike on an H200, so the workspaces alone do
// not tell those two apart.)
TEST_CASE("gpu moe experts: bf16 weights, the automatic form: mma from 5 rows to 8") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe experts bf16 automatic form"));
  const ExpertsCase cases[] = {
      {1, 8, 1024, 384, 32, 0, 32, 0, false},   // batch 1: fp32
      {4, 8, 1024, 384, 32, 0, 32, 0, false},   // four rows: fp32
      {5, 8, 1024, 384, 32, 0, 32, 0, false},   // five rows: mma
      {8, 8, 1024, 384, 32, 0, 32, 256, true},  // 8 rows, shared experts: mma
      {20, 8, 1024, 384, 32, 0, 32, 0, false},  // 20 rows: grouped
  };
  for (const auto& c : cases)
    check_automatic_form(rng, c, c.rows >= 5 && c.rows <= kMoeDecodeMaxRows, false,
                         [](std::mt19937& r, const ExpertsCase& e, int form, Ran* ran) {
                           check_experts(r, e, form, ran);
                         });
}

TEST_CASE("gpu moe experts: the grouped form (tokens sorted by expert) against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe experts grouped"));
  const ExpertsCase cases[] = {
      {1, 2, 64, 32, 8, 0, 8, 0, false},             // one row through the grouped path
      {37, 2, 64, 32, 8, 0, 8, 0, true},             // partial tiles everywhere
      {256, 8, 2048, 768, 32, 0, 32, 0, false},      // a prefill chunk of Qwen3-30B-A3B
      {200, 8, 256, 96, 64, 16, 16, 64, true},       // expert parallel, shared, K tail (96)
      {64, 4, 128, 40, 16, 0, 16, 0, false},         // inter 40: a K tail of 8 in down
      {130, 8, 4096, 1408, 16, 0, 16, 1408, false},  // GLM-4.5-Air prefill
  };
  for (const auto& c : cases) check_experts(rng, c, 2);
}

namespace {

struct Fp8ExpertsCase {
  int rows, top_k, hidden, inter, experts;
  int expert0, held;  // the rank's experts
  int shared;         // shared experts' intermediate (0: none)
  bool accumulate;
  int row_shift;
  bool shared_fp8;  // else bf16 shared experts
};

// Runs one case with FP8 experts through `form` (1 decode, 2 grouped, 3 the tensor-core decode
// kernels where they apply, 0 automatic) against the twin: over the FP8 weights where the
// kernels that ran read them (the decode and tensor-core kernels), over the grouped form's
// bf16 weights (value x scale rounded) where it ran; `ran`: what it left.
void check_fp8_experts(std::mt19937& rng, const Fp8ExpertsCase& c, int form, Ran* ran = nullptr) {
  CAPTURE(c.rows);
  CAPTURE(c.top_k);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  CAPTURE(c.row_shift);
  CAPTURE(c.shared_fp8);
  CAPTURE(form);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  const float ws = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  const float wd = 1.0f / std::sqrt(static_cast<float>(c.inter));
  const float wsd = 1.f / std::sqrt(std::max<float>(1.f, static_cast<float>(S)));
  auto x = as_stored(randoms(rng, R * H, -1, 1), DType::bf16);
  const auto gu = test::make_fp8(rng, E * 2 * I, H, c.row_shift, ws, false);
  const auto dn = test::make_fp8(rng, E * H, I, c.row_shift, wd, false);
  const auto sgu = test::make_fp8(rng, 2 * S, H, c.row_shift, ws, false);
  const auto sdn = test::make_fp8(rng, H, S, c.row_shift, wsd, false);
  // bf16 shared experts (when not FP8): the FP8 ones widened and rounded to bf16.
  const auto sgu_b = as_stored(sgu.widened(), DType::bf16);
  const auto sdn_b = as_stored(sdn.widened(), DType::bf16);
  auto prior = as_stored(randoms(rng, R * H, -2, 2), DType::bf16);
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.f);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  std::vector<float> ref = prior;

  auto dx = to_dev(x, DType::bf16);
  auto dgu = DeviceBuf<uint8_t>::from(gu.q), ddn = DeviceBuf<uint8_t>::from(dn.q);
  auto dsgu = DeviceBuf<uint8_t>::from(sgu.q), dsdn = DeviceBuf<uint8_t>::from(sdn.q);
  auto dgus = DeviceBuf<float>::from(gu.scales), ddns = DeviceBuf<float>::from(dn.scales);
  auto dsgus = DeviceBuf<float>::from(sgu.scales), dsdns = DeviceBuf<float>::from(sdn.scales);
  auto dsgu_b = to_dev(sgu_b, DType::bf16), dsdn_b = to_dev(sdn_b, DType::bf16);
  Dev dout = c.accumulate ? to_dev(prior, DType::bf16) : poisoned(R * H, DType::bf16);
  auto dids = DeviceBuf<int32_t>::from(ids);
  auto dw = DeviceBuf<float>::from(w);
  const size_t ws_bytes =
      moe_experts_workspace_bytes(c.rows, c.top_k, c.hidden, c.inter, c.shared, c.held);
  auto dws = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(ws_bytes, 0));
  auto on_dev = [](const test::Fp8Host& f, const DeviceBuf<uint8_t>& q,
                   const DeviceBuf<float>& sc) {
    Fp8Weight d = f.weight();
    d.q = q.get(), d.scales = sc.get();
    return d;
  };
  MoeExpertsArgs g;
  g.x = dx.get(), g.ids = dids.get(), g.weights = dw.get(), g.rows = c.rows, g.top_k = c.top_k;
  g.hidden = c.hidden, g.expert0 = c.expert0, g.experts = c.held, g.inter = c.inter;
  g.gate_up_fp8 = on_dev(gu, dgu, dgus), g.down_fp8 = on_dev(dn, ddn, ddns);
  g.shared_inter = c.shared, g.out = dout.get(), g.accumulate = c.accumulate;
  if (S && c.shared_fp8) {
    g.shared_gate_up_fp8 = on_dev(sgu, dsgu, dsgus), g.shared_down_fp8 = on_dev(sdn, dsdn, dsdns);
  } else if (S) {
    g.shared_gate_up = dsgu_b.get(), g.shared_down = dsdn_b.get();
  }
  g.workspace = dws.get(), g.workspace_bytes = ws_bytes, g.form = form;
  const int kernels = moe_experts_kernels(g);
  CHECK(kernels == (form == 1 ? 1 : form == 2 ? 2 : kernels));
  MoeExpertsArgs h;
  h.x = x.data(), h.ids = ids.data(), h.weights = w.data(), h.rows = c.rows, h.top_k = c.top_k;
  h.hidden = c.hidden, h.expert0 = c.expert0, h.experts = c.held, h.inter = c.inter;
  h.out = ref.data(), h.accumulate = c.accumulate, h.shared_inter = c.shared;
  if (c.shared_fp8) {
    h.shared_gate_up_fp8 = sgu.weight(), h.shared_down_fp8 = sdn.weight();
  } else {
    h.shared_gate_up = sgu_b.data(), h.shared_down = sdn_b.data();
  }
  // The grouped form's weights: value x scale rounded to bf16.
  const auto gu_b = as_stored(gu.widened(), DType::bf16);
  const auto dn_b = as_stored(dn.widened(), DType::bf16);
  if (kernels != 2) {
    h.gate_up_fp8 = gu.weight(), h.down_fp8 = dn.weight();
  } else {
    h.gate_up = gu_b.data(), h.down = dn_b.data();
    if (c.shared_fp8) {
      h.shared_gate_up_fp8 = h.shared_down_fp8 = Fp8Weight{};
      h.shared_gate_up = sgu_b.data(), h.shared_down = sdn_b.data();
    }
  }
  moe_experts_ref(h);
  auto s = moe_experts_cuda_device(g, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  auto got = from_dev(dout);
  if (ran) ran->ws = dws.host(), ran->kernels = kernels;
  std::vector<double> row_mean(R, 0.0);
  for (size_t r = 0; r < R; ++r) {
    for (size_t i = 0; i < H; ++i)
      row_mean[r] += std::fabs(ref[r * H + i] - (c.accumulate ? prior[r * H + i] : 0.f));
    row_mean[r] /= static_cast<double>(H);
  }
  double err = 0;
  auto bound = [&](size_t i) { return 2 * bf16_ulp(ref[i]) + 0.01 * row_mean[i / H] + 1e-6; };
  CHECK(outside(got, ref, bound, &err) == 0);
  MESSAGE("fp8 experts form " << form << " (kernels " << kernels << ") rows " << c.rows << " k "
                              << c.top_k << " H " << c.hidden << " I " << c.inter << " E " << c.held
                              << "/" << c.experts << " shared " << c.shared << " row_shift "
                              << c.row_shift << ": max err " << err);
}

}  // namespace

TEST_CASE("gpu moe fp8 experts: the decode form against the twin over the FP8 weights") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe fp8 experts decode"));
  const Fp8ExpertsCase cases[] = {
      {1, 2, 256, 128, 8, 0, 8, 0, false, 7, true},    // one row, 128 x 128 blocks
      {1, 8, 2048, 768, 16, 0, 16, 0, true, 7, true},  // a Qwen3-like row, into the residual
      // partial blocks, a scale row per row; rows not a multiple of 16 bytes (200, 72): the
      // 8-byte loops (the others take the 16-byte ones)
      {4, 8, 200, 72, 16, 0, 16, 72, true, 0, true},
      {4, 2, 256, 96, 8, 0, 8, 0, false, 7, true},       // experts straddle scale rows
      {8, 8, 512, 256, 64, 0, 64, 256, false, 7, true},  // 8 rows, FP8 shared experts
      {8, 2, 256, 128, 32, 8, 16, 128, true, 7, false},  // expert parallel, bf16 shared experts
  };
  for (const auto& c : cases) check_fp8_experts(rng, c, 1);
}

TEST_CASE("gpu moe fp8 experts: the grouped form against the twin over its bf16 weights") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe fp8 experts grouped"));
  const Fp8ExpertsCase cases[] = {
      {4, 8, 200, 72, 16, 0, 16, 72, true, 0, true},        // few rows, partial blocks
      {33, 2, 200, 72, 8, 0, 8, 72, false, 0, true},        // partial tiles and blocks
      {33, 8, 256, 128, 64, 0, 64, 0, true, 7, true},       // 64 experts, top-8
      {128, 8, 512, 256, 64, 16, 32, 256, false, 7, true},  // expert parallel, FP8 shared
      {128, 2, 256, 96, 16, 0, 16, 128, true, 7, false},    // K tail, bf16 shared experts
      {128, 8, 1024, 384, 64, 0, 64, 0, false, 7, true},    // wider rows
  };
  for (const auto& c : cases) check_fp8_experts(rng, c, 2);
}

// The tensor-core decode kernels over FP8 weights (form 3) from one row up to 32, against the
// twin over the FP8 weights: Qwen3-30B-A3B's widths and a TP=2 share (16 experts: the twin's
// random weights are made on the CPU), one to four column tiles, two passes, FP8 shared
// experts (at GLM's inter), a scale row per row, scale blocks cut by
// the end of a row (320 = 2.5 blocks, 96) and by the warps' slices; where the shared experts
// are bf16 or a row is not whole 32-column blocks the fp32 kernels run (the launch says so).
TEST_CASE("gpu moe fp8 experts: the tensor-core decode kernels, 1 to 32 rows") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe fp8 experts mma"));
  struct MmaCase {
    Fp8ExpertsCase c;
    int kernels;
  };
  const MmaCase cases[] = {
      {{1, 8, 2048, 768, 16, 0, 16, 0, true, 7, true}, 3},      // Qwen3-30B-A3B, batch 1
      {{2, 8, 2048, 384, 16, 0, 16, 0, false, 7, true}, 3},     // a TP=2 share, two rows
      {{8, 8, 2048, 768, 16, 0, 16, 0, true, 7, true}, 3},      // 8 streams
      {{12, 8, 1024, 192, 64, 0, 64, 0, false, 0, true}, 3},    // two tiles, a row's scales
      {{17, 4, 256, 96, 16, 4, 8, 0, false, 7, true}, 3},       // three tiles, a rank's half
      {{32, 4, 512, 256, 8, 0, 8, 0, true, 7, true}, 3},        // two passes, four tiles
      {{5, 8, 1024, 1408, 16, 4, 4, 1408, true, 7, true}, 3},   // GLM's inter, FP8 shared
      {{24, 8, 1024, 256, 64, 0, 64, 512, false, 7, true}, 3},  // shared experts, 24 rows
      {{6, 4, 320, 96, 8, 0, 8, 0, false, 0, true}, 3},         // 2.5 scale blocks a row
      {{8, 2, 256, 128, 32, 8, 16, 128, true, 7, false}, 1},    // bf16 shared: fp32 kernels
      {{4, 8, 200, 72, 16, 0, 16, 72, true, 0, true}, 1},       // partial 32-column blocks
  };
  for (const auto& m : cases) {
    Ran ran;
    check_fp8_experts(rng, m.c, 3, &ran);
    CHECK(ran.kernels == m.kernels);
  }
}

// The automatic form (0) over FP8 weights takes the tensor-core kernels from two rows up to
// 32 (past 8 rows instead of the grouped form) and the fp32 kernels at one row. The launch's
// answer and the workspaces agree (both kernels' act is bf16, so the workspaces are not used
// to tell those two apart).
TEST_CASE("gpu moe fp8 experts: the automatic form: mma from two rows to 32") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe fp8 experts automatic form"));
  const Fp8ExpertsCase cases[] = {
      {1, 8, 2048, 768, 16, 0, 16, 0, true, 7, true},    // batch 1
      {2, 8, 1024, 384, 32, 0, 32, 0, false, 7, true},   // two rows
      {8, 8, 1024, 384, 32, 0, 32, 256, true, 7, true},  // 8 rows, FP8 shared experts
      {20, 8, 1024, 384, 32, 0, 32, 0, false, 7, true},  // 20 rows: not the grouped form
  };
  for (const auto& c : cases)
    check_automatic_form(rng, c, c.rows >= 2, false,
                         [](std::mt19937& r, const Fp8ExpertsCase& e, int form, Ran* ran) {
                           check_fp8_experts(r, e, form, ran);
                         });
}

namespace {

// gpt-oss's experts: interleaved gate/up with biases, the clamped activation (limit 7,
// alpha 1.702), the down bias or none (another rank's), optionally FP8 weights.
struct GptExpertsCase {
  int rows, top_k, hidden, inter, experts;
  int expert0, held;  // the rank's experts
  int shared;         // shared experts' intermediate (0: none; they stay plain)
  bool down_bias, accumulate, fp8;
};

// Runs one gpt-oss case through `form` (1 decode, 2 grouped) against the twin. Gate/up
// products of a few units plus biases of up to 2, so the limit clamps many activations.
// FP8: the decode form against the twin over the FP8 weights, the grouped form against the
// twin over its bf16 weights (value x scale rounded), as for the plain experts.
void check_gptoss_experts(std::mt19937& rng, const GptExpertsCase& c, int form) {
  CAPTURE(c.rows);
  CAPTURE(c.top_k);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  CAPTURE(c.down_bias);
  CAPTURE(c.fp8);
  CAPTURE(form);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  const float ws = 12.f / std::sqrt(static_cast<float>(c.hidden));
  const float wd = 1.f / std::sqrt(static_cast<float>(c.inter));
  const float wss = 1.f / std::sqrt(static_cast<float>(c.hidden));
  const float wsd = 1.f / std::sqrt(std::max<float>(1.f, static_cast<float>(S)));
  auto x = as_stored(randoms(rng, R * H, -1, 1), DType::bf16);
  // FP8 weights (values within about 3.75 x scale) or bf16 ones.
  const auto gu8 = test::make_fp8(rng, c.fp8 ? E * 2 * I : 0, H, 7, ws / 3, false);
  const auto dn8 = test::make_fp8(rng, c.fp8 ? E * H : 0, I, 7, wd / 3, false);
  auto gu = c.fp8 ? as_stored(gu8.widened(), DType::bf16)
                  : as_stored(randoms(rng, E * 2 * I * H, -ws, ws), DType::bf16);
  auto dn = c.fp8 ? as_stored(dn8.widened(), DType::bf16)
                  : as_stored(randoms(rng, E * H * I, -wd, wd), DType::bf16);
  auto gub = as_stored(randoms(rng, E * 2 * I, -2, 2), DType::bf16);
  auto db = as_stored(randoms(rng, E * H, -1, 1), DType::bf16);
  auto sgu = as_stored(randoms(rng, 2 * S * H, -wss, wss), DType::bf16);
  auto sdn = as_stored(randoms(rng, H * S, -wsd, wsd), DType::bf16);
  auto prior = as_stored(randoms(rng, R * H, -2, 2), DType::bf16);
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.f);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  std::vector<float> ref = prior;
  MoeExpertsArgs h;
  h.x = x.data(), h.ids = ids.data(), h.weights = w.data(), h.rows = c.rows, h.top_k = c.top_k;
  h.hidden = c.hidden, h.expert0 = c.expert0, h.experts = c.held, h.inter = c.inter;
  h.out = ref.data(), h.accumulate = c.accumulate;
  h.shared_inter = c.shared, h.shared_gate_up = sgu.data(), h.shared_down = sdn.data();
  h.gate_up_bias = gub.data(), h.down_bias = c.down_bias ? db.data() : nullptr;
  h.interleaved = true, h.swiglu_limit = 7.f, h.swiglu_alpha = 1.702f;
  if (c.fp8 && form == 1) {
    h.gate_up_fp8 = gu8.weight(), h.down_fp8 = dn8.weight();
  } else {
    h.gate_up = gu.data(), h.down = dn.data();
  }
  moe_experts_ref(h);

  auto dx = to_dev(x, DType::bf16), dgu = to_dev(gu, DType::bf16), ddn = to_dev(dn, DType::bf16);
  auto dgub = to_dev(gub, DType::bf16), ddb = to_dev(db, DType::bf16);
  auto dsgu = to_dev(sgu, DType::bf16), dsdn = to_dev(sdn, DType::bf16);
  auto dgu8 = DeviceBuf<uint8_t>::from(gu8.q), ddn8 = DeviceBuf<uint8_t>::from(dn8.q);
  auto dgu8s = DeviceBuf<float>::from(gu8.scales), ddn8s = DeviceBuf<float>::from(dn8.scales);
  Dev dout = c.accumulate ? to_dev(prior, DType::bf16) : poisoned(R * H, DType::bf16);
  auto dids = DeviceBuf<int32_t>::from(ids);
  auto dw = DeviceBuf<float>::from(w);
  const size_t ws_bytes =
      moe_experts_workspace_bytes(c.rows, c.top_k, c.hidden, c.inter, c.shared, c.held);
  auto dws = DeviceMemory::allocate(ws_bytes);
  REQUIRE(dws.ok());
  MoeExpertsArgs g = h;
  g.x = dx.get(), g.ids = dids.get(), g.weights = dw.get(), g.out = dout.get();
  g.gate_up_fp8 = g.down_fp8 = Fp8Weight{};
  if (c.fp8) {
    g.gate_up = g.down = nullptr;
    g.gate_up_fp8 = gu8.weight(), g.down_fp8 = dn8.weight();
    g.gate_up_fp8.q = dgu8.get(), g.gate_up_fp8.scales = dgu8s.get();
    g.down_fp8.q = ddn8.get(), g.down_fp8.scales = ddn8s.get();
  } else {
    g.gate_up = dgu.get(), g.down = ddn.get();
  }
  g.shared_gate_up = S ? dsgu.get() : nullptr, g.shared_down = S ? dsdn.get() : nullptr;
  g.gate_up_bias = dgub.get(), g.down_bias = c.down_bias ? ddb.get() : nullptr;
  g.workspace = dws->get(), g.workspace_bytes = ws_bytes, g.form = form;
  auto s = moe_experts_cuda_device(g, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  auto got = from_dev(dout);
  std::vector<double> row_mean(R, 0.0);
  for (size_t r = 0; r < R; ++r) {
    for (size_t i = 0; i < H; ++i)
      row_mean[r] += std::fabs(ref[r * H + i] - (c.accumulate ? prior[r * H + i] : 0.f));
    row_mean[r] /= static_cast<double>(H);
  }
  double err = 0;
  auto bound = [&](size_t i) { return 2 * bf16_ulp(ref[i]) + 0.01 * row_mean[i / H] + 1e-6; };
  CHECK(outside(got, ref, bound, &err) == 0);
  MESSAGE("gpt-oss experts form " << form << " rows " << c.rows << " k " << c.top_k << " H "
                                  << c.hidden << " I " << c.inter << " E " << c.held << "/"
                                  << c.experts << " down bias " << c.down_bias << " fp8 " << c.fp8
                                  << ": max err " << err);
}

}  // namespace

TEST_CASE("gpu moe gptoss experts: the decode form against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe gptoss experts decode"));
  const GptExpertsCase cases[] = {
      {1, 4, 2880, 720, 16, 0, 16, 0, true, true, false},   // gpt-oss's hidden, a TP=4 share
      {1, 4, 256, 128, 32, 0, 32, 0, false, false, false},  // no down bias
      {4, 4, 256, 128, 32, 0, 32, 0, true, false, false},
      {4, 4, 256, 96, 32, 8, 16, 0, false, true, false},    // expert parallel, no down bias
      {8, 4, 512, 256, 32, 0, 32, 64, true, true, false},   // 8 rows, plain shared experts
      {8, 4, 2880, 720, 32, 8, 8, 0, false, false, false},  // 8 of 32 experts, 8 streams
      {4, 4, 256, 128, 32, 0, 32, 0, true, true, true},     // FP8 weights
      {20, 4, 512, 256, 32, 0, 32, 64, true, true, false},  // 20 rows: form 3 only
  };
  // Form 3 puts the bf16 experts on the tensor-core kernels (biases, interleaved rows and the
  // clamped activation in their epilogues; the shared experts plain).
  for (const auto& c : cases) {
    if (c.rows <= kMoeDecodeMaxRows) check_gptoss_experts(rng, c, 1);
    if (!c.fp8) check_gptoss_experts(rng, c, 3);
  }
}

TEST_CASE("gpu moe gptoss experts: the grouped form against the twin") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe gptoss experts grouped"));
  const GptExpertsCase cases[] = {
      {1, 4, 256, 128, 32, 0, 32, 0, true, false, false},
      {4, 4, 256, 128, 32, 0, 32, 0, false, true, false},     // no down bias
      {8, 4, 256, 96, 32, 0, 32, 0, true, false, false},      // a K tail of 32 in down
      {33, 4, 512, 256, 32, 0, 32, 0, true, true, false},     // partial tiles
      {33, 4, 256, 128, 32, 16, 8, 64, false, false, false},  // expert parallel, shared
      {128, 4, 512, 256, 32, 0, 32, 0, true, false, false},
      {128, 4, 512, 256, 32, 0, 32, 0, false, true, false},  // no down bias
      {33, 4, 256, 128, 32, 0, 32, 0, true, true, true},     // FP8 weights
  };
  for (const auto& c : cases) check_gptoss_experts(rng, c, 2);
}

namespace {

// MXFP4 routed experts, plain or with gpt-oss's options (interleaved gate/up, both biases,
// limit 7, alpha 1.702); bf16 shared experts beside them.
struct Mx4ExpertsCase {
  int rows, top_k, hidden, inter, experts;
  int expert0, held;  // the rank's experts
  int shared;         // shared experts' intermediate (0: none; bf16)
  bool accumulate, gptoss;
};

// Runs one case with MXFP4 experts through `form` (1 decode, 2 grouped, 3 decode on the
// tensor cores where it applies) against the twin over the same packed weights.
void check_mx4_experts(std::mt19937& rng, const Mx4ExpertsCase& c, int form, Ran* ran = nullptr) {
  CAPTURE(c.rows);
  CAPTURE(c.top_k);
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  CAPTURE(c.gptoss);
  CAPTURE(form);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  // gpt-oss: gate/up products of a few units plus biases, so the limit clamps many.
  const float ws = (c.gptoss ? 12.f : 1.f) / std::sqrt(static_cast<float>(c.hidden));
  const float wd = 1.f / std::sqrt(static_cast<float>(c.inter));
  const float wss = 1.f / std::sqrt(static_cast<float>(c.hidden));
  const float wsd = 1.f / std::sqrt(std::max<float>(1.f, static_cast<float>(S)));
  auto x = as_stored(randoms(rng, R * H, -1, 1), DType::bf16);
  const auto gu = test::make_mxfp4(rng, E * 2 * I, H, ws / 3);
  const auto dn = test::make_mxfp4(rng, E * H, I, wd / 3);
  auto gub = as_stored(randoms(rng, E * 2 * I, -2, 2), DType::bf16);
  auto db = as_stored(randoms(rng, E * H, -1, 1), DType::bf16);
  auto sgu = as_stored(randoms(rng, 2 * S * H, -wss, wss), DType::bf16);
  auto sdn = as_stored(randoms(rng, H * S, -wsd, wsd), DType::bf16);
  auto prior = as_stored(randoms(rng, R * H, -2, 2), DType::bf16);
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> wdist(0.05f, 1.f);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  std::vector<float> ref = prior;
  MoeExpertsArgs h;
  h.x = x.data(), h.ids = ids.data(), h.weights = w.data(), h.rows = c.rows, h.top_k = c.top_k;
  h.hidden = c.hidden, h.expert0 = c.expert0, h.experts = c.held, h.inter = c.inter;
  h.out = ref.data(), h.accumulate = c.accumulate;
  h.shared_inter = c.shared, h.shared_gate_up = sgu.data(), h.shared_down = sdn.data();
  h.gate_up_mx4 = gu.weight(), h.down_mx4 = dn.weight();
  if (c.gptoss) {
    h.gate_up_bias = gub.data(), h.down_bias = db.data(), h.interleaved = true;
    h.swiglu_limit = 7.f, h.swiglu_alpha = 1.702f;
  }
  moe_experts_ref(h);

  auto dx = to_dev(x, DType::bf16);
  auto dgub = to_dev(gub, DType::bf16), ddb = to_dev(db, DType::bf16);
  auto dsgu = to_dev(sgu, DType::bf16), dsdn = to_dev(sdn, DType::bf16);
  auto dgu = DeviceBuf<uint8_t>::from(gu.blocks), dgus = DeviceBuf<uint8_t>::from(gu.scales);
  auto ddn = DeviceBuf<uint8_t>::from(dn.blocks), ddns = DeviceBuf<uint8_t>::from(dn.scales);
  Dev dout = c.accumulate ? to_dev(prior, DType::bf16) : poisoned(R * H, DType::bf16);
  auto dids = DeviceBuf<int32_t>::from(ids);
  auto dw = DeviceBuf<float>::from(w);
  const size_t ws_bytes =
      moe_experts_workspace_bytes(c.rows, c.top_k, c.hidden, c.inter, c.shared, c.held);
  // Zeroed: the kernels' workspace after the call tells which of them ran (the tests below).
  auto dws = DeviceBuf<uint8_t>::from(std::vector<uint8_t>(ws_bytes, 0));
  MoeExpertsArgs g = h;
  g.x = dx.get(), g.ids = dids.get(), g.weights = dw.get(), g.out = dout.get();
  g.gate_up_mx4.blocks = dgu.get(), g.gate_up_mx4.scales = dgus.get();
  g.down_mx4.blocks = ddn.get(), g.down_mx4.scales = ddns.get();
  g.shared_gate_up = S ? dsgu.get() : nullptr, g.shared_down = S ? dsdn.get() : nullptr;
  g.gate_up_bias = c.gptoss ? dgub.get() : nullptr;
  g.down_bias = c.gptoss ? ddb.get() : nullptr;
  g.workspace = dws.get(), g.workspace_bytes = ws_bytes, g.form = form;
  auto s = moe_experts_cuda_device(g, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  auto got = from_dev(dout);
  if (ran) ran->ws = dws.host(), ran->kernels = moe_experts_kernels(g);
  std::vector<double> row_mean(R, 0.0);
  for (size_t r = 0; r < R; ++r) {
    for (size_t i = 0; i < H; ++i)
      row_mean[r] += std::fabs(ref[r * H + i] - (c.accumulate ? prior[r * H + i] : 0.f));
    row_mean[r] /= static_cast<double>(H);
  }
  double err = 0;
  auto bound = [&](size_t i) { return 2 * bf16_ulp(ref[i]) + 0.01 * row_mean[i / H] + 1e-6; };
  CHECK(outside(got, ref, bound, &err) == 0);
  MESSAGE("mxfp4 experts form " << form << " rows " << c.rows << " k " << c.top_k << " H "
                                << c.hidden << " I " << c.inter << " E " << c.held << "/"
                                << c.experts << " shared " << c.shared << " gpt-oss " << c.gptoss
                                << ": max err " << err);
}

// The cases both forms run (the decode form those of at most kMoeDecodeMaxRows rows): rows
// 1, 5 and 40; plain and gpt-oss; gpt-oss's hidden (2880: 90 scale blocks, a partial step of
// 1024 columns) and inter 1440 (a TP=2 share); a rank's slice of the experts; bf16 shared
// experts in two cases, the residual add in others.
const Mx4ExpertsCase kMx4Cases[] = {
    {1, 4, 2880, 1440, 16, 0, 16, 0, true, true},   // gpt-oss, batch 1, into the residual
    {1, 2, 256, 128, 8, 0, 8, 0, false, false},     // plain experts, one row
    {5, 4, 256, 96, 16, 4, 8, 0, false, true},      // gpt-oss, experts [4, 12) of 16
    {5, 4, 512, 256, 16, 0, 16, 64, true, false},   // plain, bf16 shared experts, residual
    {40, 4, 512, 256, 32, 0, 32, 0, false, true},   // gpt-oss, 40 rows
    {40, 4, 2880, 256, 32, 8, 16, 0, true, true},   // gpt-oss's hidden, a rank's experts
    {40, 2, 256, 160, 8, 0, 8, 32, false, false},   // plain, a K tail of 32, shared experts
    {8, 4, 2880, 1440, 16, 0, 16, 0, false, true},  // gpt-oss, 8 rows: every mma column
    {3, 4, 256, 64, 4, 0, 4, 0, true, true},        // gpt-oss, each row chooses every expert
    {2, 4, 320, 96, 8, 0, 8, 0, false, true},       // gpt-oss, a 10-block K (odd halves)
};

}  // namespace

// Form 1 takes the fp32 decode kernels; form 3 the tensor-core ones for gpt-oss's experts
// (clamped activation, no shared experts), the fp32 ones for every other case.
TEST_CASE("gpu moe: MXFP4 experts, the decode form against the twin over the packed weights") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe mxfp4 experts decode"));
  for (const auto& c : kMx4Cases)
    if (c.rows <= kMoeDecodeMaxRows) {
      check_mx4_experts(rng, c, 1);
      check_mx4_experts(rng, c, 3);
    }
}

// The tensor-core decode kernels past 8 rows (up to 32: column tiles of 8; gate/up stages 16
// rows of x at a time, so an expert chosen by more rows takes a second pass): form 3 and the
// automatic form against the twin.
TEST_CASE("gpu moe: MXFP4 experts, the tensor-core decode kernels up to 32 rows") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe mxfp4 experts mma rows"));
  const Mx4ExpertsCase cases[] = {
      {12, 4, 2880, 1440, 16, 0, 16, 0, true, true},  // gpt-oss's widths, two column tiles
      {17, 4, 256, 96, 16, 4, 8, 0, false, true},     // three tiles, a rank's experts
      {24, 4, 320, 96, 8, 0, 8, 0, true, true},       // every expert chosen by ~12 rows
      {32, 4, 512, 256, 8, 0, 8, 0, false, true},     // ~16 rows an expert: two passes
      {32, 4, 2880, 256, 32, 8, 16, 0, true, true},   // four tiles, gpt-oss's hidden
  };
  for (const auto& c : cases) {
    check_mx4_experts(rng, c, 3);
    check_mx4_experts(rng, c, 0);
  }
}

// The automatic form (0) takes the fp32 kernels at one row and the tensor-core kernels from
// two rows up to 32 (past 8 rows instead of the grouped form). Which kernels ran is the
// launch's own answer, and shows in the workspace they leave (the fp32 kernels' activations are
// bf16, the tensor-core kernels' fp16 in the mma's column order; the grouped form also sorts the
// rows there), not in the output, whose bf16 rounding can hide the kernels' different fp32
// summation orders.
TEST_CASE("gpu moe: MXFP4 experts, the automatic form: fp32 kernels at one row, mma from two") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe mxfp4 experts automatic form"));
  const Mx4ExpertsCase cases[] = {
      {1, 4, 2880, 1440, 16, 0, 16, 0, true, true},   // gpt-oss, batch 1
      {2, 4, 320, 96, 8, 0, 8, 0, false, true},       // two rows
      {5, 4, 256, 96, 16, 4, 8, 0, false, true},      // five rows, a rank's experts
      {8, 4, 2880, 1440, 16, 0, 16, 0, false, true},  // 8 rows
      {20, 4, 256, 96, 8, 0, 8, 0, true, true},       // 20 rows: not the grouped form
  };
  for (const auto& c : cases)
    check_automatic_form(rng, c, c.rows > 1, true,
                         [](std::mt19937& r, const Mx4ExpertsCase& e, int form, Ran* ran) {
                           check_mx4_experts(r, e, form, ran);
                         });
}

// GB10 has 99 KiB of shared memory a block: at gpt-oss's hidden (2880) 16 staged rows of x
// do not fit, so the tensor-core decode kernels stage 8 a pass, and where 8 do not fit either
// the other forms run. The cap set to GB10's limit (then to 32 KiB) on this GPU takes the same
// paths: moe_mma_pass_rows says which, and the outputs stay within the twin's bound (a third
// and a fourth pass of the same weights at 17-32 rows).
TEST_CASE("gpu moe: the tensor-core decode kernels under GB10's shared memory: 8-row passes") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe mma smem cap"));
  struct CapReset {
    ~CapReset() { set_moe_smem_cap(0); }
  } reset;
  MoeExpertsArgs probe;
  probe.rows = 32, probe.hidden = 2880;
  set_moe_smem_cap(0);
  const int uncapped = moe_mma_pass_rows(probe);
  set_moe_smem_cap(99 * 1024);
  REQUIRE(moe_mma_pass_rows(probe) == 8);
  const Mx4ExpertsCase mx4[] = {
      {12, 4, 2880, 1440, 16, 0, 16, 0, true, true},  // two passes of 8
      {32, 4, 2880, 256, 8, 0, 8, 0, false, true},    // ~16 rows an expert: two or more passes
  };
  for (const auto& c : mx4) check_mx4_experts(rng, c, 3);
  const ExpertsCase bf[] = {
      {17, 8, 4096, 256, 16, 0, 16, 512, true},  // bf16 at GLM's hidden: 16 rows take 132 KiB
      {32, 4, 4096, 128, 8, 0, 8, 0, false},     // every expert chosen by ~16 rows
  };
  probe.hidden = 4096;
  CHECK(moe_mma_pass_rows(probe) == 8);
  for (const auto& c : bf) check_experts(rng, c, 3);
  // 32 KiB: not even 8 rows of 2880 fit; the fp32 kernels run, their workspace unchanged.
  set_moe_smem_cap(32 * 1024);
  probe.rows = 8, probe.hidden = 2880;
  CHECK(moe_mma_pass_rows(probe) == 0);
  const Mx4ExpertsCase small{8, 4, 2880, 1440, 16, 0, 16, 0, false, true};
  Ran fp32, capped;
  const std::mt19937 start = rng;
  std::mt19937 r1 = start, r3 = start;
  check_mx4_experts(r1, small, 1, &fp32);
  check_mx4_experts(r3, small, 3, &capped);
  CHECK(capped.kernels == 1);
  CHECK(capped.ws == fp32.ws);
  set_moe_smem_cap(0);
  CHECK(moe_mma_pass_rows(probe) == uncapped);
}

TEST_CASE("gpu moe: MXFP4 experts, the grouped form against the twin over the packed weights") {
  if (test::skip_without_cuda()) return;
  std::mt19937 rng(test::fresh_seed("moe mxfp4 experts grouped"));
  for (const auto& c : kMx4Cases) check_mx4_experts(rng, c, 2);
}
