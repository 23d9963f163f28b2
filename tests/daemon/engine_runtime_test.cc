// Runtime: what sparkd's native backend starts on each rank. Two ranks (threads here; the
// two-process test is tests/e2e/engine_tp_test.cc) rendezvous through a `share` function
// like the daemon's, and rank 0's engine gives the same tokens as a single rank.
#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "core/config.h"
#include "daemon/backend_native.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/runtime.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

TEST_CASE("runtime: two ranks via a share function equal one rank; status reports both") {
  test::TempDir dir;
  auto cfg = small_config(Family::qwen3);
  cfg.eos_token_ids = {};
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::bf16, 8, 1}).ok());
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 24;
  const std::vector<int32_t> prompt = {1, 40, 41, 42, 300, 7, 9};

  RuntimeOptions one;
  one.model_dir = dir.path();
  auto single = Runtime::start(one);
  REQUIRE_MESSAGE(single.ok(), (single.ok() ? std::string() : single.error().message));
  auto want = generate_blocking(*(*single)->engine(), prompt, p);
  REQUIRE(want.ok());
  (*single)->stop();

  // The daemon's rendezvous, reduced to a promise: rank 0 publishes, rank 1 receives.
  std::promise<std::string> addr;
  auto fut = addr.get_future().share();
  auto share = [&](const std::string& key, const std::string& v) -> Result<std::string> {
    CHECK(key == "engine.gloo_store");
    if (!v.empty()) {
      addr.set_value(v);
      return v;
    }
    if (fut.wait_for(std::chrono::seconds(20)) != std::future_status::ready)
      return make_error(Errc::timeout, "rank 0 never shared the store address");
    return fut.get();
  };
  Result<std::unique_ptr<Runtime>> r1 = Error{};
  std::thread t1([&] {
    RuntimeOptions o;
    o.model_dir = dir.path();
    o.rank = 1;
    o.world = 2;
    o.share = share;
    o.timeout_ms = 20000;
    r1 = Runtime::start(o);
  });
  RuntimeOptions o0;
  o0.model_dir = dir.path();
  o0.world = 2;
  o0.share = share;
  o0.timeout_ms = 20000;
  auto r0 = Runtime::start(o0);
  t1.join();
  REQUIRE_MESSAGE(r0.ok(), (r0.ok() ? std::string() : r0.error().message));
  REQUIRE_MESSAGE(r1.ok(), (r1.ok() ? std::string() : r1.error().message));
  CHECK((*r1)->engine() == nullptr);
  CHECK((*r1)->status().ready);
  CHECK((*r0)->status().ready);
  auto got = generate_blocking(*(*r0)->engine(), prompt, p);
  REQUIRE(got.ok());
  CHECK(got->tokens == want->tokens);
  CHECK((*r1)->load_report().bytes_read < (*single)->load_report().bytes_read);
  (*r0)->stop();
  (*r1)->stop();  // returns: rank 0 told the worker to stop
  auto s1 = (*r1)->status();
  CHECK_FALSE(s1.fatal);
  CHECK_FALSE(s1.ready);
}

TEST_CASE("runtime: engine options come from SLOTS, CONTEXT_LEN, PREFILL_CHUNK and KV_DTYPE") {
  test::TempDir dir;
  auto path =
      dir.write("ring.env", "NODE0_SSH=local\nSLOTS=3\nCONTEXT_LEN=256\nPREFILL_CHUNK=48\n");
  auto cfg = load_config(path, Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? std::string() : cfg.error().message));
  auto o = daemon::engine_options_from(*cfg);
  REQUIRE_MESSAGE(o.ok(), (o.ok() ? std::string() : o.error().message));
  CHECK(o->slots == 3);
  CHECK(o->max_context == 256);
  CHECK(o->max_batch_tokens == 48);
  auto dflt = load_config(dir.write("d.env", "NODE0_SSH=local\n"), Environment{}, nullptr);
  REQUIRE(dflt.ok());
  CHECK(daemon::engine_options_from(*dflt)->max_batch_tokens == 256);  // the documented default
  // A chunk the engine cannot size for is refused where the file says it, before start.
  auto huge = load_config(dir.write("huge.env", "NODE0_SSH=local\nPREFILL_CHUNK=99999999999\n"),
                          Environment{}, nullptr);
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().message.find("huge.env:2") != std::string::npos);
  CHECK(huge.error().message.find("PREFILL_CHUNK must be 1-1048576") != std::string::npos);
  auto fp16 = load_config(dir.write("fp16.env", "NODE0_SSH=local\nKV_DTYPE=fp16\n"), Environment{},
                          nullptr);
  REQUIRE(fp16.ok());
  auto bad = daemon::engine_options_from(*fp16);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::unsupported);
  CHECK(bad.error().message.find("KV_DTYPE=fp16") != std::string::npos);
  // fp8 reaches the engine: on the CPU its fp32 pools hold e4m3 values, and status says fp8.
  auto fp8 =
      load_config(dir.write("fp8.env", "NODE0_SSH=local\nKV_DTYPE=fp8\n"), Environment{}, nullptr);
  REQUIRE(fp8.ok());
  auto o8 = daemon::engine_options_from(*fp8);
  REQUIRE_MESSAGE(o8.ok(), (o8.ok() ? std::string() : o8.error().message));
  CHECK(o8->kv_dtype == "fp8");
  // The sizes reach the engine: 3 slots x 256 tokens of 16-token blocks.
  auto mdir = dir / "m";
  REQUIRE(write_random_checkpoint(mdir, {small_config(Family::llama), DType::f32, 1, 1}).ok());
  RuntimeOptions ro;
  ro.model_dir = mdir;
  ro.engine = *o;
  auto rt = Runtime::start(ro);
  REQUIRE(rt.ok());
  CHECK((*rt)->engine()->stats().blocks_total == 3 * 256 / 16);
  CHECK((*rt)->engine()->max_context() == 256);
  CHECK((*rt)->engine()->stats().kv_dtype == "fp32");
  (*rt)->stop();
  ro.engine = *o8;
  auto rt8 = Runtime::start(ro);
  REQUIRE_MESSAGE(rt8.ok(), (rt8.ok() ? std::string() : rt8.error().message));
  CHECK((*rt8)->engine()->stats().kv_dtype == "fp8");
  (*rt8)->stop();
  // Latent attention keeps a latent cache, which has no fp8 form: refused at start, naming
  // the setting.
  auto ldir = dir / "mla";
  REQUIRE(
      write_random_checkpoint(ldir, {small_config(Family::deepseek_v3), DType::f32, 1, 1}).ok());
  ro.model_dir = ldir;
  auto rt_mla = Runtime::start(ro);
  REQUIRE_FALSE(rt_mla.ok());
  CHECK(rt_mla.error().code == Errc::unsupported);
  CHECK(rt_mla.error().message.find("KV_DTYPE=fp8") != std::string::npos);
  CHECK(rt_mla.error().message.find("latent") != std::string::npos);
}
