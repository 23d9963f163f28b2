// The router's twin (kernels/moe.h): each scoring rule on hand-made rows whose answer is known,
// the tie rule, and the expert products' twin on a row worked out by hand.
#include "kernels/moe.h"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kernels/dtype.h"

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
