#include "kernels/launch.h"

namespace spark::kernels {
namespace {
thread_local bool t_programmatic_launch = false;
}

void set_programmatic_launch(bool on) {
  t_programmatic_launch = on;
}
bool programmatic_launch() {
  return t_programmatic_launch;
}

}  // namespace spark::kernels
