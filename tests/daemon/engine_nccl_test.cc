// The NCCL collective's loader, id exchange, deadlines and aborts, driven by the
// fault-injection libnccl standing alone (no GPU, no real NCCL). The same faults against a
// real one-GPU communicator are in tests/hw/nccl_test.cc.
#include <dlfcn.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "daemon/engine/nccl_collective.h"

using namespace spark;
using namespace spark::engine;

namespace {

// The fault library where it was built, or next to this binary (a staged copy elsewhere).
const char* fault_lib() {
  static const std::string p = [] {
    if (::access(FAULT_INJECT_LIBNCCL, R_OK) == 0) return std::string(FAULT_INJECT_LIBNCCL);
    char exe[4096] = {};
    ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    std::string dir = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(".");
    return dir.substr(0, dir.rfind('/')) + "/libfault_inject_libnccl.so";
  }();
  return p.c_str();
}

void set_fault(const char* mode) {
  void* h = dlopen(fault_lib(), RTLD_NOW | RTLD_LOCAL);
  REQUIRE(h);
  auto set = reinterpret_cast<void (*)(const char*)>(dlsym(h, "spark_fault_nccl_set"));
  REQUIRE(reinterpret_cast<void*>(set) != nullptr);
  set(mode);
}

NcclOptions fault_opts() {
  NcclOptions o;
  o.library = fault_lib();
  o.init_timeout = std::chrono::milliseconds(300);
  o.op_timeout = std::chrono::milliseconds(300);
  return o;
}

Result<std::shared_ptr<NcclCollective>> connect_one(const NcclOptions& o) {
  return NcclCollective::connect_via(o, nullptr, std::make_shared<LocalCollective>());
}

}  // namespace

TEST_CASE("nccl loader: a missing libnccl says why NCCL is not usable and how to fix it") {
  auto l = nccl::load("libnccl-that-does-not-exist.so.2");
  REQUIRE_FALSE(l.ok());
  CHECK(l.error().code == Errc::unsupported);
  CHECK(l.error().message.find("NCCL is not usable") != std::string::npos);
  CHECK(l.error().message.find("libnccl-that-does-not-exist.so.2") != std::string::npos);
  CHECK(l.error().message.find("LD_LIBRARY_PATH") != std::string::npos);
  // A library without NCCL's entry points is refused by name, not crashed on.
  auto notnccl = nccl::load("libm.so.6");
  REQUIRE_FALSE(notnccl.ok());
  CHECK(notnccl.error().message.find("has no ncclGetVersion") != std::string::npos);
}

TEST_CASE("nccl loader: every entry point resolves, and the version is read") {
  set_fault("");
  auto l = nccl::load(fault_lib());
  REQUIRE_MESSAGE(l.ok(), l.error().message);
  CHECK((*l)->version == 22809);
  CHECK(reinterpret_cast<void*>((*l)->AllGather) != nullptr);
  CHECK(reinterpret_cast<void*>((*l)->GroupEnd) != nullptr);
  CHECK(nccl::load(fault_lib()).value() == *l);  // opened once
  CHECK((*l)->describe(nccl::kRemoteError).find("ncclRemoteError") == 0);
}

TEST_CASE("nccl unique id: hex through the rendezvous, malformed ids refused") {
  nccl::UniqueId id{};
  for (size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(i * 7);
  std::string hex = nccl_id_to_hex(id);
  CHECK(hex.size() == 256);
  auto back = nccl_id_from_hex(hex);
  REQUIRE(back.ok());
  CHECK(std::memcmp(back->internal, id.internal, sizeof(id.internal)) == 0);
  CHECK(nccl_id_from_hex(hex.substr(1)).error().code == Errc::integrity);
  hex[10] = 'z';
  CHECK(nccl_id_from_hex(hex).error().message.find("offset 10") != std::string::npos);
}

TEST_CASE("nccl collective: rank 0's id reaches the others through the share function") {
  set_fault("");
  std::string published;
  auto share = [&](const std::string& key, const std::string& v) -> Result<std::string> {
    CHECK(key == "engine.nccl_id");
    published = v;
    return v;
  };
  // world 1 through connect_via's rendezvous path: share is only used for world > 1, so
  // exercise the id round trip by hand as a follower would.
  auto id = NcclCollective::new_unique_id(fault_lib());
  REQUIRE(id.ok());
  auto got = share("engine.nccl_id", nccl_id_to_hex(*id));
  REQUIRE(got.ok());
  auto parsed = nccl_id_from_hex(*got);
  REQUIRE(parsed.ok());
  auto c = NcclCollective::connect(fault_opts(), *parsed, std::make_shared<LocalCollective>());
  REQUIRE_MESSAGE(c.ok(), c.error().message);
  CHECK(published.size() == 256);
  CHECK((*c)->world_size() == 1);
  CHECK((*c)->all_reduce_sum_device(nullptr, 0, DType::f32, nullptr).ok());
  CHECK((*c)->all_reduce_sum_device(nullptr, 4, DType::i32, nullptr).code() == Errc::unsupported);
}

TEST_CASE("nccl collective: a failing init is an error naming the rank and NCCL's reason") {
  set_fault("init_fail");
  auto c = connect_one(fault_opts());
  REQUIRE_FALSE(c.ok());
  CHECK(c.error().code == Errc::network);
  CHECK(c.error().message.find("rank 0 of 1") != std::string::npos);
  CHECK(c.error().message.find("fault injection: ncclCommInitRankConfig fails") !=
        std::string::npos);
}

TEST_CASE("nccl collective: a hung init times out, is aborted and names the missing rank") {
  set_fault("init_hang");
  NcclOptions o = fault_opts();
  o.missing_ranks = [] { return std::string("rank 1 (spark-b) did not join"); };
  auto c = connect_one(o);
  REQUIRE_FALSE(c.ok());
  CHECK(c.error().code == Errc::timeout);
  CHECK(c.error().message.find("ncclCommInitRank did not finish within 0.3 s") !=
        std::string::npos);
  // (The message names the deadline: it ended the wait, not the fault's hang.)
  CHECK(c.error().message.find("rank 1 (spark-b) did not join") != std::string::npos);
}

TEST_CASE("nccl collective: an async error mid-run fails the wait and every later call") {
  set_fault("async_error:2");
  auto c = connect_one(fault_opts());
  REQUIRE_MESSAGE(c.ok(), c.error().message);
  CHECK((*c)->all_reduce_sum_device(nullptr, 0, DType::bf16, nullptr).ok());
  CHECK((*c)->all_gather_device(nullptr, nullptr, 0, DType::bf16, nullptr).ok());
  auto st = (*c)->synchronize(nullptr);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::network);
  CHECK(st.message().find("ncclRemoteError") != std::string::npos);
  CHECK(st.message().find("remote process exited") != std::string::npos);
  auto later = (*c)->all_reduce_sum_device(nullptr, 0, DType::bf16, nullptr);
  CHECK(later.message().find("was aborted") != std::string::npos);
  float x = 1;
  CHECK_FALSE((*c)->all_reduce_sum(&x, 1).ok());  // the control plane stops with it
}

TEST_CASE("nccl collective: abort() from another thread stops the communicator with its reason") {
  set_fault("");
  auto c = connect_one(fault_opts());
  REQUIRE(c.ok());
  std::thread t([&] { (*c)->abort("rank 1 (spark-b) is dead: heartbeat silent 6 s"); });
  t.join();
  auto st = (*c)->all_reduce_sum_device(nullptr, 0, DType::f32, nullptr);
  CHECK(st.code() == Errc::network);
  CHECK(st.message().find("rank 1 (spark-b) is dead") != std::string::npos);
  CHECK((*c)->failure().find("heartbeat silent") != std::string::npos);
  CHECK((*c)->synchronize(nullptr).message().find("was aborted") != std::string::npos);
}
