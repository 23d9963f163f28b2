// libFuzzer target for config.json: the Hugging Face reader (core/hf) and the engine's
// ModelConfig built from it. Besides "no crash, no leak, no UB": an accepted config has every
// size inside the bounds the loader relies on before it allocates (so no value in the file
// can reach an absurd allocation), and a refusal names the file.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/strings.h"
#include "daemon/engine/model_config.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();  // an invariant broke: libFuzzer reports it with the input
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto c = spark::engine::parse_model_config(text, "fuzz/config.json");
  if (!c) {
    require(c.error().message.find("fuzz/config.json") != std::string::npos);
    return 0;
  }
  require(c->vocab_size >= 1 && c->vocab_size <= (1 << 22));
  require(c->hidden_size >= 2 && c->hidden_size <= (1 << 16));
  require(c->intermediate_size >= 1 && c->intermediate_size <= (1 << 19));
  require(c->num_layers >= 1 && c->num_layers <= 1024);
  require(c->num_heads >= 1 && c->num_kv_heads >= 1 && c->num_heads % c->num_kv_heads == 0);
  require(c->head_dim >= 2 && c->head_dim <= 1024 && c->head_dim % 2 == 0);
  require(c->max_position >= 1 && c->max_position <= (1 << 24));
  require(std::isfinite(c->rms_eps) && c->rms_eps > 0 && c->rms_eps < 1);
  require(std::isfinite(c->rope_theta) && c->rope_theta > 0);
  require(c->bos_token_id < c->vocab_size);
  return 0;
}
