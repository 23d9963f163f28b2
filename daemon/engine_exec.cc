// The exec backend: runs ENGINE_EXEC per rank (filled in with the rendezvous work).
#include "daemon/engine.h"

namespace spark::daemon {

namespace {
class ExecEngine final : public Engine {
 public:
  const char* name() const override { return "exec"; }
  Status start(EngineContext&) override {
    return make_error(Errc::unsupported, "exec engine backend not implemented yet");
  }
  EngineStatus status() override {
    EngineStatus s;
    s.reason = "exec engine backend not implemented yet";
    return s;
  }
  void stop(std::chrono::milliseconds) override {}
};
}  // namespace

std::unique_ptr<Engine> make_exec_engine(const RingConfig&, int) {
  return std::make_unique<ExecEngine>();
}

}  // namespace spark::daemon
