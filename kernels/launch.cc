#include "kernels/launch.h"

#include <atomic>

namespace spark::kernels {
namespace {
thread_local bool t_programmatic_launch = false;
std::atomic<bool> g_fallbacks{false};
}  // namespace

void set_programmatic_launch(bool on) {
  t_programmatic_launch = on;
}
bool programmatic_launch() {
  return t_programmatic_launch;
}
void set_cuda_fallbacks(bool on) {
  g_fallbacks.store(on);
}
bool cuda_fallbacks() {
  return g_fallbacks.load();
}

}  // namespace spark::kernels
