// DeepSeek-V3 (multi-head latent attention) on the CPU: the engine's forward pass against an
// independent double-precision implementation written here from the architecture as
// transformers' DeepseekV3ForCausalLM defines it (q LoRA or q_proj; kv_a_proj_with_mqa into
// a normalised latent and a shared RoPE key; kv_b_proj expanding per-head keys and values;
// RoPE over interleaved pairs as apply_rotary_pos_emb_interleave rotates them; YaRN with
// mscale on cos/sin and mscale_all_dim on the softmax; the grouped sigmoid router with its
// correction bias, a shared expert and a first dense layer). The reference expands every
// head's keys and values; the engine keeps the latent and attends with kv_b_proj absorbed.
// Also: chunked prefill over the latent cache, decode, greedy tokens, two ranks, FP8 weights,
// the cache's size against `sparkctl plan`, and what config.json may not say. Against
// transformers itself: the deepseek_v3 fixtures of tools/gen_reference_hub.py.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/model_plan.h"
#include "core/strings.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/collective.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/kv_cache.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/tempdir.h"
#include "support/tp_threads.h"

using namespace spark;
using namespace spark::engine;

namespace {

using Mat = std::vector<double>;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// 3 layers (the first dense), 4 heads: q LoRA 32, latent 32 + RoPE key 8, nope 16, v 16;
// 8 experts of 32 in 4 groups (2 kept), 2 a token, a shared expert.
ModelConfig config(bool q_lora = true) {
  auto c = small_config(Family::deepseek_v3, 384, 64, 3);
  c.eos_token_ids = {};
  if (!q_lora) c.mla.q_lora_rank = 0;
  return c;
}

Mat floats(const Checkpoint& ck, const std::string& name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> f(static_cast<size_t>(n));
  auto st = ck.read(name, shape, Slice{}, f.data());
  REQUIRE_MESSAGE(st.ok(), st.message());
  return Mat(f.begin(), f.end());
}

// y[T][out] = x[T][in] W^T
Mat affine(const Mat& x, const double* w, int T, int in, int out) {
  Mat y(static_cast<size_t>(T * out));
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < out; ++o) {
      double s = 0;
      for (int i = 0; i < in; ++i) s += x[static_cast<size_t>(t * in + i)] * w[o * in + i];
      y[static_cast<size_t>(t * out + o)] = s;
    }
  return y;
}

void rms(Mat& x, const Mat& w, int rows, int dim, double eps) {
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i)
      ss += x[static_cast<size_t>(r * dim + i)] * x[static_cast<size_t>(r * dim + i)];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int i = 0; i < dim; ++i)
      x[static_cast<size_t>(r * dim + i)] *= inv * w[static_cast<size_t>(i)];
  }
}

double silu(double v) {
  return v / (1 + std::exp(-v));
}

// A gated SiLU MLP of one row.
Mat mlp(const Mat& row, const Mat& g, const Mat& u, const Mat& d, int H, int I) {
  Mat a = affine(row, g.data(), 1, H, I), b = affine(row, u.data(), 1, H, I);
  for (int i = 0; i < I; ++i)
    a[static_cast<size_t>(i)] = silu(a[static_cast<size_t>(i)]) * b[static_cast<size_t>(i)];
  return affine(a, d.data(), 1, I, H);
}

// What the reference may leave out, to show the fixture tells each part apart.
struct Knobs {
  bool interleave = true;  // RoPE over interleaved pairs (else over halves)
  bool mscale = true;      // mscale_all_dim's factor on the softmax scale
};

// All-position logits of `tok`, as transformers computes DeepSeek-V3, in double.
Mat naive(const std::string& dir, const ModelConfig& c, const std::vector<int32_t>& tok,
          Knobs k = {}) {
  auto ck = Checkpoint::open(dir);
  REQUIRE(ck.ok());
  const auto& a = c.mla;
  const auto& mo = c.moe;
  const int T = static_cast<int>(tok.size()), H = c.hidden_size, V = c.vocab_size, NH = c.num_heads;
  const int nope = a.qk_nope, R = a.qk_rope, qk = nope + R, vd = a.v_head_dim, kr = a.kv_lora_rank,
            qr = a.q_lora_rank;
  // YaRN over the RoPE key's R dims, from its definition (truncate: the correction range's
  // ends rounded outward).
  const auto& rs = c.rope;
  const double base = c.rope_theta;
  auto corr = [&](double rot) {
    return R * std::log(rs.original_max_position / (rot * 2 * M_PI)) / (2 * std::log(base));
  };
  double lo = std::max(0.0, std::floor(corr(rs.beta_fast))),
         hi = std::min(std::ceil(corr(rs.beta_slow)), R - 1.0);
  if (lo == hi) hi += 0.001;
  std::vector<double> inv(static_cast<size_t>(R / 2));
  for (int i = 0; i < R / 2; ++i) {
    const double pf = std::pow(base, 2.0 * i / R);
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    inv[static_cast<size_t>(i)] = ramp / (rs.factor * pf) + (1 - ramp) / pf;
  }
  auto ms = [&](double m) { return 0.1 * m * std::log(rs.factor) + 1.0; };
  const double af = ms(*rs.mscale) / ms(*rs.mscale_all_dim);  // on cos and sin
  double scale = 1.0 / std::sqrt(static_cast<double>(qk));
  if (k.mscale) scale *= ms(*rs.mscale_all_dim) * ms(*rs.mscale_all_dim);
  // transformers' interleaved RoPE: the R values regrouped as [x0, x2, ..., x1, x3, ...],
  // then rotate-half with cos/sin scaled by af.
  auto rope = [&](double* x, int pos) {
    std::vector<double> y(static_cast<size_t>(R));
    for (int i = 0; i < R; ++i)
      y[static_cast<size_t>(i)] = k.interleave ? x[i < R / 2 ? 2 * i : 2 * (i - R / 2) + 1] : x[i];
    for (int i = 0; i < R / 2; ++i) {
      const double ang = pos * inv[static_cast<size_t>(i)];
      const double c0 = std::cos(ang) * af, s0 = std::sin(ang) * af;
      const double y0 = y[static_cast<size_t>(i)], y1 = y[static_cast<size_t>(i + R / 2)];
      x[i] = y0 * c0 - y1 * s0;
      x[i + R / 2] = y1 * c0 + y0 * s0;
    }
  };
  Mat emb = floats(*ck, "model.embed_tokens.weight", {V, H});
  Mat x(static_cast<size_t>(T * H));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H; ++i)
      x[static_cast<size_t>(t * H + i)] =
          emb[static_cast<size_t>(tok[static_cast<size_t>(t)] * H + i)];
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l), at = p + "self_attn.";
    Mat h = x;
    rms(h, floats(*ck, p + "input_layernorm.weight", {H}), T, H, c.rms_eps);
    Mat q;
    if (qr > 0) {
      Mat qa = affine(h, floats(*ck, at + "q_a_proj.weight", {qr, H}).data(), T, H, qr);
      rms(qa, floats(*ck, at + "q_a_layernorm.weight", {qr}), T, qr, c.rms_eps);
      q = affine(qa, floats(*ck, at + "q_b_proj.weight", {NH * qk, qr}).data(), T, qr, NH * qk);
    } else {
      q = affine(h, floats(*ck, at + "q_proj.weight", {NH * qk, H}).data(), T, H, NH * qk);
    }
    Mat kva =
        affine(h, floats(*ck, at + "kv_a_proj_with_mqa.weight", {kr + R, H}).data(), T, H, kr + R);
    Mat lat(static_cast<size_t>(T * kr)), kpe(static_cast<size_t>(T * R));
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < kr; ++i)
        lat[static_cast<size_t>(t * kr + i)] = kva[static_cast<size_t>(t * (kr + R) + i)];
      for (int i = 0; i < R; ++i)
        kpe[static_cast<size_t>(t * R + i)] = kva[static_cast<size_t>(t * (kr + R) + kr + i)];
      rope(kpe.data() + t * R, t);
      for (int hh = 0; hh < NH; ++hh) rope(q.data() + (t * NH + hh) * qk + nope, t);
    }
    rms(lat, floats(*ck, at + "kv_a_layernorm.weight", {kr}), T, kr, c.rms_eps);
    // Every head's keys [k_nope | k_pe] and values, expanded.
    Mat kv = affine(lat, floats(*ck, at + "kv_b_proj.weight", {NH * (nope + vd), kr}).data(), T, kr,
                    NH * (nope + vd));
    Mat att(static_cast<size_t>(T * NH * vd), 0.0);
    for (int t = 0; t < T; ++t)
      for (int hh = 0; hh < NH; ++hh) {
        const double* qh = q.data() + (t * NH + hh) * qk;
        std::vector<double> s;
        double mx = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const double* kj = kv.data() + (j * NH + hh) * (nope + vd);
          double d = 0;
          for (int i = 0; i < nope; ++i) d += qh[i] * kj[i];
          for (int i = 0; i < R; ++i) d += qh[nope + i] * kpe[static_cast<size_t>(j * R + i)];
          s.push_back(d * scale);
          mx = std::max(mx, s.back());
        }
        double sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int j = 0; j <= t; ++j)
          for (int i = 0; i < vd; ++i)
            att[static_cast<size_t>((t * NH + hh) * vd + i)] +=
                s[static_cast<size_t>(j)] / sum *
                kv[static_cast<size_t>((j * NH + hh) * (nope + vd) + nope + i)];
      }
    Mat o = affine(att, floats(*ck, at + "o_proj.weight", {H, NH * vd}).data(), T, NH * vd, H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    h = x;
    rms(h, floats(*ck, p + "post_attention_layernorm.weight", {H}), T, H, c.rms_eps);
    const std::string m = p + "mlp.";
    if (!mo.is_moe(l)) {
      const int I = c.intermediate_size;
      Mat g = floats(*ck, m + "gate_proj.weight", {I, H}),
          u = floats(*ck, m + "up_proj.weight", {I, H}),
          d = floats(*ck, m + "down_proj.weight", {H, I});
      for (int t = 0; t < T; ++t) {
        Mat y = mlp(Mat(h.begin() + t * H, h.begin() + (t + 1) * H), g, u, d, H, I);
        for (int i = 0; i < H; ++i) x[static_cast<size_t>(t * H + i)] += y[static_cast<size_t>(i)];
      }
      continue;
    }
    const int E = mo.experts, K = mo.top_k, I = mo.expert_inter, G = mo.n_group, per = E / G;
    Mat rw = floats(*ck, m + "gate.weight", {E, H}),
        bias = floats(*ck, m + "gate.e_score_correction_bias", {E});
    Mat logits = affine(h, rw.data(), T, H, E);
    std::vector<Mat> eg, eu, ed;
    for (int e = 0; e < E; ++e) {
      const std::string ex = fmt::format("{}experts.{}.", m, e);
      eg.push_back(floats(*ck, ex + "gate_proj.weight", {I, H}));
      eu.push_back(floats(*ck, ex + "up_proj.weight", {I, H}));
      ed.push_back(floats(*ck, ex + "down_proj.weight", {H, I}));
    }
    const int SI = mo.shared_inter;
    Mat sg = floats(*ck, m + "shared_experts.gate_proj.weight", {SI, H}),
        su = floats(*ck, m + "shared_experts.up_proj.weight", {SI, H}),
        sd = floats(*ck, m + "shared_experts.down_proj.weight", {H, SI});
    for (int t = 0; t < T; ++t) {
      std::vector<double> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) {
        score[static_cast<size_t>(e)] = 1 / (1 + std::exp(-logits[static_cast<size_t>(t * E + e)]));
        choice[static_cast<size_t>(e)] =
            score[static_cast<size_t>(e)] + bias[static_cast<size_t>(e)];
      }
      // Groups scored by their top-2 choice values; the best topk_group kept, the rest 0.
      std::vector<double> gs(static_cast<size_t>(G));
      for (int g = 0; g < G; ++g) {
        std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs[static_cast<size_t>(g)] = v[0] + v[1];
      }
      std::vector<int> go(static_cast<size_t>(G));
      for (int g = 0; g < G; ++g) go[static_cast<size_t>(g)] = g;
      std::stable_sort(go.begin(), go.end(), [&](int a1, int b1) {
        return gs[static_cast<size_t>(a1)] > gs[static_cast<size_t>(b1)];
      });
      std::vector<bool> keep(static_cast<size_t>(G), false);
      for (int i = 0; i < mo.topk_group; ++i)
        keep[static_cast<size_t>(go[static_cast<size_t>(i)])] = true;
      for (int e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = 0.0;
      std::vector<int> order(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
      std::stable_sort(order.begin(), order.end(), [&](int a1, int b1) {
        return choice[static_cast<size_t>(a1)] > choice[static_cast<size_t>(b1)];
      });
      double wsum = 0;
      for (int j = 0; j < K; ++j) wsum += score[static_cast<size_t>(order[static_cast<size_t>(j)])];
      const Mat row(h.begin() + t * H, h.begin() + (t + 1) * H);
      for (int j = 0; j < K; ++j) {
        const int e = order[static_cast<size_t>(j)];
        double wt = score[static_cast<size_t>(e)];
        if (mo.norm_topk) wt /= wsum + 1e-20;
        wt *= mo.routed_scaling;
        Mat y = mlp(row, eg[static_cast<size_t>(e)], eu[static_cast<size_t>(e)],
                    ed[static_cast<size_t>(e)], H, I);
        for (int i = 0; i < H; ++i)
          x[static_cast<size_t>(t * H + i)] += wt * y[static_cast<size_t>(i)];
      }
      Mat y = mlp(row, sg, su, sd, H, SI);
      for (int i = 0; i < H; ++i) x[static_cast<size_t>(t * H + i)] += y[static_cast<size_t>(i)];
    }
  }
  rms(x, floats(*ck, "model.norm.weight", {H}), T, H, c.rms_eps);
  return affine(x, floats(*ck, "lm_head.weight", {V, H}).data(), T, H, V);
}

std::vector<int32_t> prompt(int n, int salt = 0) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + 11 + salt * 13) % 380 + 3);
  return p;
}

// max |a - b| over max |b|: the bound is relative to the logits' scale.
double rel_diff(const std::vector<float>& a, const Mat& b) {
  REQUIRE(a.size() == b.size());
  double w = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    w = std::max(w, std::abs(a[i] - b[i]));
    mag = std::max(mag, std::abs(b[i]));
  }
  return w / mag;
}

// The stated bound: fp32 engine (absorbed kv_b_proj) against the double reference (expanded
// keys and values), relative to the largest logit.
constexpr double kBound = 1e-5;

Result<std::shared_ptr<Device>> cpu(int) {
  return make_cpu_device();
}

// All-position logits of `tok` through the engine in one chunk (block size 4: many blocks).
std::vector<float> engine_logits(Model& m, const std::vector<int32_t>& tok) {
  auto cache = m.make_kv_cache(16, 4, ElemType::f32);
  REQUIRE(cache.ok());
  std::vector<int32_t> table = {9, 2, 14, 0, 5, 11, 3, 7, 1, 12, 6, 15};
  LocalCollective one;
  std::vector<float> logits;
  SeqChunk ch{tok.data(), static_cast<int>(tok.size()), 0, table.data(), true};
  auto st = m.forward({ch}, **cache, one, &logits, true);
  REQUIRE_MESSAGE(st.ok(), st.message());
  return logits;
}

}  // namespace

TEST_CASE("DeepSeek-V3: the forward pass matches an independent implementation (q LoRA)") {
  test::TempDir dir;
  const auto cfg = config();
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 31, 2}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  const auto& c = (*m)->config();
  CHECK(c.family == Family::deepseek_v3);
  CHECK(c.is_mla());
  CHECK(c.mla.q_lora_rank == 32);
  CHECK_FALSE(c.moe.is_moe(0));
  CHECK(c.moe.is_moe(1));
  const auto tok = prompt(21);
  const auto logits = engine_logits(**m, tok);
  const Mat ref = naive(dir.path(), c, tok);
  double mag = 0;
  for (double v : ref) mag = std::max(mag, std::abs(v));
  const double d = rel_diff(logits, ref);
  MESSAGE("DeepSeek-V3 q LoRA: max |logit diff| / max |logit| = " << d << " (max |logit| " << mag
                                                                  << ")");
  CHECK(d < kBound);
  CHECK(mag > 1.0);
  // The fixture tells the RoPE layout and the softmax's mscale apart: without either, the
  // reference moves far beyond the bound.
  CHECK(rel_diff(logits, naive(dir.path(), c, tok, {false, true})) > 100 * kBound);
  CHECK(rel_diff(logits, naive(dir.path(), c, tok, {true, false})) > 100 * kBound);
}

TEST_CASE("DeepSeek-V3: direct q_proj (q_lora_rank null) matches the reference") {
  test::TempDir dir;
  REQUIRE(write_random_checkpoint(dir.path(), {config(false), DType::f32, 37, 1}).ok());
  const auto cj = nlohmann::json::parse(*read_file(dir / "config.json"));
  CHECK(cj["q_lora_rank"].is_null());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  CHECK((*m)->config().mla.q_lora_rank == 0);
  const auto tok = prompt(17, 1);
  const double d = rel_diff(engine_logits(**m, tok), naive(dir.path(), (*m)->config(), tok));
  MESSAGE("DeepSeek-V3 direct q: max |logit diff| / max |logit| = " << d);
  CHECK(d < kBound);
}

TEST_CASE("DeepSeek-V3: chunked prefill over the latent cache, then decode, and greedy tokens") {
  test::TempDir dir;
  REQUIRE(write_random_checkpoint(dir.path(), {config(), DType::f32, 41, 1}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE(m.ok());
  const auto& c = (*m)->config();
  const int bs = 4;
  auto cache = (*m)->make_kv_cache(12, bs, ElemType::f32);
  REQUIRE(cache.ok());
  // The cache holds the latent and the RoPE key per token and nothing per head.
  CHECK((*cache)->bytes() ==
        static_cast<size_t>(c.num_layers) * 12 * bs * (32 + 8) * sizeof(float));
  std::vector<int32_t> table = {7, 3, 10, 0, 5, 1, 8, 11, 2};
  LocalCollective one;
  // A prompt of 14 in chunks of 6 and 8 (each past a block), then 6 decode steps of the
  // engine's own greedy tokens.
  std::vector<int32_t> seq = prompt(14, 2);
  std::vector<float> got;  // logits of every position the engine computed, in order
  for (auto [start, n] : {std::pair{0, 6}, std::pair{6, 8}}) {
    std::vector<float> lg;
    SeqChunk ch{seq.data() + start, n, start, table.data(), true};
    REQUIRE((*m)->forward({ch}, **cache, one, &lg, true).ok());
    got.insert(got.end(), lg.begin(), lg.end());
  }
  const int V = c.vocab_size;
  auto argmax = [&](const float* row) {
    return static_cast<int32_t>(std::max_element(row, row + V) - row);
  };
  for (int step = 0; step < 6; ++step) {
    seq.push_back(argmax(got.data() + (seq.size() - 1) * static_cast<size_t>(V)));
    std::vector<float> lg;
    SeqChunk ch{seq.data() + seq.size() - 1, 1, static_cast<int>(seq.size()) - 1, table.data(),
                true};
    REQUIRE((*m)->forward({ch}, **cache, one, &lg).ok());
    got.insert(got.end(), lg.begin(), lg.end());
  }
  const std::vector<int32_t>& fed = seq;  // 20 tokens, every one through the engine
  REQUIRE(got.size() == fed.size() * static_cast<size_t>(V));
  const Mat ref = naive(dir.path(), c, fed);
  const double d = rel_diff(got, ref);
  MESSAGE("DeepSeek-V3 chunked prefill + decode: max |logit diff| / max |logit| = " << d);
  CHECK(d < kBound);
  // Greedy: the reference picks the engine's tokens at every decode step.
  for (size_t t = 13; t + 1 < fed.size(); ++t) {
    const double* row = ref.data() + t * static_cast<size_t>(V);
    CHECK(static_cast<int32_t>(std::max_element(row, row + V) - row) == seq[t + 1]);
  }
}

TEST_CASE("DeepSeek-V3: two ranks (heads split, latent on both) give one rank's logits") {
  test::TempDir dir;
  REQUIRE(write_random_checkpoint(dir.path(), {config(), DType::f32, 43, 1}).ok());
  std::vector<int32_t> a = prompt(11, 3), b = prompt(6, 4);
  for (int i = 0; i < 5; ++i) {
    a.push_back(static_cast<int32_t>((i * 41 + 7) % 380 + 3));
    b.push_back(static_cast<int32_t>((i * 29 + 5) % 380 + 3));
  }
  const std::vector<test::TpSeq> seqs = {{a, 11}, {b, 6}};
  auto one = test::run_tp_threads(dir.path(), 1, seqs, cpu);
  REQUIRE_MESSAGE(one.error.empty(), one.error);
  auto two = test::run_tp_threads(dir.path(), 2, seqs, cpu);
  REQUIRE_MESSAGE(two.error.empty(), two.error);
  const double d = test::max_logit_diff(one, two);
  MESSAGE("DeepSeek-V3 x2: max |logit diff| " << d);
  CHECK(d < 1e-4);
  CHECK(two.bytes_read_rank0 < one.bytes_read_rank0);
  // Rank 1 of 2 holds heads 2 and 3: rows [2 x 24, 4 x 24) of q_b_proj, the same of kv_b_proj
  // by its 32-wide heads, o_proj's columns [32, 64); the latent's weights whole.
  auto mc = load_model_config(dir.path());
  REQUIRE(mc.ok());
  auto p = make_shard_plan(*mc, 1, 2, dir.path());
  REQUIRE(p.ok());
  CHECK(p->heads == 2);
  int seen = 0;
  for (const auto& r : p->reads) {
    if (r.layer != 0) continue;
    CAPTURE(r.tensor);
    if (contains(r.tensor, "q_b_proj")) {
      CHECK(r.slice.row0 == 48);
      CHECK(r.rows == 48);
      ++seen;
    } else if (contains(r.tensor, "kv_b_proj")) {
      CHECK(r.slice.row0 == 64);
      CHECK(r.rows == 64);
      ++seen;
    } else if (contains(r.tensor, "o_proj")) {
      CHECK(r.slice.col0 == 32);
      CHECK(r.cols == 32);
      ++seen;
    } else if (contains(r.tensor, "kv_a_proj_with_mqa")) {
      CHECK(r.slice.row0 == 0);
      CHECK(r.rows == 40);
      ++seen;
    }
  }
  CHECK(seen == 4);
}

TEST_CASE("DeepSeek-V3: FP8 block-scaled weights give their dequantized twin's logits") {
  test::TempDir q, deq;
  RandomCheckpointSpec s{config(), DType::f32, 47, 1};
  s.fp8 = true;
  REQUIRE(write_random_checkpoint(q.path(), s).ok());
  s.fp8_dequantized = true;
  REQUIRE(write_random_checkpoint(deq.path(), s).ok());
  auto a = Model::load(q.path(), 0, 1), b = Model::load(deq.path(), 0, 1);
  REQUIRE_MESSAGE(a.ok(), (a.ok() ? std::string() : a.error().message));
  REQUIRE(b.ok());
  CHECK((*a)->config().weights.fp8());
  const auto tok = prompt(9, 5);
  const auto la = engine_logits(**a, tok), lb = engine_logits(**b, tok);
  REQUIRE(la.size() == lb.size());
  double w = 0;
  for (size_t i = 0; i < la.size(); ++i)
    w = std::max(w, static_cast<double>(std::abs(la[i] - lb[i])));
  CHECK(w == 0.0);  // widening e4m3 x scale into fp32 is exact
}

TEST_CASE("DeepSeek-V3: the latent cache's size is what sparkctl plan counts") {
  // DeepSeek-V3's real widths: the V3.2 fixture without its indexer.
  std::string text = *read_file(std::string(SPARK_SOURCE_DIR) +
                                "/tests/fixtures/models/plan/deepseek-v3.2/config.json");
  auto j = nlohmann::json::parse(text);
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = "deepseek_v3";
  for (const char* k : {"index_head_dim", "index_n_heads", "index_topk"}) j.erase(k);
  auto c = parse_model_config(j.dump(), "v3/config.json");
  REQUIRE_MESSAGE(c.ok(), (c.ok() ? std::string() : c.error().message));
  CHECK(c->mla.cache_width() == 576);
  // The parameters DeepSeek-V3 is published with: 671B in all, 37B active (the MTP layer
  // apart).
  const ParamCount pc = count_params(*c);
  MESSAGE("DeepSeek-V3: " << pc.total << " parameters, " << pc.active << " active");
  CHECK(pc.total > 670e9);
  CHECK(pc.total < 672e9);
  CHECK(pc.active > 36.5e9);
  CHECK(pc.active < 38e9);
  auto shape = plan::model_shape(j, "v3/config.json");
  REQUIRE(shape.ok());
  for (int world : {1, 2, 8}) {
    CAPTURE(world);
    const KVShape ks = kv_shape(*c, c->num_heads / world);
    CHECK(ks.pools == 1);
    CHECK(ks.n_kv_heads * ks.head_dim == 576);  // whole on every rank
    for (auto [type, name] :
         {std::pair{ElemType::f32, "fp32"}, std::pair{ElemType::bf16, "bf16"}}) {
      const uint64_t engine = KVCache::block_bytes(type, c->num_layers, 16, ks);
      const uint64_t planned =
          16 * plan::kv_bytes_per_token_per_rank(*shape, {plan::KvLayout::native, name},
                                                 plan::KvSpread{world, 1});
      CHECK(engine == planned);
      CHECK(engine == 61ull * 16 * 576 * elem_size(type));
    }
  }
  // A loaded model sizes its blocks the same way.
  test::TempDir dir;
  REQUIRE(write_random_checkpoint(dir.path(), {config(), DType::bf16, 3, 1}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE(m.ok());
  CHECK((*m)->kv_block_bytes(ElemType::f32, 16) == 3ull * 16 * (32 + 8) * 4);
}

TEST_CASE("DeepSeek-V3: config.json it cannot run is refused by field and value") {
  test::TempDir dir;
  REQUIRE(write_random_checkpoint(dir.path(), {config(), DType::bf16, 5, 1}).ok());
  const auto text = *read_file(dir / "config.json");
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(text);
    edit(j);
    auto r = parse_model_config(j.dump(), "/m/config.json");
    return r.ok() ? std::string() : r.error().message;
  };
  CHECK(with([](auto&) {}).empty());
  const std::string v32 = with([](auto& j) { j["index_topk"] = 2048; });
  CHECK(contains(v32, "\"index_topk\" = 2048"));
  CHECK(contains(v32, "DeepSeek-V3.2"));
  CHECK(contains(with([](auto& j) { j["attention_bias"] = true; }), "\"attention_bias\" = true"));
  CHECK(contains(with([](auto& j) {
                   j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
                 }),
                 "\"rope_scaling\" = \"llama3\""));
  CHECK(contains(with([](auto& j) {
                   j["rope_scaling"] = {{"rope_type", "longrope"}};
                 }),
                 "longrope"));
  CHECK(
      contains(with([](auto& j) { j["topk_method"] = "greedy"; }), "\"topk_method\" = \"greedy\""));
  CHECK(contains(with([](auto& j) { j["scoring_func"] = "softmax"; }), "\"scoring_func\""));
  CHECK(contains(with([](auto& j) { j["moe_layer_freq"] = 2; }), "\"moe_layer_freq\" = 2"));
  CHECK(contains(with([](auto& j) { j.erase("kv_lora_rank"); }), "kv_lora_rank 1 to 8192 (got 0)"));
  CHECK(contains(with([](auto& j) { j["qk_rope_head_dim"] = 7; }), "even qk_rope_head_dim"));
}

TEST_CASE(
    "DeepSeek-V3: the engine sizes its latent cache from the budget and serves greedy "
    "requests, the second from the prefix cache") {
  test::TempDir dir;
  const auto cfg = config();
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 53, 1}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE(m.ok());
  EngineOptions o;
  o.slots = 2;
  o.block_size = 4;
  o.max_context = 64;
  // 40 blocks of 4 tokens at 3 layers x (32 + 8) fp32 values per token: 1920 bytes a block.
  o.kv_cache_bytes = 40ull * 3 * 4 * (32 + 8) * 4;
  auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), o);
  REQUIRE_MESSAGE(eng.ok(), (eng.ok() ? std::string() : eng.error().message));
  CHECK((*eng)->stats().blocks_total == 32);  // two full contexts of 64 fit in the 40
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 5;
  const auto tok = prompt(13, 6);
  auto first = generate_blocking(**eng, tok, p);
  REQUIRE_MESSAGE(first.ok(), (first.ok() ? std::string() : first.error().message));
  auto second = generate_blocking(**eng, tok, p);
  REQUIRE(second.ok());
  CHECK(second->cached_prompt_tokens >= 8);  // whole blocks of the prompt, read back
  CHECK(second->tokens[0] == first->tokens[0]);
  // The reference's greedy path.
  std::vector<int32_t> seq = tok;
  for (int s = 0; s < 5; ++s) {
    const Mat ref = naive(dir.path(), cfg, seq);
    const double* row = ref.data() + (seq.size() - 1) * static_cast<size_t>(cfg.vocab_size);
    seq.push_back(static_cast<int32_t>(std::max_element(row, row + cfg.vocab_size) - row));
  }
  CHECK(std::vector<int32_t>(seq.begin() + 13, seq.end()) == first->tokens[0]);
}

TEST_CASE("DeepSeek-V3: synthetic weights of the shape run, holding what the plan says") {
  const auto c = config();
  LoadReport rep;
  auto m = Model::synthetic(c, 0, 1, make_cpu_device(), 9, &rep);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  CHECK(rep.weight_bytes == (*m)->shard_plan().held_bytes(4, 4));
  const auto logits = engine_logits(**m, prompt(6, 7));
  REQUIRE(logits.size() == 6u * static_cast<size_t>(c.vocab_size));
  for (float v : logits) REQUIRE(std::isfinite(v));
  CHECK((*m)->describe()["latent_attention"]["cache_values_per_token"] == 40);
}
