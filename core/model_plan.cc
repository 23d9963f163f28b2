#include "core/model_plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace spark::plan {

using nlohmann::json;

namespace {

uint64_t u(int64_t v) {
  return static_cast<uint64_t>(std::max<int64_t>(v, 0));
}
uint64_t ceil_div(uint64_t a, uint64_t b) {
  return b == 0 ? 0 : (a + b - 1) / b;
}

// An integer field; absent and null read as 0. A present field of another type, or out of
// range, is an error naming it.
Status get_int(const json& j, const char* key, int* out, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1ll << 30))
    return make_error(Errc::config,
                      fmt::format("{}: \"{}\" must be a non-negative integer", where, key));
  *out = it->get<int>();
  return Status::Ok();
}

int dtype_size(const std::string& dt) {
  if (dt == "float32") return 4;
  if (dt.find("float8") != std::string::npos) return 1;
  return 2;
}

// Heads of `heads` on one of `ranks` ranks: a head is never split, and with fewer heads than
// ranks every rank holds one (replicated).
uint64_t heads_per_rank(int heads, int ranks) {
  return std::max<uint64_t>(1, ceil_div(u(heads), u(std::max(ranks, 1))));
}

uint64_t next_pow2(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

Result<LayerKind> kind_of(const std::string& t, bool mla, bool sparse, const std::string& where,
                          size_t i) {
  if (t == "full_attention" || t == "attention" || t == "global_attention")
    return mla ? (sparse ? LayerKind::sparse_mla : LayerKind::mla) : LayerKind::full_attention;
  if (t == "sliding_attention" || t == "sliding_window_attention" || t == "local_attention")
    return LayerKind::sliding_attention;
  if (t == "linear_attention") return LayerKind::linear_attention;
  if (t == "deepseek_sparse_attention") return LayerKind::sparse_mla;
  return make_error(Errc::config,
                    fmt::format("{}: layer_types[{}] is \"{}\", a layer type the planner does "
                                "not know (known: full_attention, sliding_attention, "
                                "linear_attention, deepseek_sparse_attention)",
                                where, i, t));
}

}  // namespace

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::full_attention:
      return "full_attention";
    case LayerKind::sliding_attention:
      return "sliding_attention";
    case LayerKind::mla:
      return "mla";
    case LayerKind::sparse_mla:
      return "deepseek_sparse_attention";
    case LayerKind::linear_attention:
      return "linear_attention";
  }
  return "?";
}

const char* kv_layout_name(KvLayout l) {
  return l == KvLayout::vllm ? "vllm" : "native";
}

const char* moe_split_name(MoeSplit m) {
  switch (m) {
    case MoeSplit::automatic:
      return "auto";
    case MoeSplit::tensor:
      return "tp";
    case MoeSplit::expert:
      return "ep";
  }
  return "?";
}

Result<MoeSplit> parse_moe_split(const std::string& s) {
  if (s.empty() || s == "auto") return MoeSplit::automatic;
  if (s == "tp") return MoeSplit::tensor;
  if (s == "ep") return MoeSplit::expert;
  return make_error(Errc::config, fmt::format("EXPERT_PARALLEL={} is not one of auto, tp, ep", s));
}

bool experts_split_evenly(int inter, int ranks, int block) {
  ranks = std::max(ranks, 1);
  block = std::max(block, 1);
  // One rank holds every expert whole: no scale block is cut, whatever the width.
  return inter > 0 && inter % ranks == 0 && (ranks == 1 || (inter / ranks) % block == 0);
}

MoeSplit resolve_moe_split(MoeSplit split, const ModelShape& s, int ranks) {
  if (split != MoeSplit::automatic) return split;
  if (ranks <= 1 || s.experts <= 0 || s.expert_inter <= 0) return MoeSplit::tensor;
  return experts_split_evenly(s.expert_inter, ranks, s.expert_block) ? MoeSplit::tensor
                                                                     : MoeSplit::expert;
}

int ModelShape::count(LayerKind k) const {
  return static_cast<int>(std::count(kinds.begin(), kinds.end(), k));
}

Result<ModelShape> model_shape(const json& top, const std::string& where) {
  // The fields core/hf reads are checked there first, so a file it refuses is refused here
  // with its words.
  if (auto checked = hf::parse_config(top, where); !checked) return checked.error();
  const bool nested = !top.contains("num_hidden_layers") && top.contains("text_config") &&
                      top["text_config"].is_object();
  const json& c = nested ? top["text_config"] : top;
  const std::string w = nested ? where + " text_config" : where;
  ModelShape s;
  if (top.contains("architectures") && top["architectures"].is_array() &&
      !top["architectures"].empty() && top["architectures"][0].is_string())
    s.arch = top["architectures"][0].get<std::string>();
  if (c.contains("model_type") && c["model_type"].is_string())
    s.model_type = c["model_type"].get<std::string>();
  else if (top.contains("model_type") && top["model_type"].is_string())
    s.model_type = top["model_type"].get<std::string>();
  if (s.arch.empty()) s.arch = s.model_type;
  std::string dt = "bfloat16";
  for (const json* j : {&top, &c})
    for (const char* k : {"torch_dtype", "dtype"})
      if (j->contains(k) && (*j)[k].is_string()) dt = (*j)[k].get<std::string>();
  s.dtype_bytes = dtype_size(dt);

  SPARK_TRY(get_int(c, "num_hidden_layers", &s.layers, w));
  SPARK_TRY(get_int(c, "max_position_embeddings", &s.max_position, w));
  SPARK_TRY(get_int(c, "num_attention_heads", &s.heads, w));
  SPARK_TRY(get_int(c, "num_key_value_heads", &s.kv_heads, w));
  if (s.kv_heads == 0) s.kv_heads = s.heads;
  SPARK_TRY(get_int(c, "head_dim", &s.head_dim, w));
  int hidden = 0;
  SPARK_TRY(get_int(c, "hidden_size", &hidden, w));
  if (s.head_dim == 0 && s.heads > 0) s.head_dim = hidden / s.heads;
  SPARK_TRY(get_int(c, "kv_lora_rank", &s.kv_lora_rank, w));
  SPARK_TRY(get_int(c, "qk_rope_head_dim", &s.qk_rope_head_dim, w));
  SPARK_TRY(get_int(c, "index_head_dim", &s.index_head_dim, w));
  SPARK_TRY(get_int(c, "index_kpool", &s.index_kpool, w));
  if (s.index_kpool < 1) s.index_kpool = 1;
  int window = 0;
  SPARK_TRY(get_int(c, "sliding_window", &window, w));
  const bool use_window =
      !(c.contains("use_sliding_window") && c["use_sliding_window"].is_boolean() &&
        !c["use_sliding_window"].get<bool>());
  s.sliding_window = window;
  // Experts: the names differ by family.
  for (const char* k : {"n_routed_experts", "num_experts", "num_local_experts"})
    if (s.experts == 0) SPARK_TRY(get_int(c, k, &s.experts, w));
  SPARK_TRY(get_int(c, "num_experts_per_tok", &s.experts_active, w));
  // One expert's width: Mixtral, MiniMax and gpt-oss use intermediate_size for it.
  SPARK_TRY(get_int(c, "moe_intermediate_size", &s.expert_inter, w));
  if (s.experts > 0 && s.expert_inter == 0)
    SPARK_TRY(get_int(c, "intermediate_size", &s.expert_inter, w));
  if (auto q = c.find("quantization_config"); q != c.end() && q->is_object()) {
    const std::string method = q->value("quant_method", "");
    if (method == "mxfp4") s.expert_block = 32;
    if (method == "fp8") s.expert_block = 128;
    if (auto b = q->find("weight_block_size");
        b != q->end() && b->is_array() && b->size() == 2 && (*b)[0].is_number_integer())
      s.expert_block = std::max(1, (*b)[0].get<int>());
  }
  SPARK_TRY(get_int(c, "num_nextn_predict_layers", &s.mtp_layers, w));
  // Linear attention: GLM-5-Next's KDA, or Qwen3-Next's gated delta net.
  if (c.contains("linear_num_heads") || c.contains("linear_head_dim")) {
    s.linear = LinearFamily::kda;
    SPARK_TRY(get_int(c, "linear_num_heads", &s.linear_v_heads, w));
    SPARK_TRY(get_int(c, "linear_head_dim", &s.linear_v_dim, w));
    s.linear_k_heads = s.linear_v_heads;
    s.linear_k_dim = s.linear_v_dim;
  } else if (c.contains("linear_num_value_heads")) {
    s.linear = LinearFamily::gated_delta_net;
    SPARK_TRY(get_int(c, "linear_num_key_heads", &s.linear_k_heads, w));
    SPARK_TRY(get_int(c, "linear_num_value_heads", &s.linear_v_heads, w));
    SPARK_TRY(get_int(c, "linear_key_head_dim", &s.linear_k_dim, w));
    SPARK_TRY(get_int(c, "linear_value_head_dim", &s.linear_v_dim, w));
  }
  SPARK_TRY(get_int(c, "linear_conv_kernel_dim", &s.linear_conv_kernel, w));

  if (s.layers <= 0)
    return make_error(Errc::config,
                      fmt::format("{}: num_hidden_layers is missing or not positive", w));
  const bool mla = s.kv_lora_rank > 0;
  const bool sparse = mla && (s.index_head_dim > 0 || c.contains("index_topk"));
  int every = 0;
  SPARK_TRY(get_int(c, "full_attention_interval", &every, w));
  auto lt = c.find("layer_types");
  if (lt != c.end() && !lt->is_null()) {
    if (!lt->is_array() || lt->size() != static_cast<size_t>(s.layers))
      return make_error(Errc::config,
                        fmt::format("{}: layer_types must list one type for each of the {} "
                                    "layers (it has {})",
                                    w, s.layers, lt->is_array() ? lt->size() : 0));
    for (size_t i = 0; i < lt->size(); ++i) {
      if (!(*lt)[i].is_string())
        return make_error(Errc::config, fmt::format("{}: layer_types[{}] is not a string", w, i));
      auto k = kind_of((*lt)[i].get<std::string>(), mla, sparse, w, i);
      if (!k) return k.error();
      s.kinds.push_back(*k);
    }
  } else if (every > 0 && s.linear != LinearFamily::none) {
    // Qwen3-Next without layer_types: every `every`-th layer is full attention, the rest
    // linear (transformers' Qwen3NextConfig default).
    for (int i = 0; i < s.layers; ++i)
      s.kinds.push_back((i + 1) % every ? LayerKind::linear_attention : LayerKind::full_attention);
  } else {
    LayerKind k = mla                          ? (sparse ? LayerKind::sparse_mla : LayerKind::mla)
                  : (window > 0 && use_window) ? LayerKind::sliding_attention
                                               : LayerKind::full_attention;
    s.kinds.assign(static_cast<size_t>(s.layers), k);
  }
  // A DSA layer runs its own indexer unless indexer_types says it reuses another's.
  s.indexer.assign(static_cast<size_t>(s.layers), false);
  auto it_types = c.find("indexer_types");
  for (size_t i = 0; i < s.kinds.size(); ++i) {
    if (s.kinds[i] != LayerKind::sparse_mla) continue;
    bool full = true;
    if (it_types != c.end() && it_types->is_array() && i < it_types->size() &&
        (*it_types)[i].is_string())
      full = (*it_types)[i].get<std::string>() != "shared";
    s.indexer[i] = full && s.index_head_dim > 0;
  }

  // Every kind present must have its dimensions.
  for (LayerKind k : {LayerKind::full_attention, LayerKind::sliding_attention, LayerKind::mla,
                      LayerKind::sparse_mla, LayerKind::linear_attention}) {
    if (s.count(k) == 0) continue;
    const char* name = layer_kind_name(k);
    switch (k) {
      case LayerKind::full_attention:
      case LayerKind::sliding_attention:
        if (s.kv_heads <= 0 || s.head_dim <= 0)
          return make_error(Errc::config,
                            fmt::format("{}: {} layers need num_key_value_heads (or "
                                        "num_attention_heads) and head_dim (or hidden_size)",
                                        w, name));
        if (k == LayerKind::sliding_attention && s.sliding_window <= 0)
          return make_error(
              Errc::config,
              fmt::format("{}: sliding_attention layers need a positive sliding_window", w));
        break;
      case LayerKind::mla:
      case LayerKind::sparse_mla:
        if (s.kv_lora_rank <= 0)
          return make_error(Errc::config, fmt::format("{}: {} layers need kv_lora_rank", w, name));
        break;
      case LayerKind::linear_attention:
        if (s.linear == LinearFamily::none || s.linear_v_heads <= 0 || s.linear_v_dim <= 0 ||
            s.linear_k_heads <= 0 || s.linear_k_dim <= 0)
          return make_error(
              Errc::config,
              fmt::format("{}: linear_attention layers need their head counts and dimensions "
                          "(linear_num_heads + linear_head_dim, or linear_num_key_heads, "
                          "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)",
                          w));
        if (s.linear_conv_kernel == 0) s.linear_conv_kernel = 4;  // both families' default
        break;
    }
  }
  return s;
}

Result<ModelShape> model_shape(const hf::Config& config, const std::string& where) {
  return model_shape(config.raw, where);
}

int kv_dtype_bytes(const std::string& kv_dtype, const ModelShape& s) {
  if (kv_dtype == "fp8") return 1;
  if (kv_dtype == "bf16" || kv_dtype == "fp16") return 2;
  if (kv_dtype == "fp32") return 4;
  return s.dtype_bytes;
}

uint64_t KvPart::bytes_for(int64_t context) const {
  int64_t tokens = std::max<int64_t>(context, 0);
  if (window > 0) tokens = std::min(tokens, window);
  uint64_t states = ceil_div(u(tokens), u(std::max(tokens_per_state, 1)));
  return u(layers) * (states * bytes_per_state + bytes_per_slot);
}

std::vector<KvPart> kv_parts(const ModelShape& s, const KvRecord& r, const KvSpread& spread) {
  const int ranks = std::max(spread.ranks, 1);
  const uint64_t split = u(std::clamp(spread.context_split, 1, ranks));
  const uint64_t e = u(kv_dtype_bytes(r.dtype, s));
  const bool vllm = r.layout == KvLayout::vllm;
  const bool fp8 = e == 1;
  std::vector<KvPart> out;
  auto add = [&](KvPart p) {
    if (p.layers > 0) out.push_back(std::move(p));
  };
  // Standard attention: K and V per KV head; both engines store dtype elements.
  for (LayerKind k : {LayerKind::full_attention, LayerKind::sliding_attention}) {
    KvPart p;
    p.kind = k;
    p.layers = s.count(k);
    p.part = "K+V";
    const uint64_t h = heads_per_rank(s.kv_heads, ranks);
    p.bytes_per_state = ceil_div(2 * h * u(s.head_dim) * e, split);
    p.record = fmt::format("2 x {} KV head(s) x {} x {} B{}", h, s.head_dim, e,
                           split > 1 ? fmt::format(" / {} context ranks", split) : "");
    // vLLM frees what left the window. Our engine, where full layers keep the shared blocks,
    // keeps a sliding layer's window and one step's tokens in a ring of whole blocks;
    // where every layer slides it keeps every token.
    if (k == LayerKind::sliding_attention && vllm) p.window = s.sliding_window;
    if (k == LayerKind::sliding_attention && !vllm && s.count(LayerKind::full_attention) > 0) {
      const int64_t span = int64_t{s.sliding_window} + std::max(r.step_tokens, 1) - 1;
      p.window = (span + kNativeBlockTokens - 1) / kNativeBlockTokens * kNativeBlockTokens;
      p.record += fmt::format(", a ring of {} tokens (window {} + a step's {} - 1)", p.window,
                              s.sliding_window, std::max(r.step_tokens, 1));
    }
    add(p);
  }
  // Latent attention: one latent + RoPE key per token, whole on every rank.
  for (LayerKind k : {LayerKind::mla, LayerKind::sparse_mla}) {
    KvPart p;
    p.kind = k;
    p.layers = s.count(k);
    p.part = "latent";
    const uint64_t lat = u(s.kv_lora_rank), rope = u(s.qk_rope_head_dim);
    if (vllm && fp8 && k == LayerKind::sparse_mla) {
      // vLLM's fp8_ds_mla (FlashMLA sparse; vllm/v1/attention/backends/mla/flashmla_sparse.py
      // get_kv_cache_shape, vllm/v1/kv_cache_interface.py MLAAttentionSpec): the latent in
      // fp8, one fp32 scale per 128 latent values, and the RoPE key in bf16 padded to 64
      // dims: 512 + 16 + 128 = 656 bytes for kv_lora_rank 512, whatever qk_rope_head_dim
      // (GLM-5-Next's 0 is stored as 64 zeros).
      const uint64_t scales = 4 * ceil_div(lat, 128), rope_b = 2 * std::max<uint64_t>(rope, 64);
      p.bytes_per_state = ceil_div(lat + scales + rope_b, split);
      p.record = fmt::format("fp8_ds_mla: {} fp8 latent + {} B scales + {} B bf16 RoPE = {} B", lat,
                             scales, rope_b, lat + scales + rope_b);
    } else {
      p.bytes_per_state = ceil_div((lat + rope) * e, split);
      p.record = fmt::format("({} latent + {} RoPE) x {} B", lat, rope, e);
    }
    if (split > 1) p.record += fmt::format(" / {} context ranks", split);
    add(p);
  }
  // The sparse-attention indexer: one key per index_kpool tokens on each layer that runs it.
  {
    KvPart p;
    p.kind = LayerKind::sparse_mla;
    p.layers = static_cast<int>(std::count(s.indexer.begin(), s.indexer.end(), true));
    p.part = "indexer keys";
    p.tokens_per_state = s.index_kpool;
    const uint64_t d = u(s.index_head_dim);
    if (vllm) {
      // vLLM's indexer cache (vllm/model_executor/models/deepseek_v2.py Indexer, and
      // Glm5NextIndexerCache with tokens_per_state = index_kpool): fp8 keys with one fp32
      // scale per 128 values, e.g. 128 + 4 = 132 bytes per state.
      const uint64_t b = d + 4 * ceil_div(d, 128);
      p.bytes_per_state = ceil_div(b, split);
      p.record = fmt::format("{} fp8 + {} B scale per {} token(s)", d, b - d, s.index_kpool);
    } else {
      p.bytes_per_state = ceil_div(d * e, split);
      p.record = fmt::format("{} x {} B per {} token(s)", d, e, s.index_kpool);
    }
    add(p);
    if (vllm && s.index_kpool > 1 && p.layers > 0) {
      // The pool being filled: raw bf16 keys and gate scores for a ring of index_kpool
      // tokens per sequence (Glm5NextTailCache; without speculative tokens).
      KvPart t;
      t.kind = LayerKind::sparse_mla;
      t.layers = p.layers;
      t.part = "indexer tail";
      const uint64_t ring = u(s.index_kpool) * next_pow2(1);
      t.bytes_per_slot = ring * 2 * d * 2;
      t.record = fmt::format("{} tokens x (bf16 key + bf16 gate) x {}", ring, d);
      add(t);
    }
  }
  // Linear attention: a fixed state per sequence, heads split across ranks. The conv window
  // keeps conv_kernel - 1 inputs of q, k and v in the model's dtype; the recurrent state is
  // one k_dim x v_dim matrix per value head in fp32 (transformers and vLLM both keep it so).
  {
    KvPart p;
    p.kind = LayerKind::linear_attention;
    p.layers = s.count(LayerKind::linear_attention);
    p.part = "state";
    const uint64_t kh = heads_per_rank(s.linear_k_heads, ranks),
                   vh = heads_per_rank(s.linear_v_heads, ranks);
    const uint64_t conv_ch = 2 * kh * u(s.linear_k_dim) + vh * u(s.linear_v_dim);
    const uint64_t window = u(std::max(s.linear_conv_kernel - 1, 0));
    const uint64_t conv = conv_ch * window * u(s.dtype_bytes);
    const uint64_t rec = vh * u(s.linear_k_dim) * u(s.linear_v_dim) * 4;
    p.bytes_per_slot = conv + rec;
    p.tokens_per_state = 1;
    p.record = fmt::format("{}: conv {} ch x {} x {} B + recurrent {} head(s) x {} x {} x 4 B",
                           s.linear == LinearFamily::kda ? "KDA" : "gated delta net", conv_ch,
                           window, s.dtype_bytes, vh, s.linear_k_dim, s.linear_v_dim);
    add(p);
  }
  return out;
}

uint64_t kv_bytes_per_token_per_rank(const ModelShape& s, const KvRecord& r,
                                     const KvSpread& spread) {
  uint64_t total = 0;
  for (const auto& p : kv_parts(s, r, spread))
    total += u(p.layers) * ceil_div(p.bytes_per_state, u(std::max(p.tokens_per_state, 1)));
  return total;
}

uint64_t kv_bytes_per_sequence(const std::vector<KvPart>& parts, int64_t context) {
  uint64_t total = 0;
  for (const auto& p : parts) total += p.bytes_for(context);
  return total;
}

ModelShape dense_attention_shape(int layers, int kv_heads, int head_dim, int dtype_bytes) {
  ModelShape s;
  s.layers = layers;
  s.kv_heads = s.heads = kv_heads;
  s.head_dim = head_dim;
  s.dtype_bytes = dtype_bytes;
  s.kinds.assign(static_cast<size_t>(std::max(layers, 0)), LayerKind::full_attention);
  s.indexer.assign(s.kinds.size(), false);
  return s;
}

bool is_routed_expert_tensor(const std::string& name) {
  return name.find("experts") != std::string::npos &&
         name.find("shared_expert") == std::string::npos;
}

uint64_t weights_per_rank(const WeightInventory& w, const ModelShape& s, MoeSplit split,
                          int ranks) {
  const uint64_t r = u(std::max(ranks, 1));
  const uint64_t experts = std::min(w.experts, w.total);
  const uint64_t dense = w.total - experts;
  if (experts == 0 || s.experts <= 0 || split == MoeSplit::tensor)
    return ceil_div(dense, r) + ceil_div(experts, r);
  // Whole experts per rank: the rank with the most holds ceil(E/R) of them.
  const uint64_t e = u(s.experts);
  return ceil_div(dense, r) + ceil_div(experts * ceil_div(e, r), e);
}

int64_t max_context_for(const std::vector<KvPart>& parts, int slots, uint64_t budget) {
  const uint64_t n = u(std::max(slots, 1));
  auto need = [&](int64_t ctx) { return kv_bytes_per_sequence(parts, ctx) * n; };
  if (need(1) > budget) return 0;
  // Every part grows with the context (or stops growing at its window): binary search.
  int64_t lo = 1, hi = 1;
  while (hi < (int64_t{1} << 40) && need(hi) <= budget) hi *= 2;
  if (need(hi) <= budget) return hi;  // bounded by windows and states only
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    (need(mid) <= budget ? lo : hi) = mid;
  }
  return lo;
}

PlanRow plan_row(const PlanInput& in, int nodes) {
  PlanRow r;
  r.nodes = nodes;
  r.ranks = nodes * std::max(1, in.gpus_per_node);
  const KvSpread spread{r.ranks, in.context_split};
  r.parts = kv_parts(in.shape, in.record, spread);
  r.moe = resolve_moe_split(in.moe, in.shape, r.ranks);
  r.weights_per_rank = weights_per_rank(in.weights, in.shape, r.moe, r.ranks);
  if (in.engine_weights)
    if (auto held = in.engine_weights(r.ranks, r.moe)) {
      r.weights_per_rank = *held;
      r.weights_from_engine = true;
    }
  r.kv_per_token_per_rank = kv_bytes_per_token_per_rank(in.shape, in.record, spread);
  const uint64_t slots = u(std::max(in.slots, 1));
  for (const auto& p : r.parts) r.state_per_rank += u(p.layers) * p.bytes_per_slot * slots;
  r.kv_per_rank = kv_bytes_per_sequence(r.parts, in.context) * slots + in.kv_overhead;
  r.fixed_per_rank = in.workspace + in.mtp + in.vision;
  r.reserve = in.reserve;
  r.need_per_rank = r.weights_per_rank + r.kv_per_rank + r.fixed_per_rank + r.reserve;
  r.capacity_per_rank = in.capacity_per_rank;
  if (in.capacity_per_rank == 0) {
    r.max_context = -1;
    return r;
  }
  r.fits = r.need_per_rank <= in.capacity_per_rank;
  const uint64_t fixed = r.weights_per_rank + r.fixed_per_rank + r.reserve + in.kv_overhead;
  r.max_context = fixed >= in.capacity_per_rank
                      ? 0
                      : max_context_for(r.parts, in.slots, in.capacity_per_rank - fixed);
  return r;
}

std::vector<PlanRow> plan_table(const PlanInput& in, int max_nodes) {
  std::vector<PlanRow> rows;
  for (int n = 1; n <= max_nodes; ++n) rows.push_back(plan_row(in, n));
  return rows;
}

}  // namespace spark::plan
