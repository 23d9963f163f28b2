// Model forward pass against an independent naive implementation (double precision,
// contiguous attention, no paging), and paged/chunked/decode equivalence.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/strings.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/family.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

using Mat = std::vector<double>;

Mat load(const Checkpoint& ck, const std::string& name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> f(static_cast<size_t>(n));
  auto st = ck.read(name, shape, Slice{}, f.data());
  REQUIRE_MESSAGE(st.ok(), st.message());
  return Mat(f.begin(), f.end());
}

// y[T][out] = x[T][in] W^T
Mat matmul(const Mat& x, const Mat& w, int T, int in, int out) {
  Mat y(static_cast<size_t>(T * out));
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < out; ++o) {
      double s = 0;
      for (int i = 0; i < in; ++i)
        s += x[static_cast<size_t>(t * in + i)] * w[static_cast<size_t>(o * in + i)];
      y[static_cast<size_t>(t * out + o)] = s;
    }
  return y;
}

void rms(Mat& x, const Mat& w, int rows, int dim, double eps) {
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i)
      ss += x[static_cast<size_t>(r * dim + i)] * x[static_cast<size_t>(r * dim + i)];
    double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int i = 0; i < dim; ++i)
      x[static_cast<size_t>(r * dim + i)] *= inv * w[static_cast<size_t>(i)];
  }
}

// Independent RoPE: rotate-half with double angles; default or llama3 frequencies; the first
// rotary_dim elements of each head (partial rotary), the rest unrotated.
void rope(Mat& x, int T, int heads, int hd, const ModelConfig& c) {
  const int rd = c.rotary_dim > 0 ? c.rotary_dim : hd;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < rd / 2; ++i) {
        double f = std::pow(c.rope_theta, -2.0 * i / rd);
        if (c.rope.type == "llama3") {
          double wl = 2 * M_PI / f, lo = c.rope.original_max_position / c.rope.low_freq_factor,
                 hi = c.rope.original_max_position / c.rope.high_freq_factor;
          if (wl > lo)
            f /= c.rope.factor;
          else if (wl >= hi) {
            double s = (c.rope.original_max_position / wl - c.rope.low_freq_factor) /
                       (c.rope.high_freq_factor - c.rope.low_freq_factor);
            f = (1 - s) * f / c.rope.factor + s * f;
          }
        }
        double a = t * f;
        size_t base = static_cast<size_t>((t * heads + h) * hd);
        double x0 = x[base + static_cast<size_t>(i)],
               x1 = x[base + static_cast<size_t>(i + rd / 2)];
        x[base + static_cast<size_t>(i)] = x0 * std::cos(a) - x1 * std::sin(a);
        x[base + static_cast<size_t>(i + rd / 2)] = x1 * std::cos(a) + x0 * std::sin(a);
      }
}

// An independent router in double: (expert, weight) pairs of one row's logits, as
// transformers defines each scoring (see kernels/moe.h for the rules).
std::vector<std::pair<int, double>> naive_route(const std::vector<double>& lg,
                                                const std::vector<double>& bias,
                                                const MoeConfig& m) {
  const int E = m.experts;
  std::vector<double> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  if (m.score == RouterScore::softmax) {
    double mx = *std::max_element(lg.begin(), lg.end()), sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(lg[static_cast<size_t>(e)] - mx);
    for (int e = 0; e < E; ++e)
      choice[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] =
          std::exp(lg[static_cast<size_t>(e)] - mx) / sum;
  } else {
    for (int e = 0; e < E; ++e) {
      score[static_cast<size_t>(e)] = 1 / (1 + std::exp(-lg[static_cast<size_t>(e)]));
      choice[static_cast<size_t>(e)] =
          score[static_cast<size_t>(e)] + (bias.empty() ? 0.0 : bias[static_cast<size_t>(e)]);
    }
    if (m.n_group > 1) {
      const int per = E / m.n_group;
      std::vector<std::pair<double, int>> gs;
      for (int g = 0; g < m.n_group; ++g) {
        std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({v[0] + v[1], g});
      }
      std::sort(gs.begin(), gs.end(), [](auto a, auto b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      std::vector<bool> keep(static_cast<size_t>(m.n_group), false);
      for (int i = 0; i < m.topk_group; ++i)
        keep[static_cast<size_t>(gs[static_cast<size_t>(i)].second)] = true;
      for (int e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = -INFINITY;
    }
  }
  std::vector<int> order(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return choice[static_cast<size_t>(a)] > choice[static_cast<size_t>(b)];
  });
  std::vector<std::pair<int, double>> out;
  double sum = 0;
  for (int j = 0; j < m.top_k; ++j) {
    const int e = order[static_cast<size_t>(j)];
    out.push_back({e, score[static_cast<size_t>(e)]});
    sum += score[static_cast<size_t>(e)];
  }
  for (auto& [e, w] : out) {
    if (m.norm_topk) w /= sum;
    w *= m.routed_scaling;
  }
  return out;
}

// One gated SiLU MLP of the rows of h.
Mat naive_mlp(const Checkpoint& ck, const std::string& pre, const char* gate, const char* up,
              const char* down, const Mat& h, int T, int H, int I) {
  Mat g = matmul(h, load(ck, pre + gate + ".weight", {I, H}), T, H, I);
  Mat u = matmul(h, load(ck, pre + up + ".weight", {I, H}), T, H, I);
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
  return matmul(g, load(ck, pre + down + ".weight", {H, I}), T, I, H);
}

// All-position logits of `tokens` (positions 0..T-1).
Mat naive_forward(const std::string& dir, const ModelConfig& c,
                  const std::vector<int32_t>& tokens) {
  auto ck = Checkpoint::open(dir);
  REQUIRE(ck.ok());
  const int T = static_cast<int>(tokens.size()), H = c.hidden_size, hd = c.head_dim,
            NH = c.num_heads, NKV = c.num_kv_heads, I = c.intermediate_size, V = c.vocab_size;
  Mat emb = load(*ck, "model.embed_tokens.weight", {V, H});
  Mat x(static_cast<size_t>(T * H));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H; ++i)
      x[static_cast<size_t>(t * H + i)] =
          emb[static_cast<size_t>(tokens[static_cast<size_t>(t)] * H + i)];
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Mat h = x;
    rms(h, load(*ck, p + "input_layernorm.weight", {H}), T, H, c.rms_eps);
    Mat q = matmul(h, load(*ck, p + "self_attn.q_proj.weight", {NH * hd, H}), T, H, NH * hd);
    Mat k = matmul(h, load(*ck, p + "self_attn.k_proj.weight", {NKV * hd, H}), T, H, NKV * hd);
    Mat v = matmul(h, load(*ck, p + "self_attn.v_proj.weight", {NKV * hd, H}), T, H, NKV * hd);
    if (c.qkv_bias) {
      Mat bq = load(*ck, p + "self_attn.q_proj.bias", {NH * hd}),
          bk = load(*ck, p + "self_attn.k_proj.bias", {NKV * hd}),
          bv = load(*ck, p + "self_attn.v_proj.bias", {NKV * hd});
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < NH * hd; ++i)
          q[static_cast<size_t>(t * NH * hd + i)] += bq[static_cast<size_t>(i)];
        for (int i = 0; i < NKV * hd; ++i) {
          k[static_cast<size_t>(t * NKV * hd + i)] += bk[static_cast<size_t>(i)];
          v[static_cast<size_t>(t * NKV * hd + i)] += bv[static_cast<size_t>(i)];
        }
      }
    }
    if (c.qk_norm == QkNorm::per_head) {
      rms(q, load(*ck, p + "self_attn.q_norm.weight", {hd}), T * NH, hd, c.rms_eps);
      rms(k, load(*ck, p + "self_attn.k_norm.weight", {hd}), T * NKV, hd, c.rms_eps);
    } else if (c.qk_norm == QkNorm::per_layer) {
      rms(q, load(*ck, p + "self_attn.q_norm.weight", {NH * hd}), T, NH * hd, c.rms_eps);
      rms(k, load(*ck, p + "self_attn.k_norm.weight", {NKV * hd}), T, NKV * hd, c.rms_eps);
    }
    rope(q, T, NH, hd, c);
    rope(k, T, NKV, hd, c);
    Mat att(static_cast<size_t>(T * NH * hd), 0.0);
    for (int t = 0; t < T; ++t)
      for (int hh = 0; hh < NH; ++hh) {
        const int kvh = hh / (NH / NKV);
        const int first = c.sliding_window > 0 ? std::max(0, t - c.sliding_window + 1) : 0;
        std::vector<double> s;
        for (int u = first; u <= t; ++u) {
          double d = 0;
          for (int i = 0; i < hd; ++i)
            d += q[static_cast<size_t>((t * NH + hh) * hd + i)] *
                 k[static_cast<size_t>((u * NKV + kvh) * hd + i)];
          s.push_back(d / std::sqrt(static_cast<double>(hd)));
        }
        double mx = *std::max_element(s.begin(), s.end()), sum = 0;
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int u = first; u <= t; ++u)
          for (int i = 0; i < hd; ++i)
            att[static_cast<size_t>((t * NH + hh) * hd + i)] +=
                s[static_cast<size_t>(u - first)] / sum *
                v[static_cast<size_t>((u * NKV + kvh) * hd + i)];
      }
    Mat o = matmul(att, load(*ck, p + "self_attn.o_proj.weight", {H, NH * hd}), T, NH * hd, H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    h = x;
    rms(h, load(*ck, p + "post_attention_layernorm.weight", {H}), T, H, c.rms_eps);
    if (!c.moe.is_moe(l)) {
      Mat d = naive_mlp(*ck, p + "mlp.", "gate_proj", "up_proj", "down_proj", h, T, H, I);
      for (size_t i = 0; i < x.size(); ++i) x[i] += d[i];
      continue;
    }
    const auto& m = c.moe;
    const auto nm = moe_tensor_names(c.family);
    const std::string b = p + nm.block + ".";
    Mat lg = matmul(h, load(*ck, b + "gate.weight", {m.experts, H}), T, H, m.experts);
    Mat bias = m.correction_bias ? load(*ck, b + nm.bias, {m.experts}) : Mat();
    for (int t = 0; t < T; ++t) {
      std::vector<double> row(lg.begin() + t * m.experts, lg.begin() + (t + 1) * m.experts);
      Mat ht(h.begin() + t * H, h.begin() + (t + 1) * H);
      for (const auto& [e, w] : naive_route(row, bias, m)) {
        Mat y = naive_mlp(*ck, b + "experts." + std::to_string(e) + ".", nm.gate, nm.up, nm.down,
                          ht, 1, H, m.expert_inter);
        for (int i = 0; i < H; ++i)
          x[static_cast<size_t>(t * H + i)] += w * y[static_cast<size_t>(i)];
      }
    }
    if (m.shared_inter > 0) {
      Mat y = naive_mlp(*ck, b + nm.shared + ".", "gate_proj", "up_proj", "down_proj", h, T, H,
                        m.shared_inter);
      for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    }
  }
  rms(x, load(*ck, "model.norm.weight", {H}), T, H, c.rms_eps);
  Mat head = c.tie_word_embeddings ? emb : load(*ck, "lm_head.weight", {V, H});
  return matmul(x, head, T, H, V);
}

std::vector<int32_t> prompt_of(int n, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + 11) % (vocab - 3) + 3);
  return p;
}

struct Case {
  const char* name;
  ModelConfig cfg;
  DType dtype;
  int shards;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  auto llama = small_config(Family::llama);
  llama.rope.type = "llama3";
  llama.rope.factor = 8;
  llama.rope.low_freq_factor = 1;
  llama.rope.high_freq_factor = 4;
  llama.rope.original_max_position = 64;
  llama.rope_theta = 500000;
  out.push_back({"llama3-rope f32 sharded", llama, DType::f32, 3});
  auto qwen2 = small_config(Family::qwen2);
  qwen2.tie_word_embeddings = true;
  out.push_back({"qwen2 bias tied bf16", qwen2, DType::bf16, 1});
  auto qwen3 = small_config(Family::qwen3);
  qwen3.head_dim = 32;  // heads * head_dim != hidden
  out.push_back({"qwen3 qk-norm bf16", qwen3, DType::bf16, 2});
  auto mistral = small_config(Family::mistral);
  mistral.sliding_window = 7;
  out.push_back({"mistral sliding-window f32", mistral, DType::f32, 1});
  out.push_back({"qwen3-moe softmax top-2, a dense layer, bf16",
                 small_config(Family::qwen3_moe, 512, 64, 3), DType::bf16, 2});
  auto mixtral = small_config(Family::mixtral, 512, 64, 2);
  mixtral.sliding_window = 9;
  out.push_back({"mixtral top-2 sliding-window f32", mixtral, DType::f32, 1});
  out.push_back({"glm4-moe groups, bias, shared expert, partial rotary, dense first layer",
                 small_config(Family::glm4_moe, 512, 64, 3), DType::f32, 3});
  out.push_back({"minimax-m2 sigmoid, per-layer q/k norm, partial rotary",
                 small_config(Family::minimax_m2, 512, 64, 2), DType::bf16, 1});
  return out;
}

}  // namespace

TEST_CASE("model: forward pass matches an independent naive implementation for every family") {
  for (const auto& cs : cases()) {
    const std::string case_name = cs.name;
    CAPTURE(case_name);
    test::TempDir dir;
    REQUIRE(write_random_checkpoint(dir.path(), {cs.cfg, cs.dtype, 7, cs.shards}).ok());
    auto m = Model::load(dir.path(), 0, 1);
    REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
    const auto& c = (*m)->config();
    const auto prompt = prompt_of(20, c.vocab_size);
    const int bs = 4;
    KVCache cache(c.num_layers, 8, bs, (*m)->local_kv_heads(), c.head_dim);
    std::vector<int32_t> table = {5, 2, 7, 0, 3};  // scrambled blocks
    LocalCollective one;
    std::vector<float> logits;
    SeqChunk ch{prompt.data(), static_cast<int>(prompt.size()), 0, table.data(), true};
    REQUIRE((*m)->forward({ch}, cache, one, &logits, true).ok());
    Mat ref = naive_forward(dir.path(), c, prompt);
    REQUIRE(logits.size() == ref.size());
    double worst = 0, mag = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, std::abs(logits[i] - ref[i]));
      mag = std::max(mag, std::abs(ref[i]));
    }
    MESSAGE(std::string(cs.name) << ": max |logit diff| " << worst << " (max |logit| " << mag
                                 << ")");
    CHECK(worst < 1e-3);
    CHECK(mag > 1.0);  // logits are not degenerate
  }
}

TEST_CASE("model: prefill in one chunk, in uneven chunks and token by token give the same logits") {
  test::TempDir dir;
  auto cfg = small_config(Family::qwen3);
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::f32, 3, 1}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE(m.ok());
  const auto& c = (*m)->config();
  const auto prompt = prompt_of(23, c.vocab_size);
  LocalCollective one;
  auto run = [&](const std::vector<int>& chunk_sizes, std::vector<int32_t> table) {
    KVCache cache(c.num_layers, 16, 4, (*m)->local_kv_heads(), c.head_dim);
    std::vector<float> logits;
    int pos = 0;
    for (int n : chunk_sizes) {
      SeqChunk ch{prompt.data() + pos, n, pos, table.data(), true};
      REQUIRE((*m)->forward({ch}, cache, one, &logits).ok());
      pos += n;
    }
    REQUIRE(pos == 23);
    return logits;
  };
  auto one_chunk = run({23}, {0, 1, 2, 3, 4, 5});
  auto uneven = run({5, 1, 9, 8}, {9, 3, 12, 1, 15, 0});
  std::vector<int> ones(23, 1);
  auto decode = run(ones, {15, 14, 13, 12, 11, 10});
  REQUIRE(one_chunk.size() == static_cast<size_t>(c.vocab_size));
  for (size_t i = 0; i < one_chunk.size(); ++i) {
    CHECK(uneven[i] == doctest::Approx(one_chunk[i]).epsilon(1e-4));
    CHECK(decode[i] == doctest::Approx(one_chunk[i]).epsilon(1e-4));
  }
}

TEST_CASE("model: two sequences batched in one step equal each run alone") {
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::llama), DType::f32, 4, 1}).ok());
  auto m = Model::load(dir.path(), 0, 1);
  REQUIRE(m.ok());
  const auto& c = (*m)->config();
  auto a = prompt_of(9, c.vocab_size), b = prompt_of(14, c.vocab_size - 50);
  LocalCollective one;
  std::vector<int32_t> ta = {0, 1, 2, 3}, tb = {4, 5, 6, 7};
  KVCache cache(c.num_layers, 8, 4, (*m)->local_kv_heads(), c.head_dim);
  std::vector<float> both, la, lb;
  REQUIRE((*m)->forward({{a.data(), 9, 0, ta.data(), true}, {b.data(), 14, 0, tb.data(), true}},
                        cache, one, &both)
              .ok());
  REQUIRE((*m)->forward({{a.data(), 9, 0, ta.data(), true}}, cache, one, &la).ok());
  REQUIRE((*m)->forward({{b.data(), 14, 0, tb.data(), true}}, cache, one, &lb).ok());
  const size_t V = static_cast<size_t>(c.vocab_size);
  REQUIRE(both.size() == 2 * V);
  for (size_t i = 0; i < V; ++i) {
    CHECK(both[i] == doctest::Approx(la[i]).epsilon(1e-5));
    CHECK(both[V + i] == doctest::Approx(lb[i]).epsilon(1e-5));
  }
}

TEST_CASE("model: unsupported architectures and bad configs are clear errors") {
  auto r = parse_model_config(R"({"architectures":["GPT2LMHeadModel"],"vocab_size":10})",
                              "/m/config.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::unsupported);
  CHECK(r.error().message.find("GPT2LMHeadModel") != std::string::npos);
  CHECK(r.error().message.find("Qwen3ForCausalLM") != std::string::npos);
  auto y = parse_model_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,"intermediate_size":8,)"
      R"("num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"rope_type":"dynamic","factor":4}})",
      "c.json");
  REQUIRE_FALSE(y.ok());
  CHECK(y.error().code == Errc::unsupported);
  CHECK(y.error().message.find("dynamic") != std::string::npos);
  auto missing = parse_model_config(R"({"architectures":["LlamaForCausalLM"]})", "c.json");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == Errc::config);
  // transformers 5 style rope_parameters.
  auto v5 = parse_model_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,"intermediate_size":8,)"
      R"("num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"rope_parameters":{"rope_type":"llama3",)"
      R"("rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},)"
      R"("eos_token_id":[5,6]})",
      "c.json");
  REQUIRE_MESSAGE(v5.ok(), (v5.ok() ? std::string() : v5.error().message));
  CHECK(v5->rope.type == "llama3");
  CHECK(v5->rope_theta == 500000.0);
  CHECK(v5->eos_token_ids == std::vector<int>{5, 6});
  CHECK(v5->num_kv_heads == 1);
}

TEST_CASE("model: absurd or nonsense config.json values are refused with the key and the file") {
  const std::string base =
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,)"
      R"("intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2)";
  auto err = [&](const std::string& extra) {
    auto r = parse_model_config(base + extra + "}", "/m/config.json");
    return r.ok() ? std::string() : r.error().message;
  };
  CHECK(err("").empty());
  for (const auto& c : std::vector<std::pair<std::string, std::string>>{
           {R"(,"hidden_size":1000000000)", "hidden_size"},
           {R"(,"vocab_size":1000000000)", "vocab_size"},
           {R"(,"head_dim":1000000000)", "head_dim"},
           {R"(,"max_position_embeddings":0)", "max_position_embeddings"},
           {R"(,"rms_norm_eps":-1)", "rms_norm_eps"},
           {R"(,"rms_norm_eps":0)", "rms_norm_eps"},
           {R"(,"rope_theta":0)", "rope_theta"},
           {R"(,"num_hidden_layers":100000)", "num_hidden_layers"},
           {R"(,"bos_token_id":10)", "bos_token_id"}}) {
    const std::string& extra = c.first;
    const std::string& key = c.second;
    CAPTURE(extra);
    std::string m = err(extra);
    CHECK(m.find("/m/config.json") != std::string::npos);
    CHECK(m.find("\"" + key + "\"") != std::string::npos);
  }
}

TEST_CASE("model: config.json sizes that disagree with the checkpoint fail before allocating") {
  test::TempDir dir("model-shapes");
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::llama), DType::f32, 4, 1}).ok());
  auto cj = read_file(dir.path() + "/config.json");
  REQUIRE(cj);
  auto j = nlohmann::json::parse(*cj);
  j["vocab_size"] = 1 << 22;  // 4M rows of 64: 1 GiB of fp32 if it were allocated
  j["intermediate_size"] = 1 << 19;
  REQUIRE(write_file_atomic(dir.path() + "/config.json", j.dump(), nullptr));
  struct rusage before {};
  ::getrusage(RUSAGE_SELF, &before);
  auto m = Model::load(dir.path(), 0, 1, nullptr);
  struct rusage after {};
  ::getrusage(RUSAGE_SELF, &after);
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().message.find("model.embed_tokens.weight") != std::string::npos);
  CHECK(m.error().message.find("config.json implies") != std::string::npos);
  // The refusal came from the shape pass, not after a gigabyte was taken.
  CHECK(after.ru_maxrss - before.ru_maxrss < 256 * 1024);  // KiB
}

TEST_CASE("model: a load stops at the next tensor when cancelled") {
  test::TempDir dir("model-cancel");
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::llama), DType::f32, 4, 1}).ok());
  std::atomic<bool> cancel{true};
  LoadReport rep;
  rep.cancel = &cancel;
  auto m = Model::load(dir.path(), 0, 1, &rep);
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().message.find("shutting down") != std::string::npos);
  cancel = false;
  CHECK(Model::load(dir.path(), 0, 1, &rep).ok());
}

TEST_CASE("model: TP slicing needs divisible head counts") {
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::llama), DType::f32, 4, 1}).ok());
  auto m = Model::load(dir.path(), 0, 3);
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code == Errc::config);
  CHECK(m.error().message.find("tensor parallel size 3") != std::string::npos);
  LoadReport full, half;
  std::vector<std::pair<uint64_t, uint64_t>> seen;  // the load's progress, tensor by tensor
  full.progress = [&](uint64_t done, uint64_t total) { seen.emplace_back(done, total); };
  REQUIRE(Model::load(dir.path(), 0, 1, &full).ok());
  REQUIRE(seen.size() > 2);
  for (size_t i = 1; i < seen.size(); ++i) {
    CHECK(seen[i].first > seen[i - 1].first);
    CHECK(seen[i].second == seen[0].second);
  }
  CHECK(seen.back().first == seen.back().second);  // all of it, at the end
  CHECK(seen.back().second == full.bytes_read);
  REQUIRE(Model::load(dir.path(), 1, 2, &half).ok());
  // A rank of two reads its slices of the split matrices, not everything.
  CHECK(half.bytes_read < full.bytes_read);
  CHECK(half.weight_bytes < full.weight_bytes);
}

TEST_CASE("model: loading leaves none of the weight files in the page cache") {
  test::TempDir dir;
  REQUIRE(
      write_random_checkpoint(dir.path(), {small_config(Family::mistral), DType::bf16, 5, 2}).ok());
  auto resident = [](const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    struct stat st {};
    ::fstat(fd, &st);
    const size_t len = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> v((len + page - 1) / page);
    REQUIRE(::mincore(p, len, v.data()) == 0);
    size_t n = 0;
    for (auto b : v) n += b & 1;
    ::munmap(p, len);
    ::close(fd);
    return n;
  };
  const std::string f1 = dir / "model-00001-of-00002.safetensors",
                    f2 = dir / "model-00002-of-00002.safetensors";
  CHECK(resident(f1) > 0);  // just written: cached
  LoadReport rep;
  auto m = Model::load(dir.path(), 0, 1, &rep);
  REQUIRE(m.ok());
  CHECK(rep.files.size() == 2);
  CHECK(resident(f1) == 0);
  CHECK(resident(f2) == 0);
}
