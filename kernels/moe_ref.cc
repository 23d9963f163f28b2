#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/moe.h"

namespace spark::kernels {
namespace {

// Is (va, a) ahead of (vb, b): the larger value, equal values by the lower index.
inline bool ahead(float va, int a, float vb, int b) {
  return va > vb || (va == vb && a < b);
}

}  // namespace

Status moe_route_check(const MoeRouteArgs& a) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "moe route: " + std::move(m)); };
  if (a.experts < 1 || a.experts > kMoeMaxExperts)
    return bad(fmt::format("{} experts: must be 1 to {}", a.experts, kMoeMaxExperts));
  if (a.top_k < 1 || a.top_k > a.experts || a.top_k > kMoeMaxTopK)
    return bad(fmt::format("top_k {} must be 1 to min({}, {})", a.top_k, a.experts, kMoeMaxTopK));
  if (a.n_group < 1 || a.experts % a.n_group != 0 || a.topk_group < 1 || a.topk_group > a.n_group)
    return bad(fmt::format("n_group {} must divide {} experts, topk_group {} be 1 to n_group",
                           a.n_group, a.experts, a.topk_group));
  if (a.n_group > 1 && (!a.sigmoid || a.experts / a.n_group < 2))
    return bad("groups need sigmoid scores and at least 2 experts a group");
  if (!std::isfinite(a.scaling)) return bad("scaling must be finite");
  return Status::Ok();
}

void moe_route_ref(const float* logits, const float* bias, const MoeRouteArgs& a, size_t rows,
                   int32_t* ids, float* weights, float* margin) {
  const int E = a.experts, K = a.top_k;
  std::vector<float> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  std::vector<int> order(static_cast<size_t>(E));
  for (size_t r = 0; r < rows; ++r) {
    const float* lg = logits + r * static_cast<size_t>(E);
    if (a.sigmoid) {
      for (int e = 0; e < E; ++e) {
        const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(lg[e])));
        score[static_cast<size_t>(e)] = static_cast<float>(s);
        choice[static_cast<size_t>(e)] =
            bias ? static_cast<float>(s) + bias[e] : static_cast<float>(s);
      }
      if (a.n_group > 1) {
        // Each group's score is the sum of its two largest choice values; the best
        // topk_group groups stay, the other experts leave the choice.
        const int per = E / a.n_group;
        std::vector<float> gscore(static_cast<size_t>(a.n_group));
        for (int g = 0; g < a.n_group; ++g) {
          float m1 = -INFINITY, m2 = -INFINITY;
          for (int e = g * per; e < (g + 1) * per; ++e) {
            const float v = choice[static_cast<size_t>(e)];
            if (v > m1) {
              m2 = m1;
              m1 = v;
            } else if (v > m2) {
              m2 = v;
            }
          }
          gscore[static_cast<size_t>(g)] = m1 + m2;
        }
        std::vector<int> gorder(static_cast<size_t>(a.n_group));
        for (int g = 0; g < a.n_group; ++g) gorder[static_cast<size_t>(g)] = g;
        std::partial_sort(
            gorder.begin(), gorder.begin() + a.topk_group, gorder.end(), [&](int x, int y) {
              return ahead(gscore[static_cast<size_t>(x)], x, gscore[static_cast<size_t>(y)], y);
            });
        std::vector<uint8_t> keep(static_cast<size_t>(a.n_group), 0);
        for (int i = 0; i < a.topk_group; ++i)
          keep[static_cast<size_t>(gorder[static_cast<size_t>(i)])] = 1;
        for (int e = 0; e < E; ++e)
          if (!keep[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = -INFINITY;
      }
    } else {
      // Softmax in double over the row (transformers: fp32 softmax), rounded to float.
      double mx = -INFINITY;
      for (int e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(lg[e]));
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += std::exp(static_cast<double>(lg[e]) - mx);
      for (int e = 0; e < E; ++e) {
        score[static_cast<size_t>(e)] =
            static_cast<float>(std::exp(static_cast<double>(lg[e]) - mx) / sum);
        choice[static_cast<size_t>(e)] = score[static_cast<size_t>(e)];
      }
    }
    for (int e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    const int keep = std::min(E, K + 1);
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int x, int y) {
      return ahead(choice[static_cast<size_t>(x)], x, choice[static_cast<size_t>(y)], y);
    });
    int32_t* id = ids + r * static_cast<size_t>(K);
    float* w = weights + r * static_cast<size_t>(K);
    double sum = 0;
    for (int j = 0; j < K; ++j) {
      id[j] = order[static_cast<size_t>(j)];
      w[j] = score[static_cast<size_t>(id[j])];
      sum += w[j];
    }
    if (a.norm_topk) {
      const double den = a.sigmoid ? sum + 1e-20 : sum;
      for (int j = 0; j < K; ++j) w[j] = static_cast<float>(w[j] / den);
    }
    if (a.scaling != 1.f)
      for (int j = 0; j < K; ++j) w[j] *= a.scaling;
    if (margin) {
      margin[2 * r] = choice[static_cast<size_t>(order[static_cast<size_t>(K - 1)])];
      margin[2 * r + 1] =
          K < E ? choice[static_cast<size_t>(order[static_cast<size_t>(K)])] : -INFINITY;
    }
  }
}

}  // namespace spark::kernels

namespace spark::kernels {

namespace {

// The e4m3 value of byte v (OCP "fn": bias 7, no infinities, 0x7f/0xff NaN), exact.
double e4m3_value(uint8_t v) {
  const int e = (v >> 3) & 15, m = v & 7;
  double f;
  if (e == 15 && m == 7)
    f = NAN;
  else if (e == 0)
    f = std::ldexp(m, -9);  // subnormal: m / 8 * 2^-6
  else
    f = std::ldexp(8 + m, e - 10);  // (1 + m / 8) * 2^(e - 7)
  return (v & 0x80) ? -f : f;
}

// A weight matrix of the twin: rows of host floats, or rows `row0 + r` of an FP8 weight
// (host bytes and scales), widened exactly in double.
// Or rows `row0 + r` of an MXFP4 weight (host codes and scale bytes), likewise exact.
struct RefWeight {
  const float* f = nullptr;  // [rows][cols], when not FP8 or MXFP4
  const Fp8Weight* q = nullptr;
  const Mxfp4Weight* m = nullptr;
  size_t row0 = 0, cols = 0;
  double at(size_t r, size_t c) const {
    if (m) {
      const size_t row = row0 + r;
      const uint8_t byte = m->blocks[row * m->ldb + c / 2];
      const uint8_t code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
      return static_cast<double>(mxfp4_e2m1_value(code)) *
             mxfp4_scale_value(m->scales[row * m->lds + c / kMxfp4BlockK]);
    }
    if (!q) return f[r * cols + c];
    const size_t row = row0 + r;
    return e4m3_value(q->q[row * q->ldq + c]) *
           static_cast<double>(q->scales[(row >> q->row_shift) * q->scale_ld + c / kFp8BlockK]);
  }
};

}  // namespace

void moe_experts_ref(const MoeExpertsArgs& a) {
  const size_t H = static_cast<size_t>(a.hidden), R = static_cast<size_t>(a.rows),
               K = static_cast<size_t>(a.top_k);
  const float* x = static_cast<const float*>(a.x);
  float* out = static_cast<float*>(a.out);
  // One gated MLP of row r through weights gu [2n][H] and dn [H][n], added into acc * w.
  // gpt-oss (routed experts): gub [2n] and db [H] biases (or null), gate/up rows 2i and
  // 2i + 1 when `inter` (interleaved), the clamped activation when `limit` > 0.
  struct Gpt {
    const float* gub = nullptr;
    const float* db = nullptr;
    bool inter = false;
    double limit = 0, alpha = 0;
  };
  auto mlp = [&](size_t r, const RefWeight& gu, const RefWeight& dn, size_t n, double w,
                 const Gpt& o, std::vector<double>* acc) {
    std::vector<float> act(n);
    for (size_t i = 0; i < n; ++i) {
      const size_t gi = o.inter ? 2 * i : i, ui = o.inter ? 2 * i + 1 : n + i;
      double g = o.gub ? o.gub[gi] : 0.0, u = o.gub ? o.gub[ui] : 0.0;
      for (size_t c = 0; c < H; ++c) {
        g += gu.at(gi, c) * x[r * H + c];
        u += gu.at(ui, c) * x[r * H + c];
      }
      double v;
      if (o.limit > 0) {
        g = std::min(g, o.limit);
        u = std::clamp(u, -o.limit, o.limit);
        v = (u + 1.0) * g / (1.0 + std::exp(-o.alpha * g));
      } else {
        v = g / (1.0 + std::exp(-g)) * u;
      }
      act[i] = round_to(DType::bf16, static_cast<float>(v));
    }
    for (size_t h = 0; h < H; ++h) {
      double s = o.db ? o.db[h] : 0.0;
      for (size_t i = 0; i < n; ++i) s += dn.at(h, i) * act[i];
      (*acc)[h] += w * static_cast<float>(s);
    }
  };
  const size_t I = static_cast<size_t>(a.inter), S = static_cast<size_t>(a.shared_inter);
  // Expert le's weights (the stacked MXFP4 or FP8 rows, or its float matrices).
  auto weights_of = [&](size_t le) {
    RefWeight gu, dn;
    gu.cols = H, dn.cols = I;
    if (a.gate_up_mx4.blocks) {
      gu.m = &a.gate_up_mx4, gu.row0 = le * 2 * I;
      dn.m = &a.down_mx4, dn.row0 = le * H;
    } else if (a.gate_up_fp8.q) {
      gu.q = &a.gate_up_fp8, gu.row0 = le * 2 * I;
      dn.q = &a.down_fp8, dn.row0 = le * H;
    } else {
      gu.f = static_cast<const float*>(a.gate_up) + le * 2 * I * H;
      dn.f = static_cast<const float*>(a.down) + le * H * I;
    }
    return std::pair{gu, dn};
  };
  RefWeight sgu, sdn;
  sgu.cols = H, sdn.cols = S;
  if (a.shared_gate_up_fp8.q) {
    sgu.q = &a.shared_gate_up_fp8, sdn.q = &a.shared_down_fp8;
  } else {
    sgu.f = static_cast<const float*>(a.shared_gate_up);
    sdn.f = static_cast<const float*>(a.shared_down);
  }
  for (size_t r = 0; r < R; ++r) {
    std::vector<double> acc(H, 0.0);
    // Ascending expert id, as the device sums them.
    std::vector<std::pair<int, size_t>> chosen;
    for (size_t j = 0; j < K; ++j) chosen.emplace_back(a.ids[r * K + j], j);
    std::sort(chosen.begin(), chosen.end());
    for (const auto& [e, j] : chosen) {
      if (e < a.expert0 || e >= a.expert0 + a.experts) continue;
      const size_t le = static_cast<size_t>(e - a.expert0);
      const auto [gu, dn] = weights_of(le);
      Gpt o;
      if (a.gate_up_bias) o.gub = static_cast<const float*>(a.gate_up_bias) + le * 2 * I;
      if (a.down_bias) o.db = static_cast<const float*>(a.down_bias) + le * H;
      o.inter = a.interleaved, o.limit = a.swiglu_limit, o.alpha = a.swiglu_alpha;
      mlp(r, gu, dn, I, a.weights[r * K + j], o, &acc);
    }
    if (a.shared_inter > 0) mlp(r, sgu, sdn, S, 1.0, Gpt{}, &acc);
    for (size_t h = 0; h < H; ++h) {
      const double prior = a.accumulate ? out[r * H + h] : 0.0;
      out[r * H + h] = round_to(DType::bf16, static_cast<float>(prior + acc[h]));
    }
  }
}

MoeWorkspaceLayout moe_workspace_layout(int rows, int top_k, int hidden, int inter,
                                        int shared_inter, int experts) {
  MoeWorkspaceLayout w;
  w.groups = experts + (shared_inter > 0 ? 1 : 0);
  w.pairs = rows * top_k + (shared_inter > 0 ? rows : 0);
  w.act_stride = std::max(inter, shared_inter);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t o = at;
    at += (bytes + 255) / 256 * 256;
    return o;
  };
  const size_t G = static_cast<size_t>(w.groups), P = static_cast<size_t>(w.pairs);
  w.counts = take(sizeof(int32_t) * G);
  w.row_off = take(sizeof(int32_t) * (G + 1));
  w.tile_off = take(sizeof(int32_t) * (G + 1));
  w.pos = take(sizeof(int32_t) * P);
  w.row_src = take(sizeof(int32_t) * P);
  w.act = take(2 * P * static_cast<size_t>(w.act_stride));
  w.y = take(sizeof(float) * P * static_cast<size_t>(hidden));
  w.total = at;
  return w;
}

size_t moe_experts_workspace_bytes(int rows, int top_k, int hidden, int inter, int shared_inter,
                                   int experts) {
  return moe_workspace_layout(rows, top_k, hidden, inter, shared_inter, experts).total;
}

Status moe_experts_check(const MoeExpertsArgs& a) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "moe experts: " + std::move(m)); };
  if (a.rows < 0 || a.top_k < 1 || a.top_k > kMoeMaxTopK)
    return bad(fmt::format("rows {} / top_k {} out of range", a.rows, a.top_k));
  if (a.hidden <= 0 || a.hidden % 8 != 0 || a.inter % 8 != 0 || a.shared_inter % 8 != 0 ||
      a.inter < 0 || a.shared_inter < 0 || (a.experts > 0 && a.inter <= 0))
    return bad(
        fmt::format("hidden {}, inter {} and shared inter {} must be multiples of 8 "
                    "(16-byte rows)",
                    a.hidden, a.inter, a.shared_inter));
  if (a.experts < 0 || a.expert0 < 0)
    return bad(fmt::format("experts [{}, +{}) out of range", a.expert0, a.experts));
  if (a.form < 0 || a.form > 4) return bad(fmt::format("form {} is not 0 to 4", a.form));
  if (a.form == 1 && a.rows > kMoeDecodeMaxRows)
    return bad(
        fmt::format("the decode form takes at most {} rows, not {}", kMoeDecodeMaxRows, a.rows));
  // FP8 weights: both matrices of a set FP8, each one's stride, scales and alignment.
  auto fp8 = [&](const Fp8Weight& w, const char* name, int cols) -> Status {
    const size_t need_ld = (static_cast<size_t>(cols) + kFp8BlockK - 1) / kFp8BlockK;
    if (!w.q || !w.scales) return bad(fmt::format("{}: null bytes or scales", name));
    if (w.ldq < static_cast<size_t>(cols))
      return bad(fmt::format("{}.ldq {} is less than its {} columns", name, w.ldq, cols));
    if (w.ldq % 8 != 0 || reinterpret_cast<uintptr_t>(w.q) % 8 != 0)
      return bad(fmt::format("{}: q and ldq ({}) must be multiples of 8 bytes", name, w.ldq));
    if (reinterpret_cast<uintptr_t>(w.scales) % alignof(float) != 0)
      return bad(fmt::format("{}.scales must be 4-byte aligned", name));
    if (w.scale_ld < need_ld)
      return bad(fmt::format("{}.scale_ld {} is less than ceil({} / {}) = {}", name, w.scale_ld,
                             cols, kFp8BlockK, need_ld));
    if (w.row_shift != 0 && w.row_shift != 7)
      return bad(fmt::format("{}.row_shift {} must be 0 or 7", name, w.row_shift));
    return Status::Ok();
  };
  const bool routed_fp8 = a.gate_up_fp8.q || a.down_fp8.q;
  const bool shared_fp8 = a.shared_gate_up_fp8.q || a.shared_down_fp8.q;
  if (routed_fp8) {
    SPARK_TRY(fp8(a.gate_up_fp8, "gate_up_fp8", a.hidden));
    SPARK_TRY(fp8(a.down_fp8, "down_fp8", a.inter));
  }
  if (shared_fp8) {
    SPARK_TRY(fp8(a.shared_gate_up_fp8, "shared_gate_up_fp8", a.hidden));
    SPARK_TRY(fp8(a.shared_down_fp8, "shared_down_fp8", a.shared_inter));
  }
  // MXFP4 experts: both matrices, 32-column blocks, 16-byte rows; no FP8 beside them.
  const bool routed_mx4 = a.gate_up_mx4.blocks || a.down_mx4.blocks;
  if (routed_mx4) {
    if (routed_fp8 || shared_fp8)
      return bad("MXFP4 experts (gate_up_mx4/down_mx4) with FP8 weights (*_fp8): one format");
    if (a.hidden % kMxfp4BlockK != 0 || a.inter % kMxfp4BlockK != 0)
      return bad(fmt::format("MXFP4 experts need hidden {} and inter {} multiples of {}", a.hidden,
                             a.inter, kMxfp4BlockK));
    for (const auto& [w, name, k] : {std::tuple{&a.gate_up_mx4, "gate_up_mx4", a.hidden},
                                     std::tuple{&a.down_mx4, "down_mx4", a.inter}}) {
      const Status s = mxfp4_weight_check(*w, static_cast<size_t>(k), name);
      if (!s.ok()) return bad(s.message());
    }
  }
  // gpt-oss's fields: the biases read one bf16 at a time, the activation's constants.
  if (reinterpret_cast<uintptr_t>(a.gate_up_bias) % 2 != 0)
    return bad("gate_up_bias must be 2-byte aligned");
  if (reinterpret_cast<uintptr_t>(a.down_bias) % 2 != 0)
    return bad("down_bias must be 2-byte aligned");
  if (!std::isfinite(a.swiglu_limit) || a.swiglu_limit < 0.f)
    return bad(fmt::format("swiglu_limit {} must be finite and >= 0 (0: silu(gate) * up)",
                           a.swiglu_limit));
  if (!std::isfinite(a.swiglu_alpha) || (a.swiglu_limit > 0.f && !(a.swiglu_alpha > 0.f)))
    return bad(
        fmt::format("swiglu_alpha {} must be finite, and > 0 with a swiglu_limit", a.swiglu_alpha));
  if (!a.x || !a.ids || !a.weights || !a.out ||
      (a.experts > 0 && !routed_fp8 && !routed_mx4 && (!a.gate_up || !a.down)) ||
      (a.shared_inter > 0 && !shared_fp8 && (!a.shared_gate_up || !a.shared_down)))
    return bad("a null operand");
  for (const void* p :
       {a.x, a.gate_up, a.down, a.shared_gate_up, a.shared_down, static_cast<const void*>(a.out)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return bad("operands must be 16-byte aligned");
  const size_t need =
      moe_experts_workspace_bytes(a.rows, a.top_k, a.hidden, a.inter, a.shared_inter, a.experts);
  if (!a.workspace || a.workspace_bytes < need)
    return bad(fmt::format("workspace of {} bytes, {} needed", a.workspace_bytes, need));
  return Status::Ok();
}

// The CUDA kernels' shared-memory cap (moe.h); kept here, which every build compiles.
namespace {
std::atomic<size_t> g_moe_smem_cap{0};
}  // namespace

void set_moe_smem_cap(size_t bytes) {
  g_moe_smem_cap.store(bytes);
}
size_t moe_smem_cap() {
  return g_moe_smem_cap.load();
}

}  // namespace spark::kernels
