#include "daemon/backend.h"

namespace spark::daemon {

std::unique_ptr<Backend> make_backend(const RingConfig& cfg, int rank) {
  if (cfg.get("ENGINE") == "exec") return make_exec_backend(cfg, rank);
  return make_native_backend(cfg, rank);
}

}  // namespace spark::daemon
