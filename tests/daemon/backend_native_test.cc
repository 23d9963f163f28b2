// The native backend in-process (no HTTP): start() on the demo model, readiness and slots,
// the real probe, errors that name MODEL_PATH; ApiState's registry for the memory guard.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/config.h"
#include "daemon/api_routes.h"
#include "daemon/backend.h"
#include "daemon/engine/demo_model.h"
#include "kernels/cuda_runtime.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {
RingConfig ring(const std::string& extra) {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text("MODEL=demo\nNODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\n" + extra,
                              "t.env", env, &d);
  REQUIRE(cfg.ok());
  return *cfg;
}
}  // namespace

TEST_CASE("native backend: serves the demo model; SLOTS and CONTEXT_LEN; the probe is real") {
  test::TempDir dir("native-backend");
  REQUIRE(engine::write_demo_model(dir / "model", false).ok());
  RingConfig cfg = ring("MODEL_PATH=" + dir / "model" + "\nSLOTS=3\nCONTEXT_LEN=128\n");
  auto e = make_backend(cfg, 0);
  CHECK(std::string(e->name()) == "native");
  CHECK_FALSE(e->status().ready);
  CHECK(e->probe("hello", 1000ms).error().code == Errc::precondition);  // not loaded yet
  BackendContext ctx;
  ctx.cfg = &cfg;
  std::vector<std::string> progress;
  ctx.progress = [&](const std::string& s) { progress.push_back(s); };
  Status st = e->start(ctx);
  REQUIRE_MESSAGE(st.ok(), st.message());
  BackendStatus s = e->status();
  CHECK(s.ready);
  CHECK_FALSE(s.fatal);
  CHECK(s.slots_total == 3);
  CHECK(s.slots_busy == 0);
  CHECK_FALSE(progress.empty());
  // DEVICE=auto (the default): the GPU when usable, else the CPU with the reason.
  if (test::cuda_skip_reason().empty()) {
    CHECK(s.device.find("sm_") != std::string::npos);
    CHECK(s.device_note.empty());
  } else {
    CHECK(s.device.rfind("cpu", 0) == 0);
    CHECK(s.device_note.find("DEVICE=auto chose the CPU") != std::string::npos);
  }
  auto text = e->probe("The capital of France is", 30000ms);
  REQUIRE_MESSAGE(text.ok(), text.error().message);
  CHECK_FALSE(text->empty());
  e->stop(1000ms);
  CHECK_FALSE(e->status().ready);
  CHECK(e->probe("x", 1000ms).error().code == Errc::precondition);
}

TEST_CASE("native backend: CHAT_FORMAT overrides the detected chat format") {
  test::TempDir dir("native-chatfmt");
  REQUIRE(engine::write_demo_model(dir / "model", false).ok());
  for (const auto& c : {std::pair<std::string, std::string>{"", "chat format chatml"},
                        {"CHAT_FORMAT=mistral\n", "chat format mistral (from CHAT_FORMAT)"}}) {
    const std::string& key = c.first;
    const std::string& want = c.second;
    RingConfig cfg = ring("MODEL_PATH=" + dir / "model" + "\nSLOTS=1\nCONTEXT_LEN=64\n" + key);
    auto e = make_backend(cfg, 0);
    BackendContext ctx;
    ctx.cfg = &cfg;
    std::vector<std::string> progress;
    ctx.progress = [&](const std::string& s) { progress.push_back(s); };
    Status st = e->start(ctx);
    REQUIRE_MESSAGE(st.ok(), st.message());
    bool seen = false;
    for (const auto& p : progress) seen = seen || p.rfind(want, 0) == 0;
    CHECK_MESSAGE(seen, "no progress line starting with '" << want << "'");
    e->stop(1000ms);
  }
}

TEST_CASE("native backend: a missing model directory or config.json is an error naming the fix") {
  test::TempDir dir("native-backend-missing");
  {
    RingConfig cfg = ring("");
    auto e = make_backend(cfg, 0);
    BackendContext ctx;
    ctx.cfg = &cfg;
    Status st = e->start(ctx);
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Errc::config);
    CHECK(st.message().find("MODEL_PATH") != std::string::npos);
  }
  RingConfig cfg = ring("MODEL_PATH=" + dir / "empty" + "\n");
  auto e = make_backend(cfg, 0);
  BackendContext ctx;
  ctx.cfg = &cfg;
  Status st = e->start(ctx);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::not_found);
  CHECK(st.message().find(dir / "empty/config.json") != std::string::npos);
  CHECK(st.message().find("sparkctl demo-model") != std::string::npos);
}

TEST_CASE("ApiState: the memory guard cancels the newest request still in flight") {
  ApiState st;
  std::vector<std::string> cancelled;
  auto a = st.add_request([&](const std::string& why) {
    cancelled.push_back("a:" + why);
    return true;
  });
  st.add_request([&](const std::string&) { return false; });  // already finished
  auto c = st.add_request([&](const std::string& why) {
    cancelled.push_back("c:" + why);
    return true;
  });
  st.remove_request(c);  // answered: gone from the registry
  CHECK(st.cancel_newest("low memory"));
  CHECK(cancelled == std::vector<std::string>{"a:low memory"});
  CHECK_FALSE(st.cancel_newest("again"));
  st.remove_request(a);  // idempotent after the cancel removed it
}

TEST_CASE("native backend: COLLECTIVE=nccl is refused with the reason where NCCL cannot run") {
  if (!kernels::cuda_device_count().ok()) {
    test::TempDir dir("native-nccl");
    REQUIRE(engine::write_demo_model(dir / "model", false).ok());
    RingConfig cfg = ring("MODEL_PATH=" + dir / "model" + "\nCOLLECTIVE=nccl\n");
    auto e = make_backend(cfg, 0);
    BackendContext ctx;
    ctx.cfg = &cfg;
    Status st = e->start(ctx);
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == Errc::unsupported);
    // The key first, then why (no CUDA device here, or a build without CUDA).
    CHECK(st.message().find("COLLECTIVE=nccl: ") == 0);
    CHECK(st.message().find("CUDA") != std::string::npos);
    // auto on one rank stays on the host collective and serves.
    RingConfig a = ring("MODEL_PATH=" + dir / "model" + "\nCOLLECTIVE=auto\n");
    auto ea = make_backend(a, 0);
    BackendContext ca;
    ca.cfg = &a;
    CHECK(ea->start(ca).ok());
    CHECK(ea->status().fabric.is_null());  // no NCCL, no self-test
    ea->stop(1000ms);
    return;
  }
  // With a GPU: one rank over NCCL runs the self-test before it serves, and says so.
  test::TempDir dir("native-nccl");
  REQUIRE(engine::write_demo_model(dir / "model", false).ok());
  RingConfig cfg = ring("MODEL_PATH=" + dir / "model" + "\nCOLLECTIVE=nccl\n");
  auto e = make_backend(cfg, 0);
  BackendContext ctx;
  ctx.cfg = &cfg;
  ctx.log_dir = dir.path();
  Status st = e->start(ctx);
  REQUIRE_MESSAGE(st.ok(), st.message());
  auto s = e->status();
  REQUIRE(s.fabric.is_object());
  CHECK(s.fabric["passed"] == true);
  e->stop(1000ms);
}

TEST_CASE(
    "native backend: CONTEXT_LEN above max_position_embeddings: set, refused; default, served") {
  test::TempDir dir("native-context");
  REQUIRE(engine::write_demo_model(dir / "model", false).ok());  // max_position_embeddings 2048
  RingConfig set = ring("MODEL_PATH=" + dir / "model" + "\nSLOTS=1\nCONTEXT_LEN=4096\n");
  auto e = make_backend(set, 0);
  BackendContext ctx;
  ctx.cfg = &set;
  Status st = e->start(ctx);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::config);
  CHECK(st.message().find("CONTEXT_LEN 4096 (t.env:6) is above the model's "
                          "max_position_embeddings 2048") != std::string::npos);
  CHECK(st.message().find("set CONTEXT_LEN=2048 or less") != std::string::npos);
  // The default (4096) is not the operator's choice: served at the model's maximum.
  RingConfig dflt = ring("MODEL_PATH=" + dir / "model" + "\nSLOTS=1\n");
  auto d = make_backend(dflt, 0);
  BackendContext dctx;
  dctx.cfg = &dflt;
  Status ok = d->start(dctx);
  REQUIRE_MESSAGE(ok.ok(), ok.message());
  CHECK(d->status().ready);
  d->stop(1000ms);
}
