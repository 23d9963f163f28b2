#include "daemon/engine.h"

namespace spark::daemon {

std::unique_ptr<Engine> make_engine(const RingConfig& cfg, int rank) {
  if (cfg.get("ENGINE") == "exec") return make_exec_engine(cfg, rank);
  return make_native_engine(cfg, rank);
}

}  // namespace spark::daemon
