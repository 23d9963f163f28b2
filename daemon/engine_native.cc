// The native engine's entry point. Until the engine exists this backend never claims to be
// ready: start() fails with a reason that tells the operator what to do instead.
#include "daemon/engine.h"

namespace spark::daemon {

namespace {
class NativeEnginePlaceholder final : public Engine {
 public:
  const char* name() const override { return "native"; }
  Status start(EngineContext&) override {
    return make_error(Errc::unsupported,
                      "native engine not built yet; set ENGINE=exec with ENGINE_EXEC to run an "
                      "external engine");
  }
  EngineStatus status() override {
    EngineStatus s;
    s.reason = "native engine not built yet";
    return s;
  }
  void stop(std::chrono::milliseconds) override {}
};
}  // namespace

std::unique_ptr<Engine> make_native_engine(const RingConfig&, int) {
  return std::make_unique<NativeEnginePlaceholder>();
}

}  // namespace spark::daemon
