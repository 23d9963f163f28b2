// Hardware tier, NCCL on one GPU: world size 1 through the whole NCCL path (the unique id
// through a rendezvous-like share, the device collectives, CUDA graph capture, abort), the
// fabric self-test, and every fault of the fault-injection libnccl passed through to the real
// libnccl.so.2. Each test prints "SKIP: <reason>" and returns where no GPU or no NCCL is.
#include <dlfcn.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <vector>

#include "core/strings.h"
#include "daemon/engine/fabric_test.h"
#include "daemon/engine/nccl_collective.h"
#include "env/nccl_env.h"
#include "kernels/bf16.h"
#include "kernels/cuda_runtime.h"
#include "kernels/device_copy.h"
#include "kernels/fabric_check.h"
#include "support/gpu.h"

using namespace spark;
using namespace spark::engine;

namespace {

// NCCL reads its environment at its first call: set the debug output once, before any.
const std::string& debug_file() {
  static const std::string f = [] {
    setenv("SPARK_FAULT_NCCL_REAL", "libnccl.so.2", 0);
    auto a = env::apply_nccl_debug_env("/tmp", static_cast<int>(::getpid()));
    std::cout << "# NCCL environment: " << a.summary << "\n";
    return a.debug_file;
  }();
  return f;
}

bool skip_without_nccl() {
  if (test::skip_without_cuda()) return true;
  debug_file();
  auto l = nccl::load();
  if (l.ok()) return false;
  const char* require = std::getenv("SPARK_REQUIRE_GPU");
  if (require && std::string(require) == "1") {
    FAIL_CHECK("SPARK_REQUIRE_GPU=1 but " << l.error().message);
    return true;
  }
  std::cout << "SKIP: " << l.error().message << "\n";
  return true;
}

// The daemon's share, reduced to what one rank sees: rank 0's value comes back.
NcclCollective::ShareFn echo_share(std::string* seen) {
  return [seen](const std::string& key, const std::string& v) -> Result<std::string> {
    CHECK(key == "engine.nccl_id");
    *seen = v;
    return v;
  };
}

// The fault library where it was built, or next to this binary (a staged copy elsewhere).
const std::string& fault_lib() {
  static const std::string p = [] {
    if (::access(FAULT_INJECT_LIBNCCL, R_OK) == 0) return std::string(FAULT_INJECT_LIBNCCL);
    char exe[4096] = {};
    ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    std::string dir = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(".");
    return dir.substr(0, dir.rfind('/')) + "/libfault_inject_libnccl.so";
  }();
  return p;
}

void set_fault(const char* mode) {
  void* h = dlopen(fault_lib().c_str(), RTLD_NOW | RTLD_LOCAL);
  REQUIRE(h != nullptr);
  auto set = reinterpret_cast<void (*)(const char*)>(dlsym(h, "spark_fault_nccl_set"));
  REQUIRE(reinterpret_cast<void*>(set) != nullptr);
  set(mode);
}

std::shared_ptr<NcclCollective> connect_real(
    const std::string& library = nccl::default_library(),
    std::chrono::milliseconds op = std::chrono::seconds(20)) {
  NcclOptions o;
  o.library = library;
  o.init_timeout = std::chrono::seconds(60);
  o.op_timeout = op;
  std::string id;
  auto c = NcclCollective::connect_via(o, echo_share(&id), std::make_shared<LocalCollective>());
  REQUIRE_MESSAGE(c.ok(), (c.ok() ? std::string() : c.error().message));
  CHECK(id.size() == 256);
  return *c;
}

}  // namespace

TEST_CASE("hw nccl: one rank from the rendezvous id: all-reduce, all-gather, broadcast on device") {
  if (skip_without_nccl()) return;
  auto c = connect_real();
  CHECK(c->lib().version >= 21400);
  const size_t n = 4096;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 97) - 40.f;
  auto a = kernels::DeviceMemory::allocate(n * 4);
  auto b = kernels::DeviceMemory::allocate(n * 4);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->copy_from_host(host.data(), n * 4).ok());
  REQUIRE(c->all_reduce_sum_device(a->get(), n, DType::f32, nullptr).ok());
  REQUIRE(c->all_gather_device(a->get(), b->get(), n, DType::f32, nullptr).ok());
  REQUIRE(c->broadcast_device(b->get(), n, DType::f32, 0, nullptr).ok());
  REQUIRE(c->synchronize(nullptr).ok());
  std::vector<float> back(n);
  REQUIRE(b->copy_to_host(back.data(), n * 4).ok());
  CHECK(back == host);  // world 1: the sum and the gather are the input itself
  // bf16 goes through NCCL's own type.
  std::vector<kernels::bf16_bits> h16(n);
  for (size_t i = 0; i < n; ++i) h16[i] = kernels::float_to_bf16(host[i]);
  REQUIRE(a->copy_from_host(h16.data(), n * 2).ok());
  REQUIRE(c->all_reduce_sum_device(a->get(), n, DType::bf16, nullptr).ok());
  REQUIRE(c->synchronize(nullptr).ok());
  std::vector<kernels::bf16_bits> b16(n);
  REQUIRE(a->copy_to_host(b16.data(), n * 2).ok());
  CHECK(b16 == h16);
}

TEST_CASE("hw nccl: the collectives captured in a CUDA graph replay on the device") {
  if (skip_without_nccl()) return;
  auto c = connect_real();
  auto s = kernels::OwnedStream::create();
  REQUIRE(s.ok());
  const size_t n = 8192 / 2;  // the decode message: hidden 4096 in bf16
  auto a = kernels::DeviceMemory::allocate(n * 4);
  auto g = kernels::DeviceMemory::allocate(n * 4);
  REQUIRE(a.ok());
  REQUIRE(g.ok());
  auto graph = kernels::CapturedGraph::capture(s->get(), [&]() -> Status {
    SPARK_TRY(kernels::fabric_fill_device(static_cast<float*>(a->get()), n, 0, 7, s->get()));
    SPARK_TRY(c->all_reduce_sum_device(a->get(), n, DType::f32, s->get()));
    return c->all_gather_device(a->get(), g->get(), n, DType::f32, s->get());
  });
  REQUIRE_MESSAGE(graph.ok(), (graph.ok() ? std::string() : graph.error().message));
  auto wrong = kernels::DeviceMemory::allocate(8);
  REQUIRE(wrong.ok());
  for (int i = 0; i < 3; ++i) {
    const unsigned long long zero = 0;
    REQUIRE(wrong->copy_from_host(&zero, 8).ok());
    REQUIRE(graph->launch(s->get()).ok());
    REQUIRE(kernels::fabric_count_wrong_allgather_device(
                static_cast<const float*>(g->get()), n, 1, 7,
                static_cast<unsigned long long*>(wrong->get()), s->get())
                .ok());
    REQUIRE(c->synchronize(s->get()).ok());
    unsigned long long w = 1;
    REQUIRE(wrong->copy_to_host(&w, 8).ok());
    CHECK(w == 0);
  }
}

TEST_CASE("hw nccl: the fabric self-test on one GPU passes, checked on the device") {
  if (skip_without_nccl()) return;
  auto c = connect_real();
  FabricOptions o;
  FabricExpect e = fabric_expect_from_env(0, 1, "gpu", 0);
  auto r = run_fabric_test(*c, o, e, debug_file());
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  std::cout << render_fabric_table({*r});
  std::cout << "# fabric json: " << to_json(*r).dump() << "\n";
  CHECK_MESSAGE(r->passed(), join(r->failures, "; "));
  CHECK(r->points.size() == 32);  // 16 sizes x 2 collectives
  for (const auto& p : r->points) {
    CHECK(p.wrong == 0);
    CHECK(p.time_us > 0);
  }
  CHECK(r->decode_latency_us_8k > 0);
  CHECK(r->nccl.version.find('.') != std::string::npos);  // read from NCCL's own debug file
  // The check is real: corrupt the sum and it is counted.
  auto d = kernels::DeviceMemory::allocate(1024 * 4);
  REQUIRE(d.ok());
  REQUIRE(kernels::fabric_fill_device(static_cast<float*>(d->get()), 1024, 0, 5, nullptr).ok());
  std::vector<float> h(1024);
  REQUIRE(d->copy_to_host(h.data(), h.size() * 4).ok());
  std::vector<float> want(1024);
  kernels::fabric_fill_ref(want.data(), want.size(), 0, 5);
  CHECK(h == want);  // the kernel and its C++ twin agree
  h[3] += 1, h[1000] += 2;
  REQUIRE(d->copy_from_host(h.data(), h.size() * 4).ok());
  auto w = kernels::DeviceMemory::allocate(8);
  REQUIRE(w.ok());
  const unsigned long long zero = 0;
  REQUIRE(w->copy_from_host(&zero, 8).ok());
  REQUIRE(kernels::fabric_count_wrong_allreduce_device(
              static_cast<const float*>(d->get()), 1024, 1, 5,
              static_cast<unsigned long long*>(w->get()), nullptr)
              .ok());
  unsigned long long got = 0;
  REQUIRE(w->copy_to_host(&got, 8).ok());
  CHECK(got == 2);
}

TEST_CASE("hw nccl: abort from another thread ends a wait on a collective that never completes") {
  if (skip_without_nccl()) return;
  set_fault("collective_hang:1");
  auto c = connect_real(fault_lib(), std::chrono::minutes(5));
  auto a = kernels::DeviceMemory::allocate(4096);
  REQUIRE(a.ok());
  REQUIRE(c->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr).ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    c->abort("rank 1 (spark-b) is dead: heartbeat silent 6 s");
  });
  auto st = c->synchronize(nullptr);  // the hang ends only by the abort (named below)
  killer.join();
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("rank 1 (spark-b) is dead") != std::string::npos);
  CHECK(kernels::stream_synchronize(nullptr).ok());  // the stream is released
  set_fault("");
}

TEST_CASE("hw nccl: every fault of the fault-injection libnccl on a real communicator") {
  if (skip_without_nccl()) return;
  NcclOptions o;
  o.library = fault_lib();
  o.init_timeout = std::chrono::milliseconds(500);
  o.op_timeout = std::chrono::milliseconds(500);
  o.missing_ranks = [] { return std::string("rank 1 (spark-b): heartbeat silent 6 s"); };
  std::string id;

  set_fault("init_fail");
  auto f = NcclCollective::connect_via(o, echo_share(&id), nullptr);
  REQUIRE_FALSE(f.ok());
  CHECK(f.error().message.find("ncclCommInitRankConfig fails") != std::string::npos);

  set_fault("init_hang");
  auto h = NcclCollective::connect_via(o, echo_share(&id), nullptr);
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().code == Errc::timeout);
  CHECK(h.error().message.find("rank 1 (spark-b)") != std::string::npos);

  auto a = kernels::DeviceMemory::allocate(4096);
  REQUIRE(a.ok());
  set_fault("async_error:2");
  {
    auto c = NcclCollective::connect_via(o, echo_share(&id), nullptr);
    REQUIRE_MESSAGE(c.ok(), (c.ok() ? std::string() : c.error().message));
    REQUIRE((*c)->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr).ok());
    CHECK((*c)->synchronize(nullptr).ok());  // one collective: still healthy
    REQUIRE((*c)->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr).ok());
    auto st = (*c)->synchronize(nullptr);
    REQUIRE_FALSE(st.ok());
    CHECK(st.message().find("ncclRemoteError") != std::string::npos);
    CHECK((*c)->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr)
              .message()
              .find("was aborted") != std::string::npos);
  }

  set_fault("collective_hang:2");
  {
    auto c = NcclCollective::connect_via(o, echo_share(&id), nullptr);
    REQUIRE(c.ok());
    REQUIRE((*c)->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr).ok());
    REQUIRE((*c)->synchronize(nullptr).ok());
    REQUIRE((*c)->all_reduce_sum_device(a->get(), 1024, DType::f32, nullptr).ok());
    auto st = (*c)->synchronize(nullptr);  // ended by its deadline (named below), not the hang
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Errc::timeout);
    CHECK(st.message().find("did not complete within 0.5 s") != std::string::npos);
    CHECK(st.message().find("rank 1 (spark-b): heartbeat silent") != std::string::npos);
    CHECK(kernels::stream_synchronize(nullptr).ok());  // abort released the stream
  }
  set_fault("");
}
