#pragma once
// Gloo between threads of one test process, over loopback.
#include "daemon/engine/gloo_collective.h"

namespace spark::test {

/// Options for rank `rank` of `world`, meeting at the rendezvous store on `port`.
inline engine::GlooOptions loopback_gloo(int rank, int world, int port, int timeout_ms) {
  engine::GlooOptions g;
  g.rank = rank;
  g.world = world;
  g.store_port = port;
  g.timeout_ms = timeout_ms;
  return g;
}

}  // namespace spark::test
