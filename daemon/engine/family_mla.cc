// Multi-head latent attention, as transformers' DeepseekV3Attention defines it. Queries come
// through q_a_proj, q_a_layernorm and q_b_proj (q_proj where q_lora_rank is null), each head
// [q_nope | q_pe]. kv_a_proj_with_mqa gives one [latent | k_pe] per token for all heads; the
// latent is RMS-normalised (kv_a_layernorm) and kv_b_proj expands it into each head's
// [k_nope | v]; k_pe is rotated once and shared. The engine keeps the normalised latent and
// the rotated k_pe per token and layer (the same on every rank), and attends over them with
// kv_b_proj absorbed: q_nope into the latent space before the scores, the values' half after
// the softmax. The MLP is DeepSeek-V3's grouped sigmoid mixture of experts (family_moe.cc).
#include <fmt/format.h>

#include "daemon/engine/family.h"

namespace spark::engine {

using cfgjson::get_bool;
using cfgjson::get_int;
using cfgjson::unsupported;

Status parse_mla_attention(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                           const std::string& where) {
  // DeepSeek-V3.2's sparse attention: an indexer picks the tokens each query reads.
  for (const char* key : {"index_topk", "index_n_heads", "index_head_dim"}) {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null())
      return unsupported(where, key, *it,
                         "DeepSeek sparse attention's indexer (DeepSeek-V3.2) is not built; the "
                         "engine runs dense latent attention");
  }
  if (h.attention_bias)
    return unsupported(where, "attention_bias", true,
                       "DeepSeek-V3's q_a_proj, kv_a_proj_with_mqa and o_proj carry no bias");
  if (c->rope.type != "default" && c->rope.type != "yarn")
    return unsupported(where, "rope_scaling", c->rope.type,
                       "latent attention runs default or yarn RoPE");
  auto q_lora = get_int(j, "q_lora_rank", 0, where);
  auto kv_lora = get_int(j, "kv_lora_rank", 0, where);
  auto nope = get_int(j, "qk_nope_head_dim", 0, where);
  auto rope = get_int(j, "qk_rope_head_dim", 0, where);
  auto v = get_int(j, "v_head_dim", 0, where);
  auto inter = get_bool(j, "rope_interleave", true, where);
  for (const Status& s : {q_lora.status(), kv_lora.status(), nope.status(), rope.status(),
                          v.status(), inter.status()})
    SPARK_TRY(s);
  auto& m = c->mla;
  m.q_lora_rank = *q_lora;
  m.kv_lora_rank = *kv_lora;
  m.qk_nope = *nope;
  m.qk_rope = *rope;
  m.v_head_dim = *v;
  m.rope_interleave = *inter;
  if (m.kv_lora_rank < 1 || m.kv_lora_rank > 8192 || m.q_lora_rank > 65536 || m.qk_nope < 1 ||
      m.qk_nope > 1024 || m.qk_rope < 2 || m.qk_rope > 1024 || m.qk_rope % 2 != 0 ||
      m.v_head_dim < 1 || m.v_head_dim > 1024)
    return make_error(
        Errc::config,
        fmt::format("{}: latent attention needs kv_lora_rank 1 to 8192 (got {}), "
                    "q_lora_rank 0 (null) to 65536 (got {}), qk_nope_head_dim and "
                    "v_head_dim 1 to 1024 (got {}, {}) and an even "
                    "qk_rope_head_dim 2 to 1024 (got {})",
                    where, m.kv_lora_rank, m.q_lora_rank, m.qk_nope, m.v_head_dim, m.qk_rope));
  // Every head reads the one latent: num_key_value_heads plays no part.
  c->num_kv_heads = c->num_heads;
  c->head_dim = m.qk_head_dim();
  c->rotary_dim = m.qk_rope;
  c->qkv_bias = c->o_bias = false;
  c->qk_norm = QkNorm::none;
  return Status::Ok();
}

}  // namespace spark::engine
