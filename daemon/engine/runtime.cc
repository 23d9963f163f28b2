#include "daemon/engine/runtime.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/tcp_store.h"

namespace spark::engine {

namespace {
constexpr const char* kStoreKey = "engine.gloo_store";

// One rank's entry of the KV memory exchange: fixed size for the all-gather.
struct MemoryWire {
  char pool[240];
  uint64_t available;
};

// Every rank's pool and free memory, over the host collective (all ranks call it alike).
Result<std::vector<RankMemory>> exchange_memory(Collective& comm, const RankMemory& mine) {
  MemoryWire w{};
  std::snprintf(w.pool, sizeof(w.pool), "%s", mine.pool.c_str());
  w.available = mine.available;
  std::vector<MemoryWire> all(static_cast<size_t>(comm.world_size()));
  SPARK_TRY(comm.all_gather(&w, all.data(), sizeof(w)));
  std::vector<RankMemory> out;
  for (auto& a : all) {
    a.pool[sizeof(a.pool) - 1] = 0;
    out.push_back({a.pool, a.available});
  }
  return out;
}
}  // namespace

std::string memory_pool_of(const DeviceInfo& info) {
  // The kernel's boot id names the machine's memory: processes in containers or network
  // namespaces of one host share it (and its GPUs), cloned nodes with one hostname do not.
  std::string pool =
      "boot:" + std::string(trim(read_file("/proc/sys/kernel/random/boot_id").value_or("")));
  if (pool == "boot:") {
    char host[256] = {0};
    if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
    pool = std::string("host:") + host;
  }
  // A discrete GPU's memory is its own; unified memory and the CPU draw on the host's.
  if (info.kind == "cuda" && !info.unified_memory) pool += "/" + info.gpu_uuid;
  return pool;
}

KvMemoryPlan plan_kv_memory(const std::vector<RankMemory>& ranks, uint64_t reserve) {
  KvMemoryPlan best;
  bool first = true;
  uint64_t best_each = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    int share = 0;
    for (const auto& o : ranks) share += o.pool == ranks[r].pool ? 1 : 0;
    const uint64_t a = ranks[r].available;
    const uint64_t each = (a > reserve ? a - reserve : 0) / static_cast<uint64_t>(share);
    if (first || each < best_each) {
      first = false;
      best_each = each;
      best = {a, share, static_cast<int>(r), ranks[r].pool};
    }
  }
  return best;
}

Result<std::unique_ptr<Runtime>> Runtime::start(RuntimeOptions o) {
  std::unique_ptr<Runtime> rt(new Runtime());
  auto progress = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  progress("choosing the device");
  CudaDeviceOptions copts;
  auto placement = parse_weights_placement(o.weights_placement);
  if (!placement) return placement.error();
  copts.weights = *placement;
  copts.proc_root = o.proc_root;
  auto dev = select_device(o.device, o.device_ordinal, &rt->device_fallback_, copts);
  if (!dev)
    return make_error(dev.error().code, fmt::format("rank {}: {}", o.rank, dev.error().message));
  if (!rt->device_fallback_.empty())
    log::warn("engine", "rank {}: {}", o.rank, rt->device_fallback_);
  rt->device_ = (*dev)->info().describe();
  rt->device_kind_ = (*dev)->info().kind;
  progress("loading weights onto " + rt->device_);
  rt->load_.cancel = o.cancel;
  // "n of m GiB" in /health, once per percent: a 100 GiB load takes minutes.
  rt->load_.progress = [&, last = -1](uint64_t done, uint64_t total) mutable {
    const int pct = total ? static_cast<int>(done * 100 / total) : 100;
    if (pct == last) return;
    last = pct;
    constexpr double GiB = 1024.0 * 1024.0 * 1024.0;
    progress(fmt::format("loading weights onto {}: {:.1f} of {:.1f} GiB ({}%)", rt->device_,
                         static_cast<double>(done) / GiB, static_cast<double>(total) / GiB, pct));
  };
  auto split = plan::parse_moe_split(o.expert_parallel);
  if (!split) return split.error();
  rt->load_.expert_placement = *split;
  auto m = Model::load(o.model_dir, o.rank, o.world, *dev, &rt->load_);
  rt->load_.progress = nullptr;  // it refers to this frame
  if (!m) return m.error();
  rt->model_info_ = (*m)->describe();
  if ((*m)->config().is_moe())
    log::info("engine", "rank {}: experts {} ({})", o.rank,
              plan::moe_split_name((*m)->shard_plan().placement),
              (*m)->shard_plan().placement_reason);
  log::info("engine",
            "rank {}: loaded {} onto {} ({} MiB read, {} MiB of it in place, {} MiB held, "
            "{:.2f} s)",
            o.rank, (*m)->config().architecture, rt->device_, rt->load_.bytes_read >> 20,
            rt->load_.bytes_in_place >> 20, rt->load_.weight_bytes >> 20, rt->load_.seconds);
  if (o.world > 1) {
    GlooOptions g;
    g.rank = o.rank;
    g.world = o.world;
    g.bind_host = o.bind_host;
    g.store_host = o.store_host.empty() ? o.bind_host : o.store_host;
    g.store_port = o.store_port;
    g.timeout_ms = o.timeout_ms;
    g.rendezvous_timeout_ms = o.rendezvous_timeout_ms;
    g.store = o.store;
    g.missing_ranks = o.missing_ranks;
    std::shared_ptr<TcpStoreServer> server;
    if (!g.store && g.store_port == 0) {
      if (!o.share)
        return make_error(Errc::internal,
                          "runtime: world > 1 without a store port needs a share function");
      std::string mine;
      if (o.rank == 0) {
        auto s = start_rendezvous_store(g.store_host, 0);
        if (!s) return s.error();
        server = *s;
        mine = fmt::format("{}:{}", g.store_host, server->port());
      }
      progress("joining the tensor-parallel mesh");
      auto addr = o.share(kStoreKey, mine);
      if (!addr) return addr.error();
      auto colon = addr->rfind(':');
      auto port = colon == std::string::npos ? std::nullopt : parse_i64(addr->substr(colon + 1));
      if (!port)
        return make_error(Errc::internal, "runtime: bad store address from rendezvous: " + *addr);
      g.store_host = addr->substr(0, colon);
      g.store_port = static_cast<int>(*port);
    } else {
      progress("joining the tensor-parallel mesh");
    }
    auto c = GlooCollective::connect(g);
    if (!c) return c.error();
    rt->comm_ = *c;
    rt->store_ = std::move(server);
  } else {
    rt->comm_ = std::make_shared<LocalCollective>();
  }
  if (o.world > 1) {
    // Ranks sharing one GPU (or one unified-memory node) would each size their KV cache
    // from the same free memory and together take it several times over: the ring learns
    // which ranks share a pool and sizes from its tightest rank's share.
    RankMemory mine{memory_pool_of((*m)->device().info()), 0};
    if (auto a = (*m)->device().available_bytes(); a) mine.available = *a;
    auto all = exchange_memory(*rt->comm_, mine);
    if (!all)
      return make_error(all.error().code,
                        fmt::format("rank {}: exchanging free memory for the KV cache: {}", o.rank,
                                    all.error().message));
    rt->kv_plan_ = plan_kv_memory(*all, o.engine.mem_reserve);
    o.engine.kv_memory_available = rt->kv_plan_.available;
    o.engine.kv_memory_share = rt->kv_plan_.share;
    o.engine.kv_memory_where = fmt::format("rank {}", rt->kv_plan_.rank);
    if (rt->kv_plan_.share > 1)
      log::info("engine",
                "rank {}: {} ranks share rank {}'s memory ({} MiB free): each KV cache gets a "
                "{}th of it after MEM_RESERVE",
                o.rank, rt->kv_plan_.share, rt->kv_plan_.rank, rt->kv_plan_.available >> 20,
                rt->kv_plan_.share);
  }
  if (o.nccl) {
    SPARK_TRY(rt->connect_nccl(o, progress));
  } else if (o.world > 1 && rt->device_kind_ == "cuda") {
    // GPU ranks without NCCL (COLLECTIVE=gloo, or several ranks sharing one GPU, which NCCL
    // refuses): the activations go through Gloo staged in page-locked host memory, and
    // decode steps run eagerly (a host wait cannot be captured in a CUDA graph).
    log::info("engine",
              "rank {}: tensor parallel on {} over Gloo, staged through host memory (decode "
              "steps eager; NCCL keeps them in CUDA graphs)",
              o.rank, rt->device_);
    rt->comm_ = std::make_shared<HostStagedCollective>(rt->comm_);
  }
  if (o.rank == 0) {
    EngineOptions eo = o.engine;
    eo.control_timeout_ms = o.timeout_ms;  // the control plane's waits: as the collectives'
    auto e = Engine::start(std::move(*m), rt->comm_, eo);
    if (!e) return e.error();
    rt->engine_ = std::move(*e);
    if (o.warmup) {  // ready means a real completion came back, through every rank
      progress("warm-up completion");
      const auto& c = rt->engine_->config();
      SamplingParams p;
      p.temperature = 0;
      p.max_tokens = 1;
      p.ignore_eos = true;
      auto w = generate_blocking(*rt->engine_, {c.bos_token_id >= 0 ? c.bos_token_id : 0}, p,
                                 o.timeout_ms);
      if (!w) return make_error(w.error().code, "warm-up completion failed: " + w.error().message);
    }
  } else {
    rt->worker_model_ = std::move(*m);
    rt->worker_ = std::thread([p = rt.get()] {
      auto st = run_tp_worker(*p->worker_model_, *p->comm_);
      std::lock_guard<std::mutex> lk(p->mu_);
      if (!st.ok()) p->worker_error_ = st.message();
      p->worker_done_ = true;
    });
  }
  rt->opts_ = std::move(o);
  return rt;
}

Status Runtime::connect_nccl(const RuntimeOptions& o,
                             const std::function<void(const std::string&)>& progress) {
  NcclOptions n = o.nccl_options;
  n.rank = o.rank;
  n.world = o.world;
  // The unique id goes through the ring's store (or the share function), published by rank 0.
  NcclCollective::ShareFn share;
  if (o.store) {
    auto store = o.store;
    const auto wait = std::chrono::milliseconds(o.rendezvous_timeout_ms);
    share = [store, wait, rank = o.rank](const std::string& key,
                                         const std::string& v) -> Result<std::string> {
      if (rank == 0) {
        SPARK_TRY(store->set(key, v));
        return v;
      }
      return store->get(key, wait);
    };
  } else {
    share = o.share;
  }
  progress("connecting NCCL");
  auto c = NcclCollective::connect_via(n, share, comm_);
  if (!c) return c.error();
  nccl_ = *c;
  comm_ = nccl_;
  if (!o.fabric_test) return Status::Ok();
  progress("fabric self-test");
  FabricExpect e = o.fabric_expect;
  e.rank = o.rank;
  e.world = o.world;
  auto r = run_fabric_test(*nccl_, o.fabric, e, o.nccl_debug_file);
  if (!r) return make_error(r.error().code, "fabric self-test: " + r.error().message);
  fabric_ = std::move(*r);
  log::info("engine", "rank {}: fabric self-test {} in {:.2f} s", o.rank, fabric_->summary(),
            fabric_->seconds);
  // Every rank's figures reach rank 0's /health through the ring's store.
  if (o.store)
    fabric_all_ = exchange_fabric_reports(*o.store, *fabric_, o.rank, o.world, o.fabric.timeout);
  for (const auto& line : split_list(render_fabric_table({*fabric_}), '\n'))
    log::info("engine", "{}", line);
  if (!fabric_->passed())
    return make_error(Errc::precondition,
                      "fabric self-test failed: " + join(fabric_->failures, "; "));
  return Status::Ok();
}

std::vector<FabricReport> exchange_fabric_reports(RendezvousStore& store, const FabricReport& mine,
                                                  int rank, int world,
                                                  std::chrono::milliseconds timeout) {
  const std::string key = "engine.fabric.rank";
  if (Status st = store.set(key + std::to_string(rank), to_json(mine).dump()); !st.ok())
    log::warn("engine", "rank {}: publishing the fabric report: {}", rank, st.message());
  std::vector<FabricReport> all;
  if (rank != 0) return all;
  all.push_back(mine);
  for (int peer = 1; peer < world; ++peer) {
    auto v = store.get(key + std::to_string(peer), timeout);
    Result<FabricReport> rep =
        v ? fabric_report_from_json(nlohmann::json::parse(*v, nullptr, false)) : v.error();
    if (rep)
      all.push_back(std::move(*rep));
    else
      log::warn("engine", "rank 0: rank {}'s fabric report: {}", peer, rep.error().message);
  }
  return all;
}

void Runtime::abort_collectives(const std::string& why) {
  if (nccl_) nccl_->abort(why);
}

Runtime::~Runtime() {
  stop();
}

void Runtime::stop() {
  if (engine_) engine_->stop();
  if (worker_.joinable()) worker_.join();  // rank 0's stop (or a collective deadline) ends it
}

RuntimeStatus Runtime::status() const {
  RuntimeStatus s;
  s.device = device_;
  s.device_kind = device_kind_;
  s.device_fallback = device_fallback_;
  s.model = model_info_;
  if (engine_) {
    s.stats = engine_->stats();
    s.fatal = s.stats.failed;
    s.ready = !s.fatal;
    s.reason = s.fatal ? s.stats.error : "serving";
    return s;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (worker_done_) {
    s.fatal = !worker_error_.empty();
    s.reason = s.fatal ? worker_error_ : "rank 0 stopped the engine";
  } else {
    s.ready = true;
    s.reason = fmt::format("serving rank 0's steps as rank {}", opts_.rank);
  }
  return s;
}

}  // namespace spark::engine
