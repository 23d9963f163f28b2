// The router's twin (kernels/moe.h): each scoring rule on hand-made rows whose answer is known,
// the tie rule, and the expert products' twin on a row worked out by hand; its FP8 experts
// against the float twin on the same weights widened, and the FP8 fields' checks; gpt-oss's
// experts (biases, interleaved gate/up, clamped activation) against a plain double
// implementation in this file, and those fields' checks.
#include "kernels/moe.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "support/moe_fp8_weights.h"

using namespace spark;
using namespace spark::kernels;

TEST_CASE("moe route twin: softmax top-k, renormalised or not") {
  const std::vector<float> lg = {0.f, 2.f, 1.f, -1.f};
  MoeRouteArgs a;
  a.experts = 4, a.top_k = 2;
  std::vector<int32_t> ids(2);
  std::vector<float> w(2), margin(2);
  moe_route_ref(lg.data(), nullptr, a, 1, ids.data(), w.data(), margin.data());
  const double z = 1 + std::exp(2.0) + std::exp(1.0) + std::exp(-1.0);
  CHECK(ids[0] == 1);
  CHECK(ids[1] == 2);
  CHECK(w[0] == doctest::Approx(std::exp(2.0) / z).epsilon(1e-6));
  CHECK(w[1] == doctest::Approx(std::exp(1.0) / z).epsilon(1e-6));
  CHECK(margin[0] == doctest::Approx(std::exp(1.0) / z));  // last chosen
  CHECK(margin[1] == doctest::Approx(1.0 / z));            // first unchosen (expert 0)
  a.norm_topk = true;
  moe_route_ref(lg.data(), nullptr, a, 1, ids.data(), w.data());
  CHECK(w[0] + w[1] == doctest::Approx(1.0));
  CHECK(w[0] / w[1] == doctest::Approx(std::exp(1.0)));
}

TEST_CASE("moe route twin: equal scores go to the lower expert id") {
  const std::vector<float> lg = {1.f, 3.f, 3.f, 3.f, 0.f};
  MoeRouteArgs a;
  a.experts = 5, a.top_k = 2;
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  moe_route_ref(lg.data(), nullptr, a, 1, ids.data(), w.data());
  CHECK(ids[0] == 1);
  CHECK(ids[1] == 2);
}

TEST_CASE("moe route twin: sigmoid scores, the bias picks, the weights are the scores") {
  // Scores s = sigmoid(l); the bias lifts expert 0 into the choice without entering its weight.
  const std::vector<float> lg = {-2.f, 1.f, 0.5f, 0.f};
  const std::vector<float> bias = {3.f, 0.f, 0.f, 0.f};
  MoeRouteArgs a;
  a.experts = 4, a.top_k = 2, a.sigmoid = true, a.norm_topk = true, a.scaling = 2.5f;
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  moe_route_ref(lg.data(), bias.data(), a, 1, ids.data(), w.data());
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 1);
  const double den = sig(-2) + sig(1) + 1e-20;
  CHECK(w[0] == doctest::Approx(2.5 * sig(-2) / den).epsilon(1e-6));
  CHECK(w[1] == doctest::Approx(2.5 * sig(1) / den).epsilon(1e-6));
}

TEST_CASE("moe route twin: group-limited choice keeps only the best groups' experts") {
  // 8 experts in 4 groups of 2; 2 groups stay. A group's score is the sum of its top two
  // choice values, so a group whose other member is weak loses even with the best expert.
  const std::vector<float> lg = {1.0f, 1.0f, 0.9f, 0.9f, -3.f, 4.0f, -4.f, -4.f};
  MoeRouteArgs a;
  a.experts = 8, a.top_k = 2, a.sigmoid = true, a.n_group = 4, a.topk_group = 2;
  std::vector<int32_t> ids(2);
  std::vector<float> w(2), margin(2);
  moe_route_ref(lg.data(), nullptr, a, 1, ids.data(), w.data(), margin.data());
  // Group sums: g0 = 2 sig(1) = 1.462, g1 = 2 sig(0.9) = 1.422, g2 = sig(-3) + sig(4) = 1.029.
  // Expert 5 (sig(4) = 0.982, the best single score) is in g2, which is not kept.
  CHECK(ids[0] == 0);
  CHECK(ids[1] == 1);
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  CHECK(margin[1] == doctest::Approx(sig(0.9)));  // the best unchosen: a kept group's expert
  a.topk_group = 3;
  moe_route_ref(lg.data(), nullptr, a, 1, ids.data(), w.data());
  CHECK(ids[0] == 5);
}

TEST_CASE("moe route twin: arguments are checked") {
  MoeRouteArgs a;
  a.experts = 8, a.top_k = 9;
  CHECK_FALSE(moe_route_check(a).ok());
  a.top_k = 2, a.n_group = 3;
  CHECK_FALSE(moe_route_check(a).ok());
  a.n_group = 2, a.sigmoid = false;
  CHECK_FALSE(moe_route_check(a).ok());  // groups need sigmoid scores
  a.sigmoid = true;
  CHECK(moe_route_check(a).ok());
}

TEST_CASE("moe experts twin: a row by hand, held experts only, shared experts, accumulate") {
  // hidden 2, inter 1: expert e has gate row g_e, up row u_e, down column d_e.
  const int H = 2;
  const std::vector<float> x = {1.f, 0.5f};
  // 3 experts, [gate | up] rows of [2] each, down [2][1].
  const std::vector<float> gu = {1, 0, 0, 1,   // expert 0: g = x0, u = x1
                                 0, 1, 1, 1,   // expert 1: g = x1, u = x0 + x1
                                 2, 0, 0, 2};  // expert 2: g = 2 x0, u = 2 x1
  const std::vector<float> dn = {1, -1, 2, 0, 0.5f, 0.5f};
  const std::vector<int32_t> ids = {2, 0};
  const std::vector<float> w = {0.75f, 0.25f};
  std::vector<float> out(2, 10.f);
  MoeExpertsArgs a;
  a.x = x.data(), a.ids = ids.data(), a.weights = w.data(), a.rows = 1, a.top_k = 2, a.hidden = H;
  a.gate_up = gu.data(), a.down = dn.data(), a.expert0 = 0, a.experts = 3, a.inter = 1;
  a.out = out.data();
  moe_experts_ref(a);
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  const double act0 = round_to(DType::bf16, static_cast<float>(silu(1.0) * 0.5));
  const double act2 = round_to(DType::bf16, static_cast<float>(silu(2.0) * 1.0));
  const double y0 = 0.25 * act0 * 1 + 0.75 * act2 * 0.5;
  const double y1 = 0.25 * act0 * -1 + 0.75 * act2 * 0.5;
  CHECK(out[0] == doctest::Approx(round_to(DType::bf16, static_cast<float>(y0))));
  CHECK(out[1] == doctest::Approx(round_to(DType::bf16, static_cast<float>(y1))));
  // Only expert 2 held on this rank (expert0 = 2, one expert): expert 0's share is not here.
  a.gate_up = gu.data() + 8, a.down = dn.data() + 4, a.expert0 = 2, a.experts = 1;
  moe_experts_ref(a);
  CHECK(out[0] == doctest::Approx(round_to(DType::bf16, static_cast<float>(0.75 * act2 * 0.5))));
  // Accumulate into out, with a shared expert (expert 1's weights) added at weight 1.
  out = {1.f, 2.f};
  a.accumulate = true;
  a.shared_gate_up = gu.data() + 4, a.shared_down = dn.data() + 2, a.shared_inter = 1;
  moe_experts_ref(a);
  const double act1 = round_to(DType::bf16, static_cast<float>(silu(0.5) * 1.5));
  CHECK(out[0] == doctest::Approx(
                      round_to(DType::bf16, static_cast<float>(1 + 0.75 * act2 * 0.5 + act1 * 2))));
  CHECK(out[1] == doctest::Approx(
                      round_to(DType::bf16, static_cast<float>(2 + 0.75 * act2 * 0.5 + act1 * 0))));
}

namespace {

struct Fp8TwinCase {
  int rows, top_k, hidden, inter, experts, expert0, held, shared, row_shift;
  bool accumulate, shared_fp8;
};

// The twin over FP8 experts (host bytes and scales) against the twin over the same weights
// widened to float: the scales keep value x scale exact in float, so the sums are the same
// numbers in the same order and the outputs equal bit for bit.
void check_fp8_twin(std::mt19937& rng, const Fp8TwinCase& c) {
  CAPTURE(c.hidden);
  CAPTURE(c.inter);
  CAPTURE(c.row_shift);
  CAPTURE(c.shared_fp8);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  const float ws = 1.f / std::sqrt(static_cast<float>(H));
  const float wd = 1.f / std::sqrt(static_cast<float>(I));
  const auto gu = test::make_fp8(rng, E * 2 * I, H, c.row_shift, ws, true);
  const auto dn = test::make_fp8(rng, E * H, I, c.row_shift, wd, true);
  const auto sgu = test::make_fp8(rng, 2 * S, H, c.row_shift, ws, true);
  const auto sdn = test::make_fp8(rng, H, S, c.row_shift, wd, true);
  std::uniform_real_distribution<float> u(-1.f, 1.f), wdist(0.05f, 1.f);
  std::vector<float> x(R * H), prior(R * H);
  for (auto& v : x) v = round_to(DType::bf16, u(rng));
  for (auto& v : prior) v = round_to(DType::bf16, 2 * u(rng));
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  const auto gu_f = gu.widened(), dn_f = dn.widened(), sgu_f = sgu.widened(), sdn_f = sdn.widened();
  MoeExpertsArgs f;
  f.x = x.data(), f.ids = ids.data(), f.weights = w.data(), f.rows = c.rows, f.top_k = c.top_k;
  f.hidden = c.hidden, f.gate_up = gu_f.data(), f.down = dn_f.data(), f.expert0 = c.expert0;
  f.experts = c.held, f.inter = c.inter, f.accumulate = c.accumulate;
  f.shared_inter = c.shared, f.shared_gate_up = sgu_f.data(), f.shared_down = sdn_f.data();
  std::vector<float> want = prior, got = prior;
  f.out = want.data();
  moe_experts_ref(f);
  MoeExpertsArgs q = f;
  q.gate_up = nullptr, q.down = nullptr;  // not read with FP8 experts
  q.gate_up_fp8 = gu.weight(), q.down_fp8 = dn.weight();
  if (c.shared_fp8) {
    q.shared_gate_up = nullptr, q.shared_down = nullptr;
    q.shared_gate_up_fp8 = sgu.weight(), q.shared_down_fp8 = sdn.weight();
  }
  q.out = got.data();
  moe_experts_ref(q);
  size_t differ = 0, moved = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    differ += !(got[i] == want[i]);  // NaN (a padding byte or scale read) differs too
    moved += want[i] != (c.accumulate ? prior[i] : 0.f);
  }
  CHECK(differ == 0);
  CHECK(moved > want.size() / 2);  // the experts did add something
}

}  // namespace

TEST_CASE("moe experts twin: FP8 experts equal the float twin on the widened weights") {
  std::mt19937 rng(20261205);
  const Fp8TwinCase cases[] = {
      // Partial 128-column blocks (200 = 128 + 72, 72 < 128), a scale row per weight row.
      {3, 2, 200, 72, 6, 0, 6, 40, 0, false, true},
      {4, 4, 200, 72, 8, 2, 4, 72, 0, true, true},  // expert parallel, into the residual
      // 128 x 128 blocks: a scale row per 128 rows of the stacked matrices.
      {2, 2, 256, 128, 4, 0, 4, 128, 7, true, true},
      {3, 2, 256, 128, 4, 0, 4, 128, 7, false, false},  // FP8 experts, bf16 shared experts
  };
  for (const auto& c : cases) check_fp8_twin(rng, c);
}

TEST_CASE("moe experts check: bad FP8 fields are refused, naming the field") {
  alignas(16) static uint8_t bytes[4096];
  alignas(16) static float scales[64];
  alignas(16) static uint16_t x[256];
  alignas(16) static float work[8192];
  static int32_t ids[4];
  static float weights[4];
  MoeExpertsArgs a;
  a.x = x, a.ids = ids, a.weights = weights, a.out = x, a.rows = 1, a.top_k = 2;
  a.hidden = 200, a.inter = 72, a.experts = 4, a.shared_inter = 72;
  a.workspace = work, a.workspace_bytes = sizeof work;
  Fp8Weight good;
  good.q = bytes, good.ldq = 208, good.scales = scales, good.scale_ld = 2, good.row_shift = 0;
  a.gate_up_fp8 = a.down_fp8 = a.shared_gate_up_fp8 = a.shared_down_fp8 = good;
  REQUIRE_MESSAGE(moe_experts_check(a).ok(), moe_experts_check(a).message());
  auto refused = [&](MoeExpertsArgs b, const std::string& field) {
    const auto s = moe_experts_check(b);
    CHECK_FALSE(s.ok());
    CHECK_MESSAGE(s.message().find(field) != std::string::npos, s.message());
  };
  {
    auto b = a;
    b.gate_up_fp8.scale_ld = 1;  // hidden 200 needs 2 blocks
    refused(b, "gate_up_fp8.scale_ld");
  }
  // Forms 0 to 4 (4: automatic with the fp32 MXFP4 decode kernels); the decode form (1) at
  // most kMoeDecodeMaxRows rows.
  for (int form : {0, 1, 2, 3, 4}) {
    auto b = a;
    b.form = form;
    CHECK_MESSAGE(moe_experts_check(b).ok(), form);
  }
  {
    auto b = a;
    b.form = 5;
    refused(b, "form 5");
  }
  {
    auto b = a;
    b.down_fp8.row_shift = 3;
    refused(b, "down_fp8.row_shift");
  }
  {
    auto b = a;
    b.shared_gate_up_fp8.ldq = 192;  // fewer than 200 columns
    refused(b, "shared_gate_up_fp8.ldq");
  }
  {
    auto b = a;
    b.shared_down_fp8.q = bytes + 4;  // not 8-byte aligned
    refused(b, "shared_down_fp8");
  }
  {
    auto b = a;
    b.down_fp8.ldq = 76;  // >= 72 columns, not a multiple of 8
    refused(b, "down_fp8");
  }
  {
    auto b = a;
    b.down_fp8.scales = nullptr;
    refused(b, "down_fp8");
  }
  {
    auto b = a;
    b.down_fp8 = Fp8Weight{};  // gate/up FP8 without its down
    refused(b, "down_fp8");
  }
  {
    auto b = a;  // bf16 shared experts need their pointers
    b.shared_gate_up_fp8 = b.shared_down_fp8 = Fp8Weight{};
    refused(b, "null operand");
  }
}

namespace {

struct GptTwinCase {
  int rows, top_k, hidden, inter, experts, expert0, held, shared;
  bool interleaved, gate_up_bias, down_bias, accumulate;
  float limit, alpha;
};

// gpt-oss's experts written out as transformers' GptOssExperts reads: for each chosen held
// expert, gate_up = W x + b over all 2I rows, gate = gate_up[0::2] and up = gate_up[1::2]
// (else the [gate | up] halves), gate clamped above and up both ways by the limit,
// act = (up + 1) * gate * sigmoid(alpha * gate) (silu(gate) * up without a limit), act rounded
// to bf16 (the kernels' documented rounding), out += weight * (down act + down bias); the
// shared experts plain. In double, the sum rounded once to bf16. `clamped` counts the
// activations the limit changed.
std::vector<float> gptoss_by_hand(const GptTwinCase& c, const std::vector<float>& x,
                                  const std::vector<int32_t>& ids, const std::vector<float>& w,
                                  const std::vector<float>& gu, const std::vector<float>& gub,
                                  const std::vector<float>& dn, const std::vector<float>& db,
                                  const std::vector<float>& sgu, const std::vector<float>& sdn,
                                  const std::vector<float>& prior, size_t* clamped) {
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t S = static_cast<size_t>(c.shared);
  std::vector<float> out(R * H);
  for (size_t r = 0; r < R; ++r) {
    std::vector<double> y(H, 0.0);
    for (size_t j = 0; j < K; ++j) {
      const int e = ids[r * K + j];
      if (e < c.expert0 || e >= c.expert0 + c.held) continue;
      const size_t le = static_cast<size_t>(e - c.expert0);
      std::vector<double> z(2 * I);
      for (size_t o = 0; o < 2 * I; ++o) {
        double s = 0;
        for (size_t k = 0; k < H; ++k) s += double{gu[(le * 2 * I + o) * H + k]} * x[r * H + k];
        z[o] = s + (c.gate_up_bias ? gub[le * 2 * I + o] : 0.0);
      }
      std::vector<double> act(I);
      for (size_t i = 0; i < I; ++i) {
        double g = c.interleaved ? z[2 * i] : z[i];
        double u = c.interleaved ? z[2 * i + 1] : z[I + i];
        double v;
        if (c.limit > 0) {
          const double L = c.limit;
          if (g > L || u > L || u < -L) ++*clamped;
          g = g > L ? L : g;
          u = u > L ? L : (u < -L ? -L : u);
          v = (u + 1) * g * (1 / (1 + std::exp(-double{c.alpha} * g)));
        } else {
          v = u * g / (1 + std::exp(-g));
        }
        act[i] = round_to(DType::bf16, static_cast<float>(v));
      }
      for (size_t h = 0; h < H; ++h) {
        double s = c.down_bias ? db[le * H + h] : 0.0;
        for (size_t i = 0; i < I; ++i) s += double{dn[(le * H + h) * I + i]} * act[i];
        y[h] += w[r * K + j] * s;
      }
    }
    if (S > 0) {
      std::vector<double> act(S);
      for (size_t i = 0; i < S; ++i) {
        double g = 0, u = 0;
        for (size_t k = 0; k < H; ++k) {
          g += double{sgu[i * H + k]} * x[r * H + k];
          u += double{sgu[(S + i) * H + k]} * x[r * H + k];
        }
        act[i] = round_to(DType::bf16, static_cast<float>(u * g / (1 + std::exp(-g))));
      }
      for (size_t h = 0; h < H; ++h)
        for (size_t i = 0; i < S; ++i) y[h] += double{sdn[h * S + i]} * act[i];
    }
    for (size_t h = 0; h < H; ++h)
      out[r * H + h] =
          round_to(DType::bf16, static_cast<float>((c.accumulate ? prior[r * H + h] : 0.0) + y[h]));
  }
  return out;
}

// The twin with gpt-oss's fields against gptoss_by_hand: within two bf16 ulps of each output
// plus 1% of the row's mean |output| (an activation on a bf16 rounding boundary may round the
// other way where the two sum in another order).
void check_gptoss_twin(std::mt19937& rng, const GptTwinCase& c) {
  CAPTURE(c.rows);
  CAPTURE(c.interleaved);
  CAPTURE(c.gate_up_bias);
  CAPTURE(c.down_bias);
  CAPTURE(c.limit);
  CAPTURE(c.expert0);
  CAPTURE(c.held);
  CAPTURE(c.shared);
  const size_t R = static_cast<size_t>(c.rows), K = static_cast<size_t>(c.top_k);
  const size_t H = static_cast<size_t>(c.hidden), I = static_cast<size_t>(c.inter);
  const size_t E = static_cast<size_t>(c.held), S = static_cast<size_t>(c.shared);
  std::uniform_real_distribution<float> u(-1.f, 1.f), wdist(0.05f, 1.f);
  auto fill = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& f : v) f = round_to(DType::bf16, scale * u(rng));
    return v;
  };
  // Gate/up products of a few units (the limit of 7 clamps some), biases that matter.
  const float ws = 12.f / std::sqrt(static_cast<float>(H)), wd = 1.f / std::sqrt(float(I));
  const auto x = fill(R * H, 1.f), prior = fill(R * H, 2.f);
  const auto gu = fill(E * 2 * I * H, ws), gub = fill(E * 2 * I, 2.f);
  const auto dn = fill(E * H * I, wd), db = fill(E * H, 1.f);
  const auto sgu = fill(2 * S * H, 1.f / std::sqrt(float(H))), sdn = fill(H * S, 0.2f);
  std::vector<int32_t> ids(R * K);
  std::vector<float> w(R * K);
  std::vector<int32_t> all(static_cast<size_t>(c.experts));
  std::iota(all.begin(), all.end(), 0);
  for (size_t r = 0; r < R; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t j = 0; j < K; ++j) ids[r * K + j] = all[j], w[r * K + j] = wdist(rng);
  }
  size_t clamped = 0;
  const auto want = gptoss_by_hand(c, x, ids, w, gu, gub, dn, db, sgu, sdn, prior, &clamped);
  if (c.limit > 0) CHECK(clamped > 0);  // the limit was exercised
  std::vector<float> got = prior;
  MoeExpertsArgs a;
  a.x = x.data(), a.ids = ids.data(), a.weights = w.data(), a.rows = c.rows, a.top_k = c.top_k;
  a.hidden = c.hidden, a.gate_up = gu.data(), a.down = dn.data(), a.expert0 = c.expert0;
  a.experts = c.held, a.inter = c.inter, a.accumulate = c.accumulate, a.out = got.data();
  a.shared_inter = c.shared, a.shared_gate_up = sgu.data(), a.shared_down = sdn.data();
  a.gate_up_bias = c.gate_up_bias ? gub.data() : nullptr;
  a.down_bias = c.down_bias ? db.data() : nullptr;
  a.interleaved = c.interleaved, a.swiglu_limit = c.limit, a.swiglu_alpha = c.alpha;
  moe_experts_ref(a);
  size_t bad = 0, moved = 0;
  for (size_t r = 0; r < R; ++r) {
    double mean = 0;
    for (size_t h = 0; h < H; ++h)
      mean += std::fabs(want[r * H + h] - (c.accumulate ? prior[r * H + h] : 0.f));
    mean /= static_cast<double>(H);
    for (size_t h = 0; h < H; ++h) {
      const size_t i = r * H + h;
      const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want[i]), 1e-30f)) - 7);
      bad += !(std::fabs(got[i] - want[i]) <= 2 * ulp + 0.01 * mean);
      moved += want[i] != (c.accumulate ? prior[i] : 0.f);
    }
  }
  CHECK(bad == 0);
  CHECK(moved > want.size() / 2);  // the experts did add something
}

}  // namespace

TEST_CASE("moe experts twin: gpt-oss's biases, interleaved gate/up and clamped activation") {
  std::mt19937 rng(20261206);
  const GptTwinCase cases[] = {
      // gpt-oss: interleaved, both biases, limit 7 and alpha 1.702, into the residual.
      {5, 4, 64, 32, 8, 0, 8, 0, true, true, true, true, 7.f, 1.702f},
      // No down bias (another rank adds it when experts are split by width).
      {4, 4, 64, 32, 8, 0, 8, 0, true, true, false, false, 7.f, 1.702f},
      // Expert parallel: experts [4, 8) of 12 held, the others add nothing here.
      {6, 4, 64, 24, 12, 4, 4, 0, true, true, true, false, 7.f, 1.702f},
      // Biases without interleave or limit: silu(gate + b) * (up + b); plain shared experts.
      {3, 2, 64, 16, 4, 0, 4, 16, false, true, true, true, 0.f, 0.f},
      // Interleaved and clamped with shared experts (which stay plain).
      {3, 4, 64, 16, 8, 0, 8, 32, true, true, true, false, 7.f, 1.702f},
  };
  for (const auto& c : cases) check_gptoss_twin(rng, c);
}

TEST_CASE("moe experts check: bad gpt-oss fields are refused, naming the field") {
  alignas(16) static uint16_t x[256], bias[256];
  alignas(16) static float work[8192];
  static int32_t ids[4];
  static float weights[4];
  MoeExpertsArgs a;
  a.x = x, a.ids = ids, a.weights = weights, a.out = x, a.rows = 1, a.top_k = 2;
  a.hidden = 64, a.inter = 32, a.experts = 4, a.gate_up = x, a.down = x;
  a.workspace = work, a.workspace_bytes = sizeof work;
  a.gate_up_bias = bias, a.down_bias = bias, a.interleaved = true;
  a.swiglu_limit = 7.f, a.swiglu_alpha = 1.702f;
  REQUIRE_MESSAGE(moe_experts_check(a).ok(), moe_experts_check(a).message());
  auto refused = [&](MoeExpertsArgs b, const std::string& field) {
    const auto s = moe_experts_check(b);
    CHECK_FALSE(s.ok());
    CHECK_MESSAGE(s.message().find(field) != std::string::npos, s.message());
  };
  {
    auto b = a;
    b.swiglu_limit = -1.f;
    refused(b, "swiglu_limit");
  }
  {
    auto b = a;
    b.swiglu_limit = NAN;
    refused(b, "swiglu_limit");
  }
  {
    auto b = a;
    b.swiglu_alpha = 0.f;  // a limit needs a slope
    refused(b, "swiglu_alpha");
  }
  {
    auto b = a;
    b.swiglu_alpha = INFINITY;
    refused(b, "swiglu_alpha");
  }
  {
    auto b = a;
    b.gate_up_bias = reinterpret_cast<const char*>(bias) + 1;
    refused(b, "gate_up_bias");
  }
  {
    auto b = a;
    b.down_bias = reinterpret_cast<const char*>(bias) + 1;
    refused(b, "down_bias");
  }
  {
    auto b = a;  // no limit: silu(gate) * up, alpha not needed
    b.swiglu_limit = 0.f, b.swiglu_alpha = 0.f;
    CHECK(moe_experts_check(b).ok());
  }
}
