// Where a rank's weights and KV cache live: WEIGHTS_PLACEMENT (device memory, or host-mapped
// memory the GPU reads in place), the page cache during a load, unified memory's
// MemAvailable from a captured /proc/meminfo, and the KV memory that ranks sharing one GPU
// (or one unified-memory node) split between them. The GPU halves print SKIP without a GPU.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <future>
#include <iostream>
#include <thread>

#include "core/pagecache.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/model.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/runtime.h"
#include "kernels/cuda_stream.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

const std::string kFixtureRoot =
    std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/healthy-pair/node0";

// Rank 0's share function of the daemon's rendezvous, reduced to a promise.
struct Share {
  std::promise<std::string> addr;
  std::shared_future<std::string> fut = addr.get_future().share();
  Result<std::string> operator()(const std::string&, const std::string& v) {
    if (!v.empty()) {
      addr.set_value(v);
      return v;
    }
    if (fut.wait_for(std::chrono::seconds(30)) != std::future_status::ready)
      return make_error(Errc::timeout, "rank 0 never shared the store address");
    return fut.get();
  }
};

// Two ranks of `dir` as threads, both started with `base` (rank/world/share filled in).
std::pair<Result<std::unique_ptr<Runtime>>, Result<std::unique_ptr<Runtime>>> start_two(
    const RuntimeOptions& base) {
  auto share = std::make_shared<Share>();
  auto fn = [share](const std::string& k, const std::string& v) { return (*share)(k, v); };
  Result<std::unique_ptr<Runtime>> r1 = Error{};
  std::thread t1([&] {
    RuntimeOptions o = base;
    o.rank = 1;
    o.world = 2;
    o.share = fn;
    r1 = Runtime::start(o);
  });
  RuntimeOptions o0 = base;
  o0.world = 2;
  o0.share = fn;
  auto r0 = Runtime::start(o0);
  t1.join();
  return {std::move(r0), std::move(r1)};
}

// Rank 0's logits over a prompt (every position) and then `decode` greedy steps (the
// last position), with decode graphs on: the whole forward path over the weights.
std::vector<float> logits_run(Model& m, int decode) {
  auto cache = m.make_kv_cache(8, 16, ElemType::bf16);
  REQUIRE(cache.ok());
  REQUIRE(m.prepare(32, 1, 128, 16, true).ok());
  LocalCollective comm;
  std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> toks = {1, 40, 41, 42, 300, 7, 9, 11, 3};
  std::vector<float> all, step;
  SeqChunk c{toks.data(), static_cast<int>(toks.size()), 0, table.data(), true};
  REQUIRE(m.forward({c}, **cache, comm, &step, true).ok());
  all.insert(all.end(), step.begin(), step.end());
  const int V = m.config().vocab_size;
  int pos = static_cast<int>(toks.size());
  int32_t next =
      static_cast<int32_t>(std::max_element(step.end() - V, step.end()) - (step.end() - V));
  for (int i = 0; i < decode; ++i, ++pos) {
    SeqChunk d{&next, 1, pos, table.data(), true};
    REQUIRE(m.forward({d}, **cache, comm, &step).ok());
    all.insert(all.end(), step.begin(), step.end());
    next = static_cast<int32_t>(std::max_element(step.begin(), step.end()) - step.begin());
  }
  return all;
}

}  // namespace

TEST_CASE("engine: WEIGHTS_PLACEMENT parses auto, device and host-mapped and names a bad value") {
  CHECK(*parse_weights_placement("auto") == WeightsPlacement::automatic);
  CHECK(*parse_weights_placement("") == WeightsPlacement::automatic);
  CHECK(*parse_weights_placement("device") == WeightsPlacement::device);
  CHECK(*parse_weights_placement("host-mapped") == WeightsPlacement::host_mapped);
  auto bad = parse_weights_placement("mmap");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::config);
  CHECK(bad.error().message.find("WEIGHTS_PLACEMENT=mmap") != std::string::npos);
  CHECK(std::string(weights_placement_name(WeightsPlacement::host_mapped)) == "host-mapped");
  DeviceInfo cpu;
  cpu.kind = "cpu";
  cpu.name = "cpu (OpenBLAS, 1 threads)";
  CHECK(cpu.describe() == cpu.name);
  DeviceInfo gpu;
  gpu.kind = "cuda";
  gpu.name = "sm_121 (NVIDIA GB10, device 0)";
  gpu.weights = WeightsPlacement::host_mapped;
  CHECK(gpu.describe() ==
        "cuda sm_121 (NVIDIA GB10, device 0); weights host-mapped (read in place)");
}

TEST_CASE("engine: unified memory sizes from MemAvailable of a captured /proc/meminfo") {
  // The captured GB10 node says MemAvailable 117440512 kB; its GPU's own figure (what
  // cudaMemGetInfo would say) is passed as 5 GiB and must not be what unified memory uses.
  auto uma = device_memory_available(true, 5ull << 30, kFixtureRoot);
  REQUIRE_MESSAGE(uma.ok(), (uma.ok() ? std::string() : uma.error().message));
  CHECK(*uma == 117440512ull * 1024);
  auto discrete = device_memory_available(false, 5ull << 30, kFixtureRoot);
  REQUIRE(discrete.ok());
  CHECK(*discrete == 5ull << 30);
  test::TempDir t;
  std::filesystem::create_directories(t / "proc");
  {
    std::FILE* f = std::fopen((t / "proc/meminfo").c_str(), "w");
    REQUIRE(f);
    std::fputs("MemTotal: 1000 kB\nMemFree: 10 kB\n", f);
    std::fclose(f);
  }
  auto none = device_memory_available(true, 1, t.path());
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().message.find(t.path() + "/proc/meminfo: no MemAvailable line") !=
        std::string::npos);
}

TEST_CASE("engine: ranks that share a memory pool split it; the ring sizes from the tightest") {
  const uint64_t GiB = 1ull << 30;
  // Two ranks on one GPU, one alone on another: the pair's half is the tightest.
  auto p = plan_kv_memory(
      {{"a/boot/GPU-1", 80 * GiB}, {"a/boot/GPU-1", 80 * GiB}, {"b/boot/GPU-2", 50 * GiB}},
      4 * GiB);
  CHECK(p.share == 2);
  CHECK(p.rank == 0);
  CHECK(p.available == 80 * GiB);
  // Alone on its GPU, the smaller one is tighter than the pair's halves.
  p = plan_kv_memory(
      {{"a/boot/GPU-1", 80 * GiB}, {"a/boot/GPU-1", 80 * GiB}, {"b/boot/GPU-2", 30 * GiB}},
      4 * GiB);
  CHECK(p.share == 1);
  CHECK(p.rank == 2);
  // Every rank on its own pool: plain minimum.
  p = plan_kv_memory({{"a", 10 * GiB}, {"b", 9 * GiB}}, 0);
  CHECK(p.share == 1);
  CHECK(p.rank == 1);
  // A pool below the reserve leaves nothing, whatever the share.
  p = plan_kv_memory({{"a", 1 * GiB}, {"a", 1 * GiB}}, 4 * GiB);
  CHECK(p.share == 2);
  // The pool names: the CPU and unified memory draw on the host's; a discrete GPU its own.
  DeviceInfo cpu, uma, gpu;
  cpu.kind = "cpu";
  uma.kind = gpu.kind = "cuda";
  uma.unified_memory = true;
  uma.gpu_uuid = gpu.gpu_uuid = "GPU-00ff";
  CHECK(memory_pool_of(cpu) == memory_pool_of(uma));
  CHECK(memory_pool_of(gpu) == memory_pool_of(cpu) + "/GPU-00ff");
}

TEST_CASE("engine: two CPU ranks of one host learn at start that they share its memory") {
  test::TempDir dir;
  auto cfg = small_config(Family::llama);
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::bf16, 5, 1}).ok());
  RuntimeOptions o;
  o.model_dir = dir.path();
  o.timeout_ms = 20000;
  auto two = start_two(o);
  auto& r0 = two.first;
  auto& r1 = two.second;
  REQUIRE_MESSAGE(r0.ok(), (r0.ok() ? std::string() : r0.error().message));
  REQUIRE_MESSAGE(r1.ok(), (r1.ok() ? std::string() : r1.error().message));
  for (auto* r : {&*r0, &*r1}) {
    const auto& p = (*r)->kv_memory_plan();
    CHECK(p.share == 2);
    DeviceInfo cpu;
    cpu.kind = "cpu";
    CHECK(p.pool == memory_pool_of(cpu));
    CHECK(p.available > 0);
  }
  (*r0)->stop();
  (*r1)->stop();
}

TEST_CASE("engine: a load drops each tensor's page cache once read, not only at the end") {
  test::TempDir dir;
  auto cfg = small_config(Family::llama, 2048, 256, 6);
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::bf16, 9, 1}).ok());
  const std::string file = dir / "model.safetensors";
  // Make the file resident first (it was just written; read it once to be sure).
  {
    std::FILE* f = std::fopen(file.c_str(), "rb");
    REQUIRE(f);
    char buf[1 << 16];
    while (std::fread(buf, 1, sizeof(buf), f) > 0) {
    }
    std::fclose(f);
  }
  auto before = file_residency(file);
  REQUIRE(before.ok());
  if (!before->known || before->resident_bytes() < before->size / 2) {
    MESSAGE("SKIP: " << file << " is not resident after a read (page cache unknown here)");
    return;
  }
  // At the last tensor, most of the file has been read: without the per-tensor drop it
  // would all still be resident.
  uint64_t resident_at_end = 0, total = 0;
  LoadReport rep;
  rep.progress = [&](uint64_t done, uint64_t all) {
    total = all;
    if (done == all) {
      auto r = file_residency(file);
      if (r.ok()) resident_at_end = r->resident_bytes();
    }
  };
  auto m = Model::load(dir.path(), 0, 1, &rep);
  REQUIRE(m.ok());
  CHECK(total > 0);
  MESSAGE("resident before the load " << before->resident_bytes() << " of " << before->size
                                      << " bytes; at the last tensor " << resident_at_end);
  CHECK(resident_at_end < before->size / 4);
}

TEST_CASE(
    "cuda engine: host-mapped weights are read in place and give the device weights' "
    "logits exactly") {
  if (test::skip_without_cuda()) return;
  test::TempDir tmp;
  for (DType dt : {DType::bf16, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const std::string dir = tmp / dtype_name(dt);
    auto cfg = small_config(Family::qwen3, 512, 128, 3);
    REQUIRE(write_random_checkpoint(dir, {cfg, dt, 21, 2}).ok());
    std::vector<float> got[2];
    // Host-mapped first: weights read in place cannot take the norms' weights folded in, so
    // the device weights are then loaded folded or not alike, for the same arithmetic.
    bool folded = false;
    for (int i : {1, 0}) {
      CudaDeviceOptions co;
      co.weights = i == 0 ? WeightsPlacement::device : WeightsPlacement::host_mapped;
      co.fold_norms = i == 1 || folded;
      auto dev = make_cuda_device(0, co);
      REQUIRE_MESSAGE(dev.ok(), (dev.ok() ? std::string() : dev.error().message));
      CHECK((*dev)->info().weights == co.weights);
      LoadReport rep;
      auto m = Model::load(dir, 0, 1, *dev, &rep);
      REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
      if (co.weights == WeightsPlacement::device) {
        CHECK(rep.bytes_in_place == 0);
      } else if (dt == DType::bf16) {
        CHECK(rep.bytes_in_place == rep.bytes_read);  // every slice straight into place
      } else {
        // fp32 tensors are rounded to bf16 on the way: staged, converted on the GPU, and
        // written into the host-mapped weights by the conversion kernel.
        CHECK(rep.bytes_in_place == 0);
      }
      if (i == 1) folded = (*m)->norms_folded();
      CHECK((*m)->norms_folded() == (co.fold_norms && rep.bytes_in_place == 0));
      got[i] = logits_run(**m, 6);
      CHECK((*m)->graph_replays() > 0);
      std::cout << "host-mapped check (" << dtype_name(dt)
                << " checkpoint): " << (*dev)->info().describe() << ": " << rep.bytes_read
                << " bytes read, " << rep.bytes_in_place << " in place\n";
    }
    REQUIRE(got[0].size() == got[1].size());
    size_t differ = 0;
    for (size_t k = 0; k < got[0].size(); ++k)
      differ += std::memcmp(&got[0][k], &got[1][k], sizeof(float)) != 0 ? 1 : 0;
    CHECK_MESSAGE(differ == 0, differ << " of " << got[0].size() << " logits differ");
    std::cout << "host-mapped vs device weights (" << dtype_name(dt) << "): " << got[0].size()
              << " logits, " << differ << " differ\n";
  }
}

TEST_CASE("cuda engine: two ranks sharing the GPU split its free memory for their KV caches") {
  if (test::skip_without_cuda()) return;
  test::TempDir dir;
  auto cfg = small_config(Family::llama, 512, 256, 8);  // head_dim 64, 1 KV head per rank
  cfg.max_position = 4096;
  REQUIRE(write_random_checkpoint(dir.path(), {cfg, DType::bf16, 17, 1}).ok());
  REQUIRE(kernels::cuda_set_device(0).ok());
  auto before = kernels::cuda_mem_info();
  REQUIRE(before.ok());
  // 1 GiB above MEM_RESERVE is free; each rank wants 128 full contexts (1 GiB): sized alone,
  // each would take nearly all of it.
  const uint64_t room = 1ull << 30;
  RuntimeOptions o;
  o.model_dir = dir.path();
  o.device = "cuda";
  o.timeout_ms = 60000;
  o.engine.slots = 128;
  o.engine.max_context = 4096;
  o.engine.kv_cache_bytes = ~0ull;
  o.engine.kv_from_free_memory = true;
  o.engine.mem_reserve = before->free_bytes - room;
  auto two = start_two(o);
  auto& r0 = two.first;
  auto& r1 = two.second;
  REQUIRE_MESSAGE(r0.ok(), (r0.ok() ? std::string() : r0.error().message));
  REQUIRE_MESSAGE(r1.ok(), (r1.ok() ? std::string() : r1.error().message));
  const auto& plan = (*r0)->kv_memory_plan();
  CHECK(plan.share == 2);
  const auto st = (*r0)->engine()->stats();
  const uint64_t per_block =
      KVCache::block_bytes(ElemType::bf16, cfg.num_layers, 16, 1, cfg.head_dim);
  const uint64_t each = static_cast<uint64_t>(st.blocks_total) * per_block;
  std::cout << "two ranks on one GPU: " << (room >> 20) << " MiB above MEM_RESERVE, "
            << plan.available / (1 << 20) << " MiB free at sizing, each KV cache " << (each >> 20)
            << " MiB (" << st.blocks_total << " blocks)\n";
  CHECK(2 * each <= room);             // together they fit what was free
  CHECK(4 * each >= room);             // and each took its share, not a sliver
  CHECK(st.blocks_total < 128 * 256);  // the budget bound, not SLOTS
  (*r0)->stop();
  (*r1)->stop();
}
